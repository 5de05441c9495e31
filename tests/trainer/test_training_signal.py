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
    assert provenance["training_signal"] == {"qa_reward": "em_f1", "qa_answer": "search_r1", "no_answer_penalty": 0.05, "shuffle_control": True,
                                             "uniform_groups": "drop", "filter_groups": False, "guidance": "none",
                                             "entropy_coef": 0.0, "entropy_control": None}
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


def test_guidance_writes_the_gold_answer_into_the_models_own_search_for_all_wrong_groups(tmp_path, toy_warm_policy, toy_task,
                                                                                          toy_server):
    """algorithm.guidance=gold_answer on the toy search task: every all-wrong group whose trajectories searched gets
    its last trajectory replaced by the same search (replayed through the rollout loop against the real retriever)
    with the gold answer as the last turn; it scores 1, keeps the group's prompt ids, and its observation is exactly
    the one the policy's own search returned."""
    from trainer.guidance import Guidance
    from trainer.loop import Trainer

    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", toy_overrides(
        toy_task, toy_server.url, tmp_path / "run",
        **{"model.policy": str(toy_warm_policy), "run.total_steps": 1, "run.save_every": 0, "logging.progress": "false",
           "data.prompts_per_step": 8, "algorithm.mini_batch_size": 32, "algorithm.micro_batch_size": 8,
           "rollout.max_turns": 2, "algorithm.guidance": "gold_answer", "rollout.temperature": 1.5}))
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        sampled = trainer.sample_batch(trainer.sample_prompts())
        guided = Guidance()(trainer, sampled)
    finally:
        trainer.close()
    n = cfg.rollout.n_samples
    counts = guided.sampling
    assert counts["guidance/guided_groups"] >= 1, counts  # the seeded batch at T = 1.5 has all-wrong groups
    assert counts["guidance/guided_groups"] + counts["guidance/unguidable_groups"] == counts["guidance/all_wrong_groups"]
    before, after = sampled.rewards.view(-1, n), guided.rewards.view(-1, n)
    changed = 0
    for g, prompt in enumerate(sampled.prompts):
        if float(before[g].max()) > 0:  # not all wrong: untouched
            assert guided.trajectories[g * n:(g + 1) * n] == sampled.trajectories[g * n:(g + 1) * n]
            continue
        last_before, last_after = sampled.trajectories[(g + 1) * n - 1], guided.trajectories[(g + 1) * n - 1]
        if last_after is last_before:
            continue
        changed += 1
        assert after[g].tolist() == [0.0] * (n - 1) + [1.0]
        assert last_after.prompt_ids == last_before.prompt_ids and last_after.group_id == last_before.group_id
        assert last_after.model_text.rstrip().endswith(f"<answer>{prompt.example.answers[0]}</answer>")
        source = next(t for t in sampled.trajectories[g * n:(g + 1) * n] if t.num_searches > 0)
        assert last_after.queries[0] == source.queries[0] and last_after.retrieved_ids[0] == source.retrieved_ids[0]
        assert last_after.span_ids("observation")[0] == source.span_ids("observation")[0]  # token-exact evidence
        assert sum(last_after.loss_mask) == sum(len(ids) for ids in last_after.span_ids("model"))
    assert changed == counts["guidance/guided_groups"]


def test_guidance_config_rules():
    from emapg.config import ConfigError

    base = ["retriever.urls=[http://127.0.0.1:9]", "algorithm.guidance=gold_answer"]
    with pytest.raises(ConfigError, match="behavior_correction=none"):
        load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", [*base, "algorithm.behavior_correction=tis"])
    with pytest.raises(ConfigError, match="tags format"):
        load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", ["algorithm.guidance=gold_answer"])
