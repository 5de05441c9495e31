"""Cost of checkpoint verification: the manifest's piece-parallel sha256 vs one serial sha256 per file.

A synthetic checkpoint with a 3B-parameter run's proportions (policy fp32 : anchor fp32 : AdamW
state = 1 : 1 : 2; at 3B that is 12 + 12 + 24 GB) is written at ``--gb`` GB in total, then:

* ``seal``      -- what ``save_checkpoint`` adds: hash every file and write ``manifest.json``
  (:func:`trainer.checkpoint._write_manifest`, the real code), right after writing, pages cached;
* ``verify``    -- what ``--resume`` does: :func:`trainer.checkpoint.verify_checkpoint` with
  ``verify="sha256"``, once with the files in the page cache (``warm``) and once after evicting them
  with ``posix_fadvise(DONTNEED)`` (``cold``: read from the disk, as after a reboot);
* ``serial``    -- the baseline: one ``hashlib.sha256`` stream per file, files one after another
  (what ``sha256sum`` of each file costs), warm and cold;
* ``size``      -- ``verify="size"`` (what ``latest_checkpoint`` does): metadata only.

Read measurements are repeated (``--repeat``, interleaved) and the fastest is kept. Prints
``serial_over_verify_time_ratio`` (warm and cold) and the throughputs, and writes
``benchmarks/results/checkpoint_hash.json``. Run it under ``flock /tmp/emapg-heavy.lock`` on a
shared machine. Numbers depend on the cores (``--workers``, default: all) and the disk.

    python benchmarks/checkpoint_hash.py --gb 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "checkpoint_hash.json"
LAYOUT = {"policy/model.safetensors": 0.25, "anchor.safetensors": 0.25, "optimizer.pt": 0.5}
PARAMS_3B_BYTES = 3.09e9 * 4 * 4  # Qwen2.5-3B: fp32 policy + fp32 anchor + two fp32 Adam moments


def _write(folder: Path, total_bytes: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    for rel, share in LAYOUT.items():
        f = folder / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        block = rng.bytes(64 << 20)  # generated once per file, so the timing is the disk's, not the generator's
        left = int(total_bytes * share)
        with open(f, "wb") as fh:
            while left:
                n = min(len(block), left)
                fh.write(block[:n])
                left -= n
            fh.flush()
            os.fsync(fh.fileno())
    (folder / "trainer_state.json").write_text(json.dumps({"step": 1, "checkpoint_format": 2}))


def _evict(folder: Path) -> None:
    """Drop this folder's pages from the page cache (only ours: no global drop_caches)."""
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _serial(folder: Path) -> float:
    t = time.perf_counter()
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json"):
        with open(f, "rb") as fh:
            hashlib.file_digest(fh, "sha256")
    return time.perf_counter() - t


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=4.0, help="total size of the synthetic checkpoint (GB, 1e9 bytes)")
    ap.add_argument("--workers", type=int, default=None, help="cores to use (sets the affinity mask the hashing pool sizes itself by; default: all)")
    ap.add_argument("--dir", default=None, help="where to write it (default: a temp folder; the disk is part of the measurement)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each read measurement; the fastest is reported (default 3)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    import trainer.checkpoint as C

    if args.workers:  # the hashing pool sizes itself from the affinity mask, as it would under taskset/torchrun
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.workers])
    workers = C._cpu_count()
    total = int(args.gb * 1e9)
    root = Path(tempfile.mkdtemp(prefix="ckpt-hash-", dir=args.dir))
    folder = root / "step_1"

    def verify(level: str) -> None:
        v = C.verify_checkpoint(folder, verify=level)
        assert v.intact, v.problems

    try:
        t_write = _timed(lambda: _write(folder, total))
        t_seal = _timed(lambda: C._write_manifest(folder, 1, 1))  # the save path: pages still cached
        t_size = min(_timed(lambda: verify("size")) for _ in range(args.repeat))
        t_serial_warm = t_verify_warm = t_serial_cold = t_verify_cold = float("inf")
        for _ in range(args.repeat):  # interleaved, so background load hits both sides alike
            t_serial_warm = min(t_serial_warm, _serial(folder))
            t_verify_warm = min(t_verify_warm, _timed(lambda: verify("sha256")))
        for _ in range(args.repeat):
            _evict(folder)
            t_serial_cold = min(t_serial_cold, _serial(folder))
            _evict(folder)
            t_verify_cold = min(t_verify_cold, _timed(lambda: verify("sha256")))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    gb = total / 1e9
    out = {
        "benchmark": "checkpoint_hash",
        "setting": {"gb": gb, "layout": LAYOUT, "workers": workers, "piece_bytes": C.PIECE_BYTES, "repeat": args.repeat,
                    "cpu": platform.processor() or platform.machine(), "cores_visible": os.cpu_count(), "dir": str(root.parent)},
        "seconds": {"write_and_fsync": t_write, "seal_hash_and_manifest": t_seal, "verify_size": t_size,
                    "verify_sha256_warm": t_verify_warm, "verify_sha256_cold": t_verify_cold,
                    "serial_sha256_warm": t_serial_warm, "serial_sha256_cold": t_serial_cold},
        "gb_per_s": {"seal": gb / t_seal, "verify_warm": gb / t_verify_warm, "verify_cold": gb / t_verify_cold,
                     "serial_warm": gb / t_serial_warm, "serial_cold": gb / t_serial_cold, "write": gb / t_write},
        "serial_over_verify_time_ratio": {"warm": t_serial_warm / t_verify_warm, "cold": t_serial_cold / t_verify_cold},
        "seal_over_write_time_ratio": t_seal / t_write,
        "extrapolated_3b_seconds": {"verify_warm": PARAMS_3B_BYTES / 1e9 / (gb / t_verify_warm),
                                    "verify_cold": PARAMS_3B_BYTES / 1e9 / (gb / t_verify_cold),
                                    "seal": PARAMS_3B_BYTES / 1e9 / (gb / t_seal)},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
