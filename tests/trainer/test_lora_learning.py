"""EMA-PG with LoRA learns the toy search task too: the task, warm start and learning criterion of
``test_learning.py`` (full fine-tuning; 12 steps here, not 20), with only rank-16 adapters training and the EMA anchor
the EMA of the adapters.

Real parts only: the toy index behind a live ``emapg serve``, the agent loop over HTTP, exact-match rewards, EMA-PG
(Top-k reverse KL to the adapters' EMA) and, before each rollout, the adapters (not the base) loaded into the
transformers engine. The base weights never move; the checkpoint's policy is a peft adapter folder.

Calibration (8 prompts x 4 samples per step, warm start seed 0 unless said; reward = mean over the first 3 steps ->
the last 4; probe = P(observed digit) with a contradicting observation, 0.52 after the warm start):

* rank 16, alpha 32, lr 1e-3 (this test), 12 steps, RL seed 0/1/2: 0.55 -> 0.84, 0.50 -> 0.81, 0.48 -> 0.84; probe
  0.93, 0.91, 0.93; P(the fact's own digit) <= 0.024. The same runs for 20 steps: -> 0.86, 0.84, 0.86 (probe 0.94-0.95);
  warm start seed 1 (probe 0.45), 20 steps: 0.50 -> 0.82, probe 0.93;
* 20 steps, RL seed 0: lr 5e-4: 0.55 -> 0.84; rank 8, alpha 16, lr 1e-3: 0.55 -> 0.84;
* lr 2e-3, 12 steps, seeds 0/1/2: 0.56 -> 0.70 (short of +0.15), 0.47 -> 0.83, 0.55 -> 0.81;
* lr 3e-3 (an earlier attempt), 20 steps: 0.59 over the first 3 steps, then reward 0 from step 5 on (collapsed).

Full fine-tuning learns at lr 3e-4; the adapters (a rank-16 update scaled by alpha / r = 2) want about three times that.
"""

from __future__ import annotations

import statistics

import pytest
from safetensors.torch import load_file

from emapg.config import load_config
from emapg.models import merge_adapter_folder
from emapg.paths import CONFIG_DIR
from tests.fixtures.trainer import evidence_probs, toy_overrides
from trainer import lora as L
from trainer.checkpoint import latest_checkpoint
from trainer.config import TrainConfig
from trainer.loop import train

pytestmark = pytest.mark.slow

STEPS = 12


def test_mean_reward_rises_with_lora(tmp_path, toy_reading_policy, toy_task, toy_server):
    before = evidence_probs(toy_reading_policy, toy_task)
    assert 0.35 <= before["cf_obs"] <= 0.7, f"the warm start should read the evidence only part of the time: {before}"
    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", toy_overrides(
        toy_task, toy_server.url, tmp_path / "run",
        **{"model.policy": str(toy_reading_policy), "run.total_steps": STEPS, "optim.lr": 1e-3, "run.save_every": 0,
           "logging.progress": "false", "logging.tensorboard": "false", "data.prompts_per_step": 8,
           "algorithm.mini_batch_size": 16, "algorithm.micro_batch_size": 16,
           "model.lora.enabled": "true", "model.lora.rank": 16, "model.lora.alpha": 32},
    ))
    assert cfg.algorithm.kl.type == "topk_reverse" and cfg.algorithm.ema.decay < 1.0  # EMA-PG, over the adapters
    assert cfg.model.lora.engine_weights == "adapters"
    history = train(cfg)
    rewards = [h["reward/mean"] for h in history]
    first, last = statistics.mean(rewards[:3]), statistics.mean(rewards[-4:])
    assert last >= first + 0.15 and last >= 0.7, rewards
    # What trained is the adapters: the checkpoint's policy is a peft folder of adapter tensors over the warm start.
    policy = latest_checkpoint(tmp_path / "run") / "policy"
    assert L.is_adapter_folder(policy) and L.adapter_base_model(policy) == str(toy_reading_policy)
    assert all(".lora_A." in k or ".lora_B." in k for k in load_file(str(policy / L.ADAPTER_WEIGHTS)))
    # The trained policy (base + adapters) answers what the observation says, even when it contradicts the fact.
    after = evidence_probs(merge_adapter_folder(policy, tmp_path / "merged"), toy_task)
    assert after["cf_obs"] >= 0.85 and after["cf_obs"] >= before["cf_obs"] + 0.25 and after["cf_true"] <= 0.1, (before, after)
    assert statistics.mean(h["search/per_traj"] for h in history[-4:]) >= 0.8
    assert sum(h["search/failures"] for h in history) == 0
    assert sum(h["ema/updated"] for h in history) == STEPS // cfg.algorithm.ema.period
