"""run.time_budget_s: the loop stops at a step boundary when one more step would not fit."""

from __future__ import annotations

import pytest

from emapg.config import ConfigError, load_config
from emapg.paths import CONFIG_DIR
from trainer.checkpoint import latest_checkpoint
from trainer.config import TrainConfig
from trainer.loop import budget_spent, train

FAST = ["logging.progress=false", "data.prompts_per_step=2", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2",
        "rollout.max_tokens_per_turn=16", "rollout.max_response_tokens=16", "run.save_every=0"]


@pytest.mark.parametrize("budget,elapsed,steps,spent", [
    (0.0, 1e9, 10, False),    # no budget
    (100.0, 0.0, 0, False),   # nothing is judged before the first step
    (100.0, 40.0, 1, False),  # 40 + 40 = 80 <= 100: one more fits
    (100.0, 50.0, 1, False),  # exactly at the budget still fits
    (100.0, 60.0, 1, True),   # 60 + 60 > 100
    (100.0, 90.0, 3, True),   # mean 30: 120 > 100
    (100.0, 69.0, 3, False),  # mean 23: 92
])
def test_budget_spent(budget, elapsed, steps, spent):
    assert budget_spent(budget, elapsed, steps) is spent


def test_a_budgeted_run_stops_after_the_first_step_that_leaves_no_room(tmp_path, tiny_model_dir):
    cfg = load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml",
                      [f"run.output_dir={tmp_path}", f"model.policy={tiny_model_dir}", "run.total_steps=50",
                       "run.time_budget_s=0.001", *FAST])
    history = train(cfg)
    assert len(history) == 1  # the first step always runs; the next would end past the budget
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.name == "step_1"  # saved as on SIGINT


def test_bad_budget_is_a_config_error():
    with pytest.raises(ConfigError, match=r"run\.time_budget_s: expected a finite number >= 0, got -1"):
        load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", ["model.policy=tiny-qwen2", "run.time_budget_s=-1"])
