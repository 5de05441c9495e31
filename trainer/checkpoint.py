"""Atomic, resumable checkpoints.

Layout of ``<run_dir>/step_<N>/``::

    policy/              HF folder (config, safetensors, tokenizer): vLLM and transformers load it directly
    anchor.safetensors   the EMA anchor (absent when training without an anchor)
    optimizer.pt         AdamW state (full, world-size independent), loaded with weights_only=True
    scheduler.pt         LR scheduler state
    rng_rank<R>.pt       python / numpy / torch (and CUDA) RNG states of each rank
    trainer_state.json   step, data-loader position, consecutive-NaN counter, anything the loop needs
    config.yaml          the resolved config of the run

A checkpoint is written into a hidden temp folder next to its final place, every
file is fsynced, and the folder is renamed into place: a crash at any moment leaves
either the previous checkpoints or the complete new one, never half a checkpoint.
``<run_dir>/latest`` (a one-line text file naming the folder) is replaced
atomically after the rename, and older checkpoints beyond ``keep_last`` are removed.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from emapg.atomic import write_text_atomic, fsync_dir

from emapg.config import dump_yaml

LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` hands back besides the states it restores in place."""

    path: Path
    step: int
    trainer_state: dict[str, Any]
    anchor_state: dict[str, torch.Tensor] | None = field(default=None, repr=False)


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temp folders are ignored)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for p in run_dir.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / "trainer_state.json").is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint named by ``latest``, else the highest complete ``step_N``; None if there is none."""
    run_dir = Path(run_dir)
    pointer = run_dir / LATEST
    if pointer.is_file():
        target = run_dir / pointer.read_text().strip()
        if (target / "trainer_state.json").is_file():
            return target
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def resolve_resume(path: str | Path) -> Path:
    """Accept a run folder (-> its latest checkpoint) or a ``step_N`` folder."""
    path = Path(path)
    if (path / "trainer_state.json").is_file():
        return path
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint found in {path}")
    return ckpt


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


def rng_state() -> dict[str, Any]:
    """RNG states as plain tensors/tuples (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(np.asarray(keys).astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    policy_state: dict[str, torch.Tensor] | None,
    model: Any,
    tokenizer: Any,
    anchor_state: dict[str, torch.Tensor] | None,
    optimizer_state: dict[str, Any] | None,
    scheduler_state: dict[str, Any] | None,
    trainer_state: dict[str, Any],
    config: Any,
    keep_last: int = 0,
    rank: int = 0,
    world_size: int = 1,
    barrier: Any = None,
) -> Path:
    """Write ``<run_dir>/step_<step>`` atomically and point ``latest`` at it.

    ``policy_state`` is the full (unsharded) state dict, present on rank 0 only under
    FSDP; ``model`` supplies ``save_pretrained``'s config. Every rank calls this; rank 0
    writes the shared files into the temp folder, each rank writes its own RNG file,
    and rank 0 renames after a barrier.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / step_dir_name(step)
    tmp = run_dir / f".tmp-{step_dir_name(step)}"
    sync = barrier or (lambda: None)
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    sync()
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        model.save_pretrained(tmp / "policy", state_dict=policy_state, safe_serialization=True)
        tokenizer.save_pretrained(tmp / "policy")
        if anchor_state is not None:
            from safetensors.torch import save_file

            save_file({k: v.detach().cpu().contiguous() for k, v in anchor_state.items()}, str(tmp / "anchor.safetensors"))
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / "optimizer.pt")
        if scheduler_state is not None:
            torch.save(scheduler_state, tmp / "scheduler.pt")
        state = dict(trainer_state, step=step, world_size=world_size)
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
        dump_yaml(config, tmp / "config.yaml")
    sync()
    if rank == 0:
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step (e.g. after resuming from it): swap atomically via a trash name
            trash = run_dir / f".old-{final.name}"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(run_dir)
        write_text_atomic(run_dir / LATEST, final.name + "\n")
        if keep_last > 0:
            for old in list_checkpoints(run_dir)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    sync()
    return final


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "trainer_state.json").read_text())


def load_checkpoint(path: str | Path, *, rank: int = 0, restore_rng: bool = True) -> Checkpoint:
    """Read a checkpoint's step, trainer state and anchor, and restore this rank's RNG.

    The policy weights are loaded by building the model from ``<path>/policy``; the
    optimizer and scheduler states by :func:`load_optimizer_state` /
    :func:`load_scheduler_state` once those objects exist.
    """
    path = Path(path)
    state = load_trainer_state(path)
    anchor = None
    if (path / "anchor.safetensors").is_file():
        from safetensors.torch import load_file

        anchor = load_file(str(path / "anchor.safetensors"))
    if restore_rng:
        rng_file = path / f"rng_rank{rank}.pt"
        if not rng_file.is_file():
            raise FileNotFoundError(
                f"{rng_file} is missing: the checkpoint was written by {state.get('world_size', 1)} ranks; "
                "resume with the same number of processes"
            )
        set_rng_state(torch.load(rng_file, weights_only=True))
    return Checkpoint(path=path, step=int(state["step"]), trainer_state=state, anchor_state=anchor)


def load_optimizer_state(path: str | Path) -> dict[str, Any] | None:
    f = Path(path) / "optimizer.pt"
    return torch.load(f, weights_only=True, map_location="cpu") if f.is_file() else None


def load_scheduler_state(path: str | Path) -> dict[str, Any] | None:
    f = Path(path) / "scheduler.pt"
    return torch.load(f, weights_only=True) if f.is_file() else None
