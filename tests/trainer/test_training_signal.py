"""What a run learns from beyond the algorithm (issue #41's levers): the shaped QA reward (F1, EM + F1, a penalty for
no answer), uniform groups dropped, the shuffled-reward control -- exact values, and a real run that records them."""

import pytest

from emapg.config import load_config
from emapg.paths import CONFIG_DIR
from tasks.task import Outcome
from tests.fixtures.trainer import toy_overrides
from trainer.config import TrainConfig
from trainer.sampled_batch import shaped_qa_outcomes


def test_shaped_qa_rewards_by_hand():
    outcomes = [Outcome(1.0, "Paris"), Outcome(0.0, "the city of Paris"), Outcome(0.0, "Lyon"), Outcome(0.0, None)]
    golds = [["Paris"]] * 4
    assert [o.reward for o in shaped_qa_outcomes(outcomes, golds, "em", 0.0)] == [1.0, 0.0, 0.0, 0.0]
    # token F1 of "city of paris" against "paris": precision 1/3, recall 1 -> 0.5
    assert [o.reward for o in shaped_qa_outcomes(outcomes, golds, "f1", 0.0)] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    assert [o.reward for o in shaped_qa_outcomes(outcomes, golds, "em_f1", 0.0)] == pytest.approx([1.0, 0.25, 0.0, 0.0])
    # the penalty hits only the trajectory with no answer: a wrong answer is never worse than none
    assert [o.reward for o in shaped_qa_outcomes(outcomes, golds, "em", 0.1)] == pytest.approx([1.0, 0.0, 0.0, -0.1])
    assert [o.answer for o in shaped_qa_outcomes(outcomes, golds, "f1", 0.1)] == [o.answer for o in outcomes]


def test_a_run_drops_uniform_groups_trains_on_shuffled_rewards_and_records_its_signal(tmp_path, toy_reading_policy, toy_task,
                                                                                       toy_server):
    """On the toy search task the warm start is right part of the time, so some groups are informative and some are
    not: with uniform_groups=drop every step trains exactly its informative groups (none topped up), and the
    provenance names the levers."""
    from trainer.loop import Trainer
    from trainer.tracking import read_metrics

    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", toy_overrides(
        toy_task, toy_server.url, tmp_path / "run",
        **{"model.policy": str(toy_reading_policy), "run.total_steps": 3, "run.save_every": 0, "logging.progress": "false",
           "data.prompts_per_step": 4, "algorithm.mini_batch_size": 16, "algorithm.micro_batch_size": 4,
           "rollout.uniform_groups": "drop", "reward.shuffle_control": "true", "reward.qa_reward": "em_f1",
           "reward.no_answer_penalty": 0.05}))
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        history = trainer.train()
        provenance = trainer.provenance
    finally:
        trainer.close()
    assert provenance["training_signal"] == {"qa_reward": "em_f1", "no_answer_penalty": 0.05, "shuffle_control": True,
                                             "uniform_groups": "drop", "filter_groups": False}
    n = cfg.rollout.n_samples
    for m in history:
        trained_groups = m["filter/informative_groups"] or 1.0  # none informative: one uniform group alone
        assert m["reward/zero_variance_groups"] == (0.0 if m["filter/informative_groups"] else 1.0)
        dropped = m["filter/dropped_uniform_groups"]
        assert m["filter/informative_groups"] + dropped + (0 if m["filter/informative_groups"] else 1) == \
            m["filter/sampled_trajectories"] / n
        assert m["actor/updates"] == 1 and trained_groups <= 4  # the rows trained fit one mini-batch of 16
    assert any(m["filter/dropped_uniform_groups"] > 0 for m in history) or all(m["filter/informative_groups"] == 4 for m in history)
    assert read_metrics(tmp_path / "run")[-1]["step"] == 3
