"""Reading a run folder's files for ``emapg view``: the one place the viewer touches the disk.

A run folder is written by another process (the trainer, ``emapg eval``), may still be written to, and may be
damaged: a kill mid-write tears the last line (items are raw UTF-8, so a line can end mid-character), a disk fills, a
hand edit leaves a line that is not JSON, or a record whose fields have the wrong types. The viewer must show what is
readable and say what is not, never fail a request on it. So every reader here:

* opens **regular files only**, and only **inside the run folder**: a named pipe (which would block the reader
  forever), a device, a socket or a folder in a file's place is reported, never opened (the open is non-blocking and
  checked with ``fstat`` on the descriptor, so nothing can swap the file between the check and the read); a symlink
  is followed only when its target stays inside the run folder (a link out of it, e.g. to ``/etc/passwd``, is
  reported as outside the run). At most :data:`MAX_FILE_BYTES` of a file are read;
* reads **line by line from bytes** (:func:`emapg.jsonl.parse_lines`, what the trainer's own readers use): each line
  is decoded on its own (a torn UTF-8 line is one skipped record, not an unreadable file), parsed as JSON with ``NaN``/``Infinity`` as null (the trainer writes them bare), and kept only
  when it is an object no deeper than :data:`MAX_RECORD_DEPTH` levels whose strings are valid Unicode (a lone
  surrogate escape would make the answer unencodable);
* **counts** what it skipped (:class:`FileReport`), which the API shows with the run (``problems``).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from collections.abc import Callable
from pathlib import Path
from typing import Any

from emapg.jsonl import parse_lines
from emapg.server_input import HTTPError, check_json_value

__all__ = ["MAX_FILE_BYTES", "MAX_RECORD_DEPTH", "FileReport", "RunFiles", "int_field"]

#: The most bytes read of one file (a larger one is read up to here and reported as cut).
MAX_FILE_BYTES = 1 << 30
#: Records nested deeper are skipped (real ones are under 6 levels; the answer's encoder recurses).
MAX_RECORD_DEPTH = 32


@dataclass
class FileReport:
    """What reading one file skipped: ``skipped`` lines (torn, not JSON, not an object, too deep, invalid Unicode),
    and ``unreadable``: why the file was not read at all (None: it was)."""

    skipped: int = 0
    unreadable: str | None = None
    cut: bool = False

    def as_json(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "unreadable": self.unreadable, "cut": self.cut}


NOT_REGULAR = "not a regular file (a named pipe, a device, a socket or a folder): not opened"
OUTSIDE = "a link to a file outside the run folder: not followed"


def _read_regular(path: Path, report: FileReport) -> bytes | None:
    """At most :data:`MAX_FILE_BYTES` of ``path`` when it is a regular file (checked on the open descriptor, opened
    non-blocking: a named pipe put there since the caller's check neither blocks nor is read); None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        report.unreadable = f"cannot open it: {e.strerror}"
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            report.unreadable = NOT_REGULAR
            return None
        chunks, size = [], 0
        while size <= MAX_FILE_BYTES:
            chunk = os.read(fd, min(16 << 20, MAX_FILE_BYTES + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        report.unreadable = f"cannot read it: {e.strerror}"
        return None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_FILE_BYTES:
        data, report.cut = data[:MAX_FILE_BYTES], True
    return data


def _constant(_name: str) -> None:
    return None  # NaN, Infinity, -Infinity: what the trainer writes for a non-finite number; shown as missing


def _showable(value: Any) -> bool:
    """Whether a parsed record is one the viewer can show: an object, not too deep, valid Unicode."""
    if not isinstance(value, dict):
        return False
    try:
        check_json_value(value, "record", max_depth=MAX_RECORD_DEPTH)
    except HTTPError:
        return False
    return True


def int_field(value: Any, default: int | None = 0) -> int | None:
    """A record's integer field (a step, a count): an int, or a whole finite float; ``default`` when missing (None),
    None when it is something else (a string, a boolean, a list)."""
    if value is None:
        return default
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


@dataclass
class RunFiles:
    """The files of one run folder ``root`` (resolved), read safely and cached by size and modification time."""

    root: Path
    reports: dict[str, FileReport] = field(default_factory=dict)
    _cache: dict[str, tuple[tuple[int, int], Any]] = field(default_factory=dict, repr=False)

    def path(self, name: str) -> Path:
        return self.root / name

    def _inside(self, path: Path) -> bool:
        try:
            return path.resolve().is_relative_to(self.root)
        except (OSError, RuntimeError):  # a symlink loop
            return False

    def is_file(self, name: str) -> bool:
        """Whether ``name`` is a regular file inside the run folder (what the readers would read)."""
        path = self.path(name)
        try:
            return stat.S_ISREG(path.stat().st_mode) and self._inside(path)
        except OSError:
            return False

    def is_dir(self, name: str) -> bool:
        path = self.path(name)
        try:
            return stat.S_ISDIR(path.stat().st_mode) and self._inside(path)
        except OSError:
            return False

    def listing(self, folder: str, suffix: str) -> list[str]:
        """The names (without ``suffix``) of the regular files ending in ``suffix`` in the subfolder ``folder``."""
        if not self.is_dir(folder):
            return []
        try:
            names = sorted(e.name for e in os.scandir(self.path(folder)) if e.name.endswith(suffix))
        except OSError:
            return []
        return [n[: -len(suffix)] for n in names if self.is_file(f"{folder}/{n}")]

    def _cached(self, name: str, parse) -> Any:
        """``parse(bytes, report)`` of the file ``name``, re-read only when its size or mtime changed; None when it is
        absent or not readable (then :attr:`reports` says why)."""
        path = self.path(name)
        try:
            st = path.stat()
        except FileNotFoundError:
            self.reports.pop(name, None)
            self._cache.pop(name, None)
            return None
        except OSError as e:
            return self._unreadable(name, f"cannot stat it: {e.strerror}")
        if not stat.S_ISREG(st.st_mode):
            return self._unreadable(name, NOT_REGULAR)
        if not self._inside(path):
            return self._unreadable(name, OUTSIDE)
        key = (st.st_size, st.st_mtime_ns)
        hit = self._cache.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        report = FileReport()
        data = _read_regular(path, report)
        if data is None:
            return self._unreadable(name, report.unreadable or "cannot read it")
        value = parse(data, report)
        self.reports[name] = report
        self._cache[name] = (key, value)
        return value

    def _unreadable(self, name: str, why: str) -> None:
        self.reports[name] = FileReport(unreadable=why)
        self._cache.pop(name, None)
        return None

    def records(self, name: str, keep: Callable[[dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
        """The records of the JSON-lines file ``name`` (module docstring) that ``keep`` accepts (one it refuses, or
        raises on -- a field of the wrong type -- is skipped and counted); [] when absent or unreadable."""

        def parse(data: bytes, report: FileReport) -> list[dict[str, Any]]:
            parsed, report.skipped = parse_lines(data, parse_constant=_constant)
            out = []
            for record in parsed:
                try:
                    shown = _showable(record) and (keep is None or keep(record))
                except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError):
                    shown = False
                if shown:
                    out.append(record)
                else:
                    report.skipped += 1
            return out

        return self._cached(name, parse) or []

    def document(self, name: str) -> dict[str, Any]:
        """The JSON object in the file ``name`` ({} when absent, unreadable or not such an object: then reported)."""

        def parse(data: bytes, report: FileReport) -> dict[str, Any]:
            try:
                record = json.loads(data.decode("utf-8"), parse_constant=_constant)
            except (UnicodeDecodeError, ValueError, RecursionError):
                record = None
            if not _showable(record):
                report.skipped = 1
                return {}
            return record

        return self._cached(name, parse) or {}

    def problems(self) -> dict[str, dict[str, Any]]:
        """Each file that had something skipped or could not be read: its :class:`FileReport`."""
        return {name: r.as_json() for name, r in sorted(self.reports.items()) if r.skipped or r.unreadable or r.cut}
