"""The collapse signals in a real healthy run (toy search task, warm-started tiny-qwen2, real retriever): every step
logs them to metrics.jsonl, the probe answers its fixed questions greedily, and the guard's new detectors stay quiet."""

from __future__ import annotations

import pytest

from emapg.config import load_config
from emapg.paths import CONFIG_DIR
from tests.fixtures.trainer import toy_overrides
from trainer.config import TrainConfig
from trainer.loop import Trainer
from trainer.recovery import read_guard_events
from trainer.tracking import read_metrics

SIGNALS = ("response/repeated_ngram_share", "response/non_text_share", "response/no_answer_rate",
           "response/invalid_action_rate", "response/length_drift", "actor/entropy", "loss/clip_frac", "kl/mean", "kl/to_start")


@pytest.mark.parametrize("algorithm", [
    ["algorithm.ema.decay=0.9"],  # EMA-PG: the start is a frozen copy
    ["algorithm.name=grpo", "algorithm.kl.type=k3", "algorithm.ema.decay=1.0"],  # GRPO: the frozen reference
])
def test_a_healthy_run_logs_every_signal_and_trips_nothing_new(algorithm, tmp_path, toy_warm_policy, toy_task, toy_server):
    run = tmp_path / "run"
    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", toy_overrides(toy_task, toy_server.url, run, **{
        "model.policy": str(toy_warm_policy), "run.total_steps": 3, "optim.lr": 1e-6, "run.save_every": 0,
        "logging.progress": "false", "logging.tensorboard": "false", "data.prompts_per_step": 4, "rollout.n_samples": 4,
        "algorithm.mini_batch_size": 16, "algorithm.micro_batch_size": 16, "logging.kl_to_start": "true",
        "logging.probe_size": 4, "logging.probe_every": 2, "guard.enabled": "true",
    }) + algorithm)
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        history = trainer.train()
    finally:
        trainer.close()
    records = read_metrics(run)
    assert len(history) == len(records) == 3
    for h in records:
        for name in SIGNALS:
            assert isinstance(h[name], float), (name, h.get(name))
        assert 0 <= h["response/repeated_ngram_share"] < 0.5 and 0 <= h["response/non_text_share"] < 0.3
        assert 0 <= h["kl/to_start"] < 0.05  # lr 1e-6: the policy barely moved
    assert records[0]["response/length_drift"] == 0.0  # the start is the first step itself
    assert records[0]["kl/to_start"] < 1e-5  # the first batch is sampled by the starting weights
    # the probe: after step 1 (accuracy only), then every 2 steps (with flips); not at step 3
    assert "probe/accuracy" in records[0] and "probe/flip_rate" not in records[0]
    assert "probe/flip_rate" in records[1] and records[1]["probe/flip_rate"] <= 0.25  # greedy, weights barely moved
    assert "probe/accuracy" not in records[2]
    new = {"repetition", "gibberish", "length_drift", "kl_to_start"}
    assert not [e for e in read_guard_events(run) if e["detector"] in new]
