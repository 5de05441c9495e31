"""EMA-PG learns: mean reward rises on the toy search task through the full production path.

Real parts only: a MiniLM + FAISS index of synthetic facts served by ``emapg serve`` on a free
port, the agent's multi-turn loop over HTTP, QA exact-match rewards, EMA-PG (Top-k reverse KL
to an EMA anchor) updates and weight sync into the generation engine. tiny-qwen2 is
warm-started on the format only (see ``tests/fixtures/trainer.py`` for what it can learn).
"""

from __future__ import annotations

import statistics

import pytest

from emapg.config import load_config
from emapg.paths import CONFIG_DIR
from tests.fixtures.trainer import toy_overrides, warm_start
from trainer.config import TrainConfig
from trainer.loop import train

pytestmark = pytest.mark.slow


def test_mean_reward_rises_on_toy_search_task(tmp_path, tiny_model_dir, toy_task, toy_server):
    start = warm_start(tiny_model_dir, toy_task, toy_server.url, tmp_path / "warm_start")
    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", toy_overrides(
        toy_task, toy_server.url, tmp_path / "run",
        **{"model.policy": str(start), "run.total_steps": 12, "optim.lr": 3e-4, "run.save_every": 0,
           "logging.progress": "false", "data.prompts_per_step": 8, "algorithm.mini_batch_size": 16,
           "algorithm.micro_batch_size": 16},
    ))
    assert cfg.algorithm.kl.type == "topk_reverse" and cfg.algorithm.ema.decay < 1.0  # EMA-PG, as configured
    history = train(cfg)
    rewards = [h["reward/mean"] for h in history]
    first, last = statistics.mean(rewards[:4]), statistics.mean(rewards[-4:])
    assert last >= first + 0.3 and last >= 0.6, rewards
    # The agent kept using the real retriever, which answered every search.
    assert statistics.mean(h["search/per_traj"] for h in history[-4:]) >= 0.8
    assert sum(h["search/failures"] for h in history) == 0
    assert sum(h["ema/updated"] for h in history) == 12 // cfg.algorithm.ema.period
