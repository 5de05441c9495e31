"""Atomic file writes: a reader (or a process killed mid-write) sees the old file or the new one, never a mix."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import IO, Callable

import numpy as np


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write through ``write(file)`` into a temp file beside ``path``, fsync, then rename over ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def save_npy_atomic(path: str | Path, array: np.ndarray) -> None:
    write_atomic(path, lambda f: np.save(f, array))


def write_folder_atomic(target: str | Path, build: Callable[[Path], object]) -> Path:
    """Build a folder through ``build(tmp)`` beside ``target`` and rename it into place.

    A folder already at ``target`` is replaced: it is moved aside first and deleted after the
    rename, so ``target`` is never a half-written folder (at worst briefly absent).
    """
    import shutil

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    old = None
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; model folders are shared (containers, other users)
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return target
