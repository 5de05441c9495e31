"""Atomic, resumable checkpoints that verify themselves.

Layout of ``<run_dir>/step_<N>/``::

    policy/              HF folder (config, safetensors, tokenizer): vLLM and transformers load it directly
    state/               AdamW state and the EMA anchor, a torch.distributed.checkpoint (DCP) folder: one
                         ``__<rank>_0.distcp`` per rank that wrote it plus ``.metadata`` (:mod:`trainer.reshard`)
    scheduler.pt         LR scheduler state
    rng_rank<R>.pt       python / numpy / torch (and CUDA) RNG states of each rank
    trainer_state.json   step, world size, data-loader position (global), consecutive-NaN counter, anything the loop needs
    config.yaml          the resolved config of the run
    trained_questions.json  hashes of the questions the run trains on (tasks.contamination), also in policy/
    manifest.json        written last: the size and sha256 of every other file (see below)

A checkpoint is written into a hidden temp folder next to its final place; every file
is fsynced and hashed, ``manifest.json`` is written (atomically) last, and the folder
is renamed into place: a crash at any moment leaves either the previous checkpoints or
the complete new one, never half a checkpoint. ``<run_dir>/latest`` (a one-line text
file naming the folder) is replaced atomically after the rename, and older checkpoints
beyond ``keep_last`` are removed.

**Verification.** The manifest records each file's size and the sha256 of each
``PIECE_BYTES`` piece of it (a file smaller than a piece has one digest, which is its
plain ``sha256sum``). Pieces let a multi-GB checkpoint be hashed by all cores at once;
reading is streamed in 8 MiB blocks, so memory stays flat whatever the size.
Two levels:

* ``verify="size"`` (what :func:`latest_checkpoint` does): every listed file exists with
  its recorded size, and ``trainer_state.json`` parses. Metadata only: milliseconds.
* ``verify="sha256"`` (what :func:`resolve_resume`, i.e. ``emapg train --resume``, does):
  the size check plus every byte re-hashed and compared. Catches bit rot and
  same-size damage; costs one read of the checkpoint. Measured by ``benchmarks/checkpoint_hash.py``
  on the 2-core dev VM: 2.5 GB/s with the files in the page cache (1.8x one serial sha256 per
  file), 1.25 GB/s from its disk (disk-bound); a 3B run's 49 GB (fp32 policy, anchor, Adam)
  would take ~20 s / ~40 s there. Writing the manifest at save re-reads the just-written files
  from the page cache (1.5 GB/s there, rank 0 only).

A damaged checkpoint (a file missing, truncated, of the wrong size, with a checksum
mismatch, or an unparsable ``trainer_state.json`` / ``manifest.json``) is skipped with a
warning naming the file, and the newest intact one is used; when none is intact,
:class:`CheckpointError` names what is wrong with each. Under FSDP every rank runs the
same checks over all files (the shared files and every rank's ``rng_rank<R>.pt``), so all
ranks reach the same decision without communicating.

**Resuming at another world size.** Nothing in a checkpoint depends on the number of ranks that wrote
it: the policy is a full HF folder, DCP reads ``state/`` into the resuming run's sharding, the data
position is a count in the one global prompt order (every rank draws the whole global batch and keeps
its share), and each rank's RNG is restored from ``rng_rank<R>.pt`` at the same world size or, at
another, re-derived from (``run.seed``, step, rank) (:func:`derived_rng_seed`). Format-2 checkpoints
(``optimizer.pt`` holding the full AdamW state, ``anchor.safetensors``) load at any world size too;
writing the next checkpoint converts the run.

**Checkpoints written before manifests** (no ``manifest.json``, no ``checkpoint_format``
in ``trainer_state.json``) still resume: they are reported as unverified, and checked
structurally instead (``trainer_state.json`` parses; each safetensors header matches its
file size; each ``.pt`` zip archive is readable, and with ``verify="sha256"`` passes its
per-record CRC-32), so a truncated old checkpoint still falls back instead of failing
mid-load; a flipped bit in old safetensors weights cannot be detected. A checkpoint
whose ``trainer_state.json`` says it was written with a manifest but has none is damaged,
not old.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import struct
import zipfile
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors import SafetensorError

from emapg.atomic import fsync_dir, write_text_atomic
from emapg.config import dump_yaml
from emapg.errors import UserError

log = logging.getLogger(__name__)

LATEST = "latest"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
# 2: with manifest.json. Recorded in trainer_state.json so that a lost manifest is not mistaken for an old checkpoint.
# 3: optimizer and anchor in a DCP ``state/`` folder (resharding), instead of optimizer.pt / anchor.safetensors.
CHECKPOINT_FORMAT = 3
STATE_DIR = "state"
PIECE_BYTES = 256 << 20  # hashing granularity: 48 GB (3B policy + anchor + Adam) = ~190 pieces for the thread pool
_READ_BYTES = 8 << 20
_STEP_RE = re.compile(r"^step_(\d+)$")

Verify = Literal["sha256", "size"]
ProblemKind = Literal["missing", "truncated", "size", "checksum", "unparsable"]


class CheckpointError(UserError):
    """A checkpoint that cannot be used (damaged, or none of a run's is intact); the message names the file."""


@dataclass(frozen=True)
class CheckpointProblem:
    """One thing wrong with one file of a checkpoint."""

    file: Path
    kind: ProblemKind
    detail: str

    def __str__(self) -> str:
        return f"{self.file}: {self.detail}"

    def relative(self, folder: Path) -> str:
        """The problem with the file named relative to its checkpoint folder."""
        try:
            return f"{self.file.relative_to(folder)}: {self.detail}"
        except ValueError:
            return str(self)


@dataclass
class Verification:
    """The outcome of :func:`verify_checkpoint` on one checkpoint folder."""

    path: Path
    level: Literal["sha256", "size", "unverified"]  # "unverified": an old checkpoint without a manifest
    problems: list[CheckpointProblem] = field(default_factory=list)

    @property
    def intact(self) -> bool:
        return not self.problems

    def summary(self, *, relative: bool = False) -> str:
        """One line: the first problem (its file relative to the checkpoint if asked) and how many more."""
        if not self.problems:
            return f"{self.path}: intact ({self.level})"
        first = self.problems[0].relative(self.path) if relative else str(self.problems[0])
        more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return f"{first}{more}"


@dataclass
class CheckpointChoice:
    """Which checkpoint of a run to use, and what was found wrong with the newer ones.

    ``checked`` lists every checkpoint examined, in the order tried; ``path`` is the first
    intact one (None when none is).
    """

    path: Path | None
    checked: list[Verification] = field(default_factory=list)

    @property
    def skipped(self) -> list[Verification]:
        return [v for v in self.checked if not v.intact]

    def warnings(self) -> list[str]:
        """Readable lines for the caller to print: each skipped checkpoint, and an unverified choice."""
        target = f"falling back to {self.path}" if self.path is not None else "no intact checkpoint is left"
        lines = [f"checkpoint {v.path} is damaged ({v.summary(relative=True)}); {target}" for v in self.skipped]
        chosen = next((v for v in self.checked if v.path == self.path), None)
        if chosen is not None and chosen.level == "unverified":
            lines.append(_unverified_note(chosen.path))
        return lines


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` hands back besides the states it restores in place."""

    path: Path
    step: int
    trainer_state: dict[str, Any]
    anchor_state: dict[str, torch.Tensor] | None = field(default=None, repr=False)


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def _is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and ((path / MANIFEST).is_file() or (path / TRAINER_STATE).is_file())


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint folders of a run, oldest first (temp folders are ignored; nothing is verified)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for p in run_dir.iterdir():
        m = _STEP_RE.match(p.name)
        if m and _is_checkpoint_dir(p):
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def _candidates(run_dir: Path) -> tuple[list[Path], list[Verification]]:
    """Checkpoints in the order to try: the one ``latest`` names, then older ones newest first, then
    any newer ones (left behind by a resume from an earlier step). Also a verification for a
    ``latest`` that names something that is not a checkpoint."""
    found = list_checkpoints(run_dir)
    pointer = run_dir / LATEST
    if not pointer.is_file():
        return found[::-1], []
    name = pointer.read_text().strip()
    target = run_dir / name
    if target not in found:
        bad = Verification(target, "size", [CheckpointProblem(
            target / MANIFEST, "missing", f"`{LATEST}` names {name!r}, which is not a checkpoint (no {MANIFEST})")])
        return found[::-1], [bad]
    at = found.index(target)
    return [target, *found[:at][::-1], *found[at + 1 :][::-1]], []


def find_intact_checkpoint(run_dir: str | Path, *, verify: Verify = "size") -> CheckpointChoice:
    """The newest intact checkpoint of a run (see :func:`_candidates` for the order) and the damaged ones skipped."""
    order, checked = _candidates(Path(run_dir))
    for path in order:
        v = verify_checkpoint(path, verify=verify)
        checked.append(v)
        if v.intact:
            return CheckpointChoice(path, checked)
    return CheckpointChoice(None, checked)


def latest_checkpoint(run_dir: str | Path, *, verify: Verify = "size") -> Path | None:
    """The newest intact checkpoint of a run (by default checked by sizes only); None if there is none.

    Damaged checkpoints are skipped with a logged warning naming the file.
    """
    choice = find_intact_checkpoint(run_dir, verify=verify)
    _log_warnings(choice.warnings())
    return choice.path


def resolve_resume(path: str | Path, *, verify: Verify = "sha256") -> Path:
    """Accept a run folder (-> its newest intact checkpoint) or a ``step_N`` folder, verified by sha256.

    Raises ``FileNotFoundError`` when ``path`` holds no checkpoint at all (the trainer then starts
    fresh on ``--resume`` without a folder), and :class:`CheckpointError` when there are checkpoints
    but none is intact, or when the named ``step_N`` folder is damaged (it is not silently replaced
    by another step: the message says to resume from the run folder for that).
    """
    path = Path(path)
    if _is_checkpoint_dir(path):
        v = verify_checkpoint(path, verify=verify)
        if not v.intact:
            raise CheckpointError(
                f"cannot resume from {path}: {v.summary()}; resume from the run folder ({path.parent}) "
                "to fall back to its newest intact checkpoint"
            )
        if v.level == "unverified":
            _log_warnings([_unverified_note(path)])
        return path
    choice = find_intact_checkpoint(path, verify=verify)
    if choice.path is None:
        if not choice.checked:
            raise FileNotFoundError(f"no checkpoint found in {path}")
        shown = "; ".join(v.summary() for v in choice.checked[:3])
        more = f"; and {len(choice.checked) - 3} more" if len(choice.checked) > 3 else ""
        raise CheckpointError(f"cannot resume: no intact checkpoint in {path}: {shown}{more}")
    _log_warnings(choice.warnings())
    return choice.path


def _unverified_note(path: Path) -> str:
    return (f"checkpoint {path} was written before checkpoints carried checksums (no {MANIFEST}): "
            "only its structure was checked, not its bytes")


def _log_warnings(lines: list[str]) -> None:
    # Every rank verifies (and decides) the same way; only one of them needs to say so.
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    for line in lines:
        log.warning(line)


# --------------------------------------------------------------------------------------------- hashing


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _hash_piece(path: Path, offset: int, length: int) -> str:
    """sha256 of ``length`` bytes at ``offset``, read in blocks (hashlib releases the GIL, so threads scale)."""
    h = hashlib.sha256()
    buf = memoryview(bytearray(min(_READ_BYTES, max(length, 1))))
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = length
        while left:
            n = f.readinto(buf[: min(left, len(buf))])
            if not n:  # the file shrank under us: the digest will not match
                break
            h.update(buf[:n])
            left -= n
    return h.hexdigest()


def hash_files(paths: list[Path], *, piece_bytes: int | None = None, workers: int | None = None) -> dict[Path, list[str]]:
    """Per-piece sha256 digests of each file (``[sha256 of the whole file]`` when it fits one piece).

    All pieces of all files go to one thread pool, so a checkpoint whose bytes sit in one
    24 GB optimizer file is hashed by every core, not one.
    """
    piece_bytes = piece_bytes or PIECE_BYTES
    jobs = []
    for p in paths:
        size = p.stat().st_size
        jobs += [(p, off, min(piece_bytes, size - off)) for off in range(0, size, piece_bytes)] or [(p, 0, 0)]
    workers = max(1, min(len(jobs), workers or _cpu_count()))
    with ThreadPoolExecutor(workers) as pool:
        digests = list(pool.map(lambda job: _hash_piece(*job), jobs))
    out: dict[Path, list[str]] = {p: [] for p in paths}
    for (p, _, _), digest in zip(jobs, digests):
        out[p].append(digest)
    return out


def _write_manifest(folder: Path, step: int, world_size: int) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    piece_bytes = PIECE_BYTES
    digests = hash_files(files, piece_bytes=piece_bytes)
    manifest = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "world_size": world_size,
        "algorithm": "sha256",
        "piece_bytes": piece_bytes,
        "files": {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": digests[p]} for p in files},
    }
    write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------------- verification


def verify_checkpoint(path: str | Path, *, verify: Verify = "sha256") -> Verification:
    """Check one checkpoint folder against its manifest (or structurally, for an old one without)."""
    path = Path(path)
    state_problem = _trainer_state_problem(path)
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        return _verify_without_manifest(path, verify, state_problem)
    try:
        manifest = json.loads(manifest_file.read_text())
        files = {rel: (int(e["size"]), list(e["sha256"])) for rel, e in manifest["files"].items()}
        piece_bytes = int(manifest.get("piece_bytes", PIECE_BYTES))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        return Verification(path, verify, [CheckpointProblem(manifest_file, "unparsable", f"unparsable ({_reason(e)})")])

    problems: list[CheckpointProblem] = []
    same_size: list[Path] = []
    for rel, (size, _) in files.items():
        f = path / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            problems.append(CheckpointProblem(manifest_file, "unparsable", f"lists a path outside the checkpoint ({rel!r})"))
        elif not f.is_file():
            problems.append(CheckpointProblem(f, "missing", "missing"))
        elif (actual := f.stat().st_size) < size:
            problems.append(CheckpointProblem(f, "truncated", f"truncated ({actual} of {size} bytes)"))
        elif actual != size:
            problems.append(CheckpointProblem(f, "size", f"{actual} bytes, but the manifest says {size}"))
        else:
            same_size.append(f)
    if TRAINER_STATE not in files:
        problems.append(CheckpointProblem(path / TRAINER_STATE, "missing", f"not listed in {MANIFEST}"))
    elif state_problem is not None and path / TRAINER_STATE in same_size:
        problems.append(state_problem)
        same_size.remove(path / TRAINER_STATE)
    if verify == "sha256" and same_size:
        digests = hash_files(same_size, piece_bytes=piece_bytes)
        for f in same_size:
            expected = files[f.relative_to(path).as_posix()][1]
            if digests[f] != expected:
                bad = next((i for i, (a, b) in enumerate(zip(digests[f], expected)) if a != b), 0)
                lo = bad * piece_bytes
                hi = min(lo + piece_bytes, f.stat().st_size)
                problems.append(CheckpointProblem(f, "checksum", f"sha256 mismatch in bytes {lo}-{hi} (the file was modified or corrupted)"))
    return Verification(path, verify, problems)


def _trainer_state_problem(path: Path) -> CheckpointProblem | None:
    f = path / TRAINER_STATE
    if not f.is_file():
        return CheckpointProblem(f, "missing", "missing")
    try:
        state = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return CheckpointProblem(f, "unparsable", f"unparsable ({_reason(e)})")
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return CheckpointProblem(f, "unparsable", "unparsable (not an object with an integer 'step')")
    return None


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _verify_without_manifest(path: Path, verify: Verify, state_problem: CheckpointProblem | None) -> Verification:
    """An old (format 1) checkpoint: structural checks only. A format-2 one without its manifest is damaged."""
    if state_problem is not None:
        return Verification(path, "unverified", [state_problem])
    state = json.loads((path / TRAINER_STATE).read_text())
    if int(state.get("checkpoint_format", 1)) >= 2:
        return Verification(path, verify, [CheckpointProblem(path / MANIFEST, "missing", "missing (this checkpoint was written with one)")])
    problems = [CheckpointProblem(path / rel, "missing", "missing") for rel in ("policy/config.json", "rng_rank0.pt")
                if not (path / rel).is_file()]
    files = sorted(p for p in path.rglob("*") if p.is_file())
    if not any(p.suffix == ".safetensors" for p in files if p.parent.name == "policy"):
        problems.append(CheckpointProblem(path / "policy", "missing", "holds no .safetensors weights"))
    for f in files:
        problem = None
        if f.suffix == ".safetensors":
            problem = _safetensors_problem(f)
        elif f.suffix == ".pt":
            problem = _zip_problem(f, crc=verify == "sha256")
        elif f.suffix == ".json":
            try:
                json.loads(f.read_text())
            except (UnicodeDecodeError, ValueError) as e:
                problem = CheckpointProblem(f, "unparsable", f"unparsable ({_reason(e)})")
        if problem is not None:
            problems.append(problem)
    return Verification(path, "unverified", problems)


def _safetensors_problem(f: Path) -> CheckpointProblem | None:
    """The header (8-byte length + JSON) must parse and account for exactly the file's size."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(fh.read(n))
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
        return CheckpointProblem(f, "unparsable", f"unreadable safetensors header ({_reason(e)})")
    expected = 8 + n + end
    if size < expected:
        return CheckpointProblem(f, "truncated", f"truncated ({size} of {expected} bytes)")
    if size != expected:
        return CheckpointProblem(f, "size", f"{size} bytes, but its header describes {expected}")
    return None


def _zip_problem(f: Path, *, crc: bool) -> CheckpointProblem | None:
    """``torch.save`` writes a zip archive: its directory sits at the end (truncation) and each record has a CRC-32."""
    try:
        with zipfile.ZipFile(f) as z:
            bad = z.testzip() if crc else None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return CheckpointProblem(f, "truncated", f"not a complete torch archive ({_reason(e)})")
    if bad is not None:
        return CheckpointProblem(f, "checksum", f"CRC-32 mismatch in record {bad}")
    return None


# --------------------------------------------------------------------------------------------- RNG


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


def derived_rng_seed(seed: int, step: int, rank: int) -> int:
    """The seed of ``rank``'s RNG streams when a checkpoint is resumed at another world size than
    the one that wrote it (there is no saved stream for the new ranks): fixed by the three numbers."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint32)[0])


def seed_rng(seed: int) -> None:
    """Seed python's, numpy's and torch's (and CUDA's) global RNGs with ``seed``."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------------------------- save / load


def fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` and the folders themselves to disk (what makes a save durable)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


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
    files: Mapping[str, str] | None = None,
    write_state: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``<run_dir>/step_<step>`` atomically and point ``latest`` at it.

    ``policy_state`` is the full (unsharded) state dict, present on rank 0 only under
    FSDP; ``model`` supplies ``save_pretrained``'s config. Every rank calls this; rank 0
    writes the shared files into the temp folder, each rank writes its own RNG file,
    and after a barrier rank 0 fsyncs and hashes every file (all ranks'), writes the
    manifest last and renames the folder into place. ``files``: more text files rank 0 writes
    (path relative to the checkpoint folder -> content), covered by the manifest like the rest.
    ``write_state``: called on every rank with the ``state/`` folder to write the sharded optimizer
    and anchor into (:func:`trainer.reshard.save_training_state`); ``optimizer_state`` and
    ``anchor_state`` are then None (they write the format-2 full files).
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
    if write_state is not None:
        write_state(tmp / STATE_DIR)
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
        state = dict(trainer_state, step=step, world_size=world_size, checkpoint_format=CHECKPOINT_FORMAT)
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2, sort_keys=True))
        dump_yaml(config, tmp / "config.yaml")
        for rel, text in (files or {}).items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text, encoding="utf-8")
    sync()
    if rank == 0:
        fsync_tree(tmp)
        _write_manifest(tmp, step, world_size)  # last: a folder without it is not a checkpoint
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


