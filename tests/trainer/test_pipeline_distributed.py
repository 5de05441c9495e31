"""``rollout.max_staleness=1`` under two FSDP2 gloo ranks sharing one generation server: rank 0 is the only
producer and the only one pushing weights; both ranks train every step on their share of rank 0's batch."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from agent.engines.launch import EngineServer
from tests.fixtures.spawn import count_calls, free_port, rank_env

pytestmark = pytest.mark.slow
STEPS = 3


def _worker(rank: int, world: int, port: int, out: str, model_dir: str, url: str) -> None:
    rank_env(rank, world, port)
    from agent.engines.remote import RemoteEngine
    from tests.trainer.test_pipeline import _cfg
    from trainer import distributed as D
    from trainer.loop import Trainer

    calls = count_calls(RemoteEngine, ["load_weights", "stage_weights", "commit_weights", "generate", "submit"])
    trainer = Trainer(_cfg(f"{out}/run", model_dir, [url], f"run.total_steps={STEPS}", "run.save_every=0")).setup()
    try:
        history = trainer.train()
    finally:
        trainer.close()
    D.destroy()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"step": trainer.step, "calls": calls, "history": history}, f)


def test_rank0_produces_every_rank_trains(tmp_path, tiny_model_dir):
    with EngineServer(tiny_model_dir, engine="hf", max_model_len=512) as server:
        mp.spawn(_worker, args=(2, free_port(), str(tmp_path), str(tiny_model_dir), server.url), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["step"] for r in ranks] == [STEPS, STEPS]
    assert ranks[1]["calls"] == {"load_weights": 0, "stage_weights": 0, "commit_weights": 0, "generate": 0, "submit": 0}
    c = ranks[0]["calls"]
    # v0 (batches 1, 2), v1 (batch 3) loaded: every http load ends in one commit (staged by the trainer's thread and
    # committed by the producer, or uploaded and committed by the producer's load_weights)
    assert c["commit_weights"] == 2 and c["generate"] + c["submit"] > 0
    for r in ranks:
        assert [m["async/staleness"] for m in r["history"]] == [0.0, 1.0, 1.0]
        assert all(m["reward/mean"] == m["reward/mean"] for m in r["history"])
    # the metrics are reduced over ranks: both report the global batch of 2 prompts x 2 samples
    assert ranks[0]["history"][0]["response/length_mean"] == ranks[1]["history"][0]["response/length_mean"]
