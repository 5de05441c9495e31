"""Checkpoint save/load of the optimizer and EMA anchor: the old full format vs the resharding DCP one.

At the SmolLM2-135M size (its config, fp32 master weights; AdamW moments after one step; a full-model
EMA anchor), in ``--world`` gloo processes (FSDP2 under 2+), both formats are written and read back by
the trainer's own code, side by side in one run, repeats interleaved, fastest kept:

* ``old`` (checkpoint format 2): the full optimizer state gathered to rank 0 (``get_optimizer_state_dict``
  with ``full_state_dict``) and ``torch.save``-d as ``optimizer.pt``, the anchor all-gathered and written
  as ``anchor.safetensors``; loading reads both files on every rank and re-shards them (the optimizer
  broadcast from rank 0, the anchor by ``distribute_tensor``).
* ``new`` (format 3, :mod:`trainer.reshard`): every rank writes its own shards into ``state/`` with
  ``torch.distributed.checkpoint`` and reads back what its sharding needs.

A save is timed until it is durable, as the trainer's ``save_checkpoint`` makes it: the write, a
barrier, then rank 0 fsyncs every file of the folder (``trainer.checkpoint.fsync_tree``; DCP also
fsyncs its own files as it writes them). Loads read files just written (the page cache holds them:
this compares the formats' work, not the disk's read speed). The policy folder (the same in both
formats) is not part of the comparison. Prints the time ratios
``old_over_new_save_time`` / ``old_over_new_load_time`` and the sizes, and writes
``benchmarks/results/checkpoint_reshard.json``. Run it under ``flock /tmp/emapg-heavy.lock``
(normal priority: the lock keeps the machine to itself); numbers depend on the cores and the disk.

    python benchmarks/checkpoint_reshard.py --world 1 2 --repeat 2
"""

from __future__ import annotations

import argparse
import datetime
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
RESULTS = ROOT / "benchmarks" / "results" / "checkpoint_reshard.json"


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _build(model_dir: str, world: int):
    """SmolLM2-135M from its config (random fp32 weights), sharded under 2+ ranks, AdamW after one step, EMA anchor."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer import distributed as D
    from trainer.ema import EMAAnchor
    from trainer.policy import PolicyForward

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    forward = PolicyForward(model)
    if world > 1:
        D.apply_fsdp2(forward, bf16=False)
    optimizer = torch.optim.AdamW([p for p in forward.parameters() if p.requires_grad], lr=1e-5)
    for p in forward.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    anchor = EMAAnchor(model, anchor_decay=0.9, update_period=1, fsdp_root=forward if world > 1 else None)
    return model, forward, optimizer, anchor


def _old_save(folder: Path, forward, optimizer, anchor, rank: int) -> None:
    import torch
    from safetensors.torch import save_file

    from trainer import distributed as D

    full_anchor = anchor.full_state_dict()
    optim = D.optimizer_state(forward, optimizer)
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in full_anchor.items()}, str(folder / "anchor.safetensors"))
        torch.save(optim, folder / "optimizer.pt")


def _old_load(folder: Path, forward, optimizer, anchor, world: int) -> None:
    from safetensors.torch import load_file

    from trainer.checkpoint import load_optimizer_state
    from trainer.reshard import load_full_optimizer_state

    load_full_optimizer_state(forward, optimizer, load_optimizer_state(folder), sharded=world > 1)
    anchor.load_full_state_dict(load_file(str(folder / "anchor.safetensors")))


def _worker(rank: int, world: int, port: int, model_dir: str, work: str, repeat: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch

    from trainer import distributed as D
    from trainer.checkpoint import fsync_tree
    from trainer.reshard import load_training_state, save_training_state

    torch.set_num_threads(1)
    D.init_distributed(device="cpu")
    _, forward, optimizer, anchor = _build(model_dir, world)
    times: dict[str, list[float]] = {k: [] for k in ("old_save", "new_save", "old_load", "new_load")}
    sizes: dict[str, int] = {}
    work_dir = Path(work)

    def timed(key: str, fn, durable: Path | None = None) -> None:
        D.barrier()
        t = time.perf_counter()
        fn()
        D.barrier()
        if durable is not None and rank == 0:  # what save_checkpoint does once every rank has written
            fsync_tree(durable)
        D.barrier()
        times[key].append(time.perf_counter() - t)

    for i in range(repeat):
        old, new = work_dir / f"old{i}", work_dir / f"new{i}" / "state"
        timed("old_save", lambda: _old_save(old, forward, optimizer, anchor, rank), durable=old)
        timed("new_save", lambda: save_training_state(new, forward, optimizer, anchor), durable=new)
        if rank == 0:
            sizes = {"old": _size(old), "new": _size(new)}
        timed("old_load", lambda: _old_load(old, forward, optimizer, anchor, world))
        timed("new_load", lambda: load_training_state(new, forward, optimizer, anchor))
        D.barrier()
        if rank == 0:
            shutil.rmtree(old), shutil.rmtree(new.parent)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "sizes": sizes}))
    D.destroy()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2], help="world sizes to measure (gloo processes)")
    ap.add_argument("--repeat", type=int, default=2, help="timed repeats per format (interleaved; the fastest is kept)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model whose config sets the size")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    import torch.multiprocessing as mp

    from emapg.models import resolve_model
    from tests.fixtures.spawn import free_port

    model_dir = resolve_model(args.model)
    rows = []
    for world in args.world:
        with tempfile.TemporaryDirectory(prefix="ckpt-reshard-") as work:
            result = Path(work) / "result.json"
            mp.spawn(_worker, args=(world, free_port(), model_dir, work, args.repeat, str(result)), nprocs=world, join=True)
            r = json.loads(result.read_text())
        best = {k: min(v) for k, v in r["times"].items()}
        row = {"world_size": world, **{f"{k}_s": round(v, 3) for k, v in best.items()},
               "old_bytes": r["sizes"]["old"], "new_bytes": r["sizes"]["new"],
               "old_over_new_save_time": round(best["old_save"] / best["new_save"], 2),
               "old_over_new_load_time": round(best["old_load"] / best["new_load"], 2),
               "new_over_old_bytes": round(r["sizes"]["new"] / r["sizes"]["old"], 3), "all_times_s": r["times"]}
        rows.append(row)
        print(f"world {world}: save old {best['old_save']:.2f}s new {best['new_save']:.2f}s "
              f"(old/new {row['old_over_new_save_time']}x); load old {best['old_load']:.2f}s new {best['new_load']:.2f}s "
              f"(old/new {row['old_over_new_load_time']}x); size old {row['old_bytes'] / 2**20:.0f} MiB "
              f"new {row['new_bytes'] / 2**20:.0f} MiB", flush=True)
    out = {"benchmark": "checkpoint_reshard", "date": datetime.date.today().isoformat(), "model": args.model,
           "what": "optimizer (AdamW) + full EMA anchor state; save = write + fsync (durable), load from the page cache",
           "repeat": args.repeat, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
