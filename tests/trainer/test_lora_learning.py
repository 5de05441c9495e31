"""EMA-PG with LoRA learns the toy search task too (the same task, warm start and checks as ``test_learning.py``).

Only rank-16 adapters on every linear layer train (lr 3e-3, ten times full fine-tuning's: the usual LoRA
ratio); the EMA anchor is the EMA of the adapters; each rollout runs the transformers engine with the
adapters of the step before. Calibration: see the numbers in the assertion messages of a failing run.
"""

from __future__ import annotations

import statistics

import pytest

from emapg.config import load_config
from emapg.paths import CONFIG_DIR
from tests.fixtures.trainer import evidence_probs, toy_overrides, warm_start
from trainer.checkpoint import latest_checkpoint
from trainer.config import TrainConfig
from trainer.lora import merge_adapter_folder
from trainer.loop import train

pytestmark = pytest.mark.slow

STEPS = 16


def test_mean_reward_rises_with_lora(tmp_path, tiny_model_dir, toy_task, toy_server):
    start = warm_start(tiny_model_dir, toy_task, tmp_path / "warm_start")
    before = evidence_probs(start, toy_task)
    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", toy_overrides(
        toy_task, toy_server.url, tmp_path / "run",
        **{"model.policy": str(start), "run.total_steps": STEPS, "optim.lr": 3e-3, "run.save_every": 0,
           "logging.progress": "false", "data.prompts_per_step": 8, "algorithm.mini_batch_size": 16,
           "algorithm.micro_batch_size": 16, "model.lora.enabled": "true", "model.lora.rank": 16},
    ))
    assert cfg.algorithm.kl.type == "topk_reverse" and cfg.algorithm.ema.decay < 1.0  # EMA-PG over the adapters
    history = train(cfg)
    rewards = [h["reward/mean"] for h in history]
    first, last = statistics.mean(rewards[:3]), statistics.mean(rewards[-4:])
    assert last >= first + 0.15 and last >= 0.7, rewards
    merged = merge_adapter_folder(latest_checkpoint(tmp_path / "run") / "policy", tmp_path / "merged")
    after = evidence_probs(merged, toy_task)
    assert after["cf_obs"] >= before["cf_obs"] + 0.2, (before, after)
    assert sum(h["ema/updated"] for h in history) == STEPS // cfg.algorithm.ema.period
