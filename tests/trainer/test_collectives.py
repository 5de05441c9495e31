"""trainer.distributed's reductions: CPU flags and counts reduce on the backend's device and come back."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.fixtures.spawn import free_port
from trainer import distributed as D


def test_nccl_reduces_on_this_ranks_cuda_device(monkeypatch):
    # NCCL only reduces CUDA tensors: a CPU flag must be moved to this rank's device first.
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert D.collective_device(torch.zeros(1)) == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "gloo")
    assert D.collective_device(torch.zeros(1)) == torch.device("cpu")


def test_alone_the_input_comes_back_unchanged():
    x = torch.tensor([1.0, 2.0])
    assert D.all_reduce_sum(x) is x and D.all_reduce_max(x) is x


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        x = torch.tensor([float(rank + 1), 10.0 * rank], dtype=torch.float64)
        s, m = D.all_reduce_sum(x), D.all_reduce_max(x)
        assert x.tolist() == [float(rank + 1), 10.0 * rank]  # the input is not reduced in place
        torch.save({"sum": s, "max": m}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_sum_and_max(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["sum"].tolist() == [3.0, 10.0] and got["max"].tolist() == [2.0, 10.0]
        assert got["sum"].dtype == torch.float64 and got["sum"].device.type == "cpu"
