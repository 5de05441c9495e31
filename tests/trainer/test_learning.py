"""EMA-PG learns to use the evidence: mean reward rises on the toy search task through the full production path.

Real parts only: a MiniLM + FAISS index of synthetic facts served by ``emapg serve`` on a free
port, the agent's multi-turn loop over HTTP, QA exact-match rewards, EMA-PG (Top-k reverse KL
to an EMA anchor) updates and weight sync into the generation engine.

The 8 facts state 4 different digits (each twice), so a constant answer scores 0.25. tiny-qwen2
is warm-started on *held-out* entities to search and copy the observed digit, but only part of
the time (``tests/fixtures/trainer.py``); it never sees the RL facts' answers. RL must raise how
often the policy answers from the observation; a counterfactual probe (an observation stating
another digit) checks that the final policy follows the evidence rather than a memorised answer.
Calibration (ws seed/RL seed, 0/0 1/1 1/0 3/3 0/1 2/2): reward over the first 3 steps
0.56 0.43 0.55 0.61 0.42 0.63 -> last 4 steps 0.88 0.79 0.88 0.85 0.87 0.87; probe
P(observed digit) 0.45-0.59 after the warm start -> 0.95-0.98 after 20 RL steps.
"""

from __future__ import annotations

import statistics
from collections import Counter

import pytest

from emapg.config import load_config
from emapg.paths import CONFIG_DIR
from tests.fixtures.trainer import evidence_probs, toy_overrides
from trainer.checkpoint import latest_checkpoint
from trainer.config import TrainConfig
from trainer.loop import train

pytestmark = pytest.mark.slow

STEPS = 20


def test_mean_reward_rises_on_toy_search_task(tmp_path, toy_reading_policy, toy_task, toy_server):
    # A constant answer (or ignoring the question) scores at most 0.25 on this task.
    assert max(Counter(answer for _, answer in toy_task.facts).values()) / len(toy_task.facts) <= 0.25
    start = toy_reading_policy  # warm_start() with its defaults, cached by content
    before = evidence_probs(start, toy_task)
    assert 0.35 <= before["cf_obs"] <= 0.7, f"the warm start should read the evidence only part of the time: {before}"
    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", toy_overrides(
        toy_task, toy_server.url, tmp_path / "run",
        **{"model.policy": str(start), "run.total_steps": STEPS, "optim.lr": 3e-4, "run.save_every": 0,
           "logging.progress": "false", "data.prompts_per_step": 8, "algorithm.mini_batch_size": 16,
           "algorithm.micro_batch_size": 16},
    ))
    assert cfg.algorithm.kl.type == "topk_reverse" and cfg.algorithm.ema.decay < 1.0  # EMA-PG, as configured
    history = train(cfg)
    rewards = [h["reward/mean"] for h in history]
    first, last = statistics.mean(rewards[:3]), statistics.mean(rewards[-4:])
    assert last >= first + 0.15 and last >= 0.7, rewards
    # The trained policy answers what the observation says, even when it contradicts the fact.
    after = evidence_probs(latest_checkpoint(tmp_path / "run") / "policy", toy_task)
    assert after["cf_obs"] >= 0.85 and after["cf_obs"] >= before["cf_obs"] + 0.25 and after["cf_true"] <= 0.1, (before, after)
    # The agent kept using the real retriever, which answered every search.
    assert statistics.mean(h["search/per_traj"] for h in history[-4:]) >= 0.8
    assert sum(h["search/failures"] for h in history) == 0
    assert sum(h["ema/updated"] for h in history) == STEPS // cfg.algorithm.ema.period
