"""Fault injection on the toy search task: one update at a learning rate that wrecks the policy is
detected by the stability guard within two steps, and ``rollback`` / ``reset_to_anchor`` bring the
reward back within noise of its level before the collapse.

Real parts (tests/fixtures/trainer.py): the warm-started tiny-qwen2 that answers right about half
the time, the synthetic-facts index behind a real ``emapg serve``, the production training loop.
The normal learning rate is tiny (1e-6), so without the fault the reward stays at its starting level;
:class:`FaultyTrainer` sets 0.05 for the one update of step ``INJECT + 1``, whose weights are first
used by the rollout of step ``INJECT + 2``.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest

from emapg.config import load_config
from emapg.paths import CONFIG_DIR
from tests.fixtures.trainer import toy_overrides
from trainer.checkpoint import load_trainer_state, step_dir_name
from trainer.config import TrainConfig
from trainer.guard import DETECTORS
from trainer.loop import Trainer
from trainer.plot import guard_marks
from trainer.recovery import read_guard_events

INJECT = 3  # after step 3's hooks: the update of step 4 runs at the wrecking learning rate
STEPS = 7
PROMPTS, SAMPLES = 4, 4


class FaultyTrainer(Trainer):
    """The update after step ``INJECT`` runs at a learning rate that wrecks the policy (set just before it,
    so no checkpoint holds it; the LR schedule restores the normal rate right after the update)."""

    def _update(self, batch, plan):
        if self.step == INJECT:
            for group in self.policy.optimizer.param_groups:
                group["lr"] = 0.05
        return super()._update(batch, plan)


def run_with_fault(run_dir, policy, task, url, action: str):
    every = {f"guard.{name}.action": action for name in DETECTORS}
    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", toy_overrides(task, url, run_dir, **{
        "model.policy": str(policy), "run.total_steps": STEPS, "optim.lr": 1e-6, "run.save_every": 1, "run.keep_last": 0,
        "logging.progress": "false", "data.prompts_per_step": PROMPTS, "rollout.n_samples": SAMPLES,
        "algorithm.mini_batch_size": PROMPTS * SAMPLES, "algorithm.micro_batch_size": 16,
        "algorithm.ema.period": 100,  # the anchor stays the warm start: the smoothed past policy of this short run
        "guard.enabled": "true", "guard.nonfinite.action": action, **every,
    }))
    trainer = FaultyTrainer(cfg)
    try:
        trainer.setup()
        history = trainer.train()
        report = trainer.guard.report()
    finally:
        trainer.close()
    return history, report


def within_noise(before: list[float], after: list[float]) -> bool:
    """``after``'s mean reward is no more than 3 binomial standard errors of the difference below ``before``'s."""
    p, n = statistics.mean(before), PROMPTS * SAMPLES
    se_diff = math.sqrt(max(p * (1 - p), 0.05) / n * (1 / len(before) + 1 / len(after)))
    return statistics.mean(after) >= p - 3 * se_diff


@pytest.mark.parametrize("action", ["rollback", "reset_to_anchor"])
def test_collapse_is_detected_and_recovered(action, tmp_path, toy_warm_policy, toy_task, toy_server):
    run = tmp_path / action
    history, report = run_with_fault(run, toy_warm_policy, toy_task, toy_server.url, action)
    rewards = [h["reward/mean"] for h in history]
    assert len(rewards) == STEPS
    before = rewards[:INJECT + 1]  # steps 1-4 roll out with healthy weights
    events = read_guard_events(run)
    assert events, f"the collapse was not detected: rewards {rewards}"
    first = events[0]["step"]
    assert first == INJECT + 2, (events, rewards)  # the first rollout of the wrecked weights
    assert rewards[first - 1] < statistics.mean(before) - 0.3, rewards  # a real collapse
    assert {e["step"] for e in events} == {first}, events  # recovered: no trip afterwards
    assert all(e["action"] == action for e in events)
    detail = events[0]["detail"]
    assert detail.startswith(action) and (f"restored {step_dir_name(INJECT)}" in detail if action == "rollback" else "anchor" in detail)
    assert within_noise(before, rewards[first:]), rewards
    # checkpoints record the verdict; the report summarises the trips
    # the checkpoint of the tripped step holds, after a rollback, the restored weights (they passed: the next
    # rollback may return to them); after a reset, the anchor's (not a step that passed)
    assert load_trainer_state(run / step_dir_name(first))["guard"]["passed"] is (action == "rollback")
    assert load_trainer_state(run / step_dir_name(INJECT))["guard"]["passed"] is True
    assert f"step {first}" in report and action in report
    assert guard_marks(run) == [(first, True)]
    # provenance and recorded retrievals of a search run
    provenance = load_trainer_state(run / step_dir_name(STEPS))["provenance"]
    assert provenance["retriever_fingerprints"][toy_server.url]["rows"] == len(toy_task.facts)
    assert provenance["protocol_card"]["settings"]["topk"] == 1
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    assert len(sample["queries"]) == len(sample["retrieved_ids"]) == sample["searches"]