def _read(f: Path, load):
    """``load(f)``, with any failure of a damaged file turned into a one-line :class:`CheckpointError`."""
    try:
        return load(f)
    except (OSError, EOFError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError, zipfile.BadZipFile,
            SafetensorError) as e:
        raise CheckpointError(f"{f}: cannot be read ({_reason(e)})") from None


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    return _read(Path(path) / TRAINER_STATE, lambda f: json.loads(f.read_text()))


def load_checkpoint(path: str | Path, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                    restore_rng: bool = True) -> Checkpoint:
    """Read a checkpoint's step, trainer state and (format 2) anchor, and restore this rank's RNG.

    At the world size that wrote it each rank gets its saved RNG streams back; at another they
    are seeded with :func:`derived_rng_seed` (``seed``, the step, ``rank``). The policy weights are
    loaded by building the model from ``<path>/policy``; the optimizer and anchor by
    :func:`trainer.reshard.load_training_state` (format 2: :func:`load_optimizer_state`) and the
    scheduler by :func:`load_scheduler_state` once those objects exist. Verification is
    :func:`resolve_resume`'s job (before any model is built); a file that still fails to
    load here raises :class:`CheckpointError` naming it.
    """
    path = Path(path)
    state = load_trainer_state(path)
    anchor = None
    if (path / "anchor.safetensors").is_file():
        from safetensors.torch import load_file

        anchor = _read(path / "anchor.safetensors", lambda f: load_file(str(f)))
    if restore_rng:
        saved_world = int(state.get("world_size", 1))
        rng_file = path / f"rng_rank{rank}.pt"
        if saved_world != world_size:
            seed_rng(derived_rng_seed(seed, int(state["step"]), rank))
        elif not rng_file.is_file():
            raise CheckpointError(f"{rng_file} is missing (the checkpoint was written by {saved_world} ranks)")
        else:
            set_rng_state(_read(rng_file, lambda f: torch.load(f, weights_only=True)))
    return Checkpoint(path=path, step=int(state["step"]), trainer_state=state, anchor_state=anchor)


def load_optimizer_state(path: str | Path) -> dict[str, Any] | None:
    f = Path(path) / "optimizer.pt"
    return _read(f, lambda f: torch.load(f, weights_only=True, map_location="cpu")) if f.is_file() else None


def load_scheduler_state(path: str | Path) -> dict[str, Any] | None:
    f = Path(path) / "scheduler.pt"
    return _read(f, lambda f: torch.load(f, weights_only=True)) if f.is_file() else None
