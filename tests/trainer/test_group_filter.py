"""Dynamic sampling (trainer.group_filter): the exact selection rule, and a training run that uses it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from agent.rollout import RolloutStats
from emapg.config import ConfigError, load_config
from emapg.paths import CONFIG_DIR
from trainer.config import TrainConfig
from trainer.data import SampledPrompt
from trainer.group_filter import fill_informative, informative_groups
from trainer.loop import Trainer
from tasks.task import Outcome
from trainer.sampled_batch import SampledBatch as Rollouts

N = 3  # group size


def batch(tag: str, group_rewards: list[list[float]]) -> Rollouts:
    """A rollout batch whose trajectories are labelled '<tag><group>.<j>' (rewards group-major)."""
    prompts = [SampledPrompt(SimpleNamespace(answers=[]), f"{tag}{g}") for g in range(len(group_rewards))]
    trajs = [SimpleNamespace(label=f"{tag}{g}.{j}") for g, rs in enumerate(group_rewards) for j in range(len(rs))]
    return Rollouts(prompts, trajs, [Outcome(float(r)) for rs in group_rewards for r in rs], {"x": 1.0},
                    RolloutStats(wall_s=1.0, engine_calls=1))


def labels(ro: Rollouts) -> list[str]:
    return [t.label for t in ro.trajectories]


def test_informative_groups_are_those_whose_rewards_differ():
    r = torch.tensor([0, 0, 0, 0, 1, 0, 1, 1, 1, 0.5, 0.5, 0.25])
    assert informative_groups(r, 3).tolist() == [False, True, False, True]


def test_fill_keeps_informative_groups_in_sampling_order_and_stops_when_full():
    first = batch("a", [[0, 0, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])  # 1 informative of 4
    extra = {1: batch("b", [[0, 1, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0]]),  # 2 more
             2: batch("c", [[0, 0, 1], [1, 0, 1], [0, 0, 0], [0, 0, 0]]),  # full after its first two
             3: batch("d", [[0, 1, 1]] * 4)}
    calls = []

    def more(r):
        calls.append(r)
        return extra[r]

    out, sums = fill_informative(first, more, want=4, group_size=N, max_rounds=3)
    assert calls == [1, 2]  # stops as soon as 4 informative groups are kept
    assert [p.group_id for p in out.prompts] == ["a1", "b0", "b2", "c0"]
    assert labels(out) == [f"{g}.{j}" for g in ["a1", "b0", "b2", "c0"] for j in range(N)]
    assert out.group_ids == [g for g in ["a1", "b0", "b2", "c0"] for _ in range(N)]
    assert out.rewards.tolist() == [1, 0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 1]
    assert informative_groups(out.rewards, N).all()
    assert out.stats.wall_s == 3.0 and out.stats.engine_calls == 3  # the generation work of all 3 batches
    assert out.reward_counts == {}  # recounted by the caller for the rows kept
    assert sums == {"filter/sampled_groups": 12.0, "filter/sampled_trajectories": 36.0,
                    "filter/sampled_reward_sum": float(first.rewards.sum() + extra[1].rewards.sum() + extra[2].rewards.sum()),
                    "filter/informative_groups": 4.0, "filter/rounds": 2.0,
                    "filter/sampled_informative_groups": 5.0,  # a1, b0, b2, c0, c1 (c1 generated, not needed)
                    "filter/first_round_informative_groups": 1.0, "filter/first_round_groups": 4.0,
                    "filter/dropped_uniform_groups": 0.0}


def test_fill_tops_up_with_the_earliest_uninformative_groups_when_rounds_run_out():
    first = batch("a", [[0, 0, 0], [1, 0, 0], [0, 0, 0]])
    out, sums = fill_informative(first, lambda r: batch("b", [[0, 0, 0], [1, 1, 1], [0, 1, 0]]), want=3, group_size=N, max_rounds=1)
    assert [p.group_id for p in out.prompts] == ["a1", "b2", "a0"]  # informative first, then the first spare
    assert sums["filter/informative_groups"] == 2.0 and sums["filter/rounds"] == 1.0
    out0, sums0 = fill_informative(first, lambda r: pytest.fail("no extra round allowed"), want=3, group_size=N, max_rounds=0)
    assert [p.group_id for p in out0.prompts] == ["a1", "a0", "a2"] and sums0["filter/rounds"] == 0.0
    # an already informative batch is returned as it is, nothing more generated
    full = batch("z", [[0, 1, 0], [1, 0, 0]])
    out1, sums1 = fill_informative(full, lambda r: pytest.fail("not needed"), want=2, group_size=N, max_rounds=3)
    assert labels(out1) == labels(full) and torch.equal(out1.rewards, full.rewards) and sums1["filter/rounds"] == 0.0


def test_drop_keeps_exactly_the_informative_groups_and_no_uniform_one():
    """rollout.uniform_groups=drop: the groups whose rewards are all equal are left out (with their KL term); without
    filter_groups (enough=1) no extra round runs while the first batch has an informative group."""
    first = batch("a", [[0, 0, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]])
    out, sums = fill_informative(first, lambda r: pytest.fail("no extra round: a group is informative"), want=4,
                                 group_size=N, max_rounds=3, enough=1, topup=False)
    assert [p.group_id for p in out.prompts] == ["a1", "a3"]
    assert labels(out) == [f"a{g}.{j}" for g in (1, 3) for j in range(N)]
    assert informative_groups(out.rewards, N).all()
    assert sums["filter/informative_groups"] == 2.0 and sums["filter/dropped_uniform_groups"] == 2.0
    assert sums["filter/rounds"] == 0.0 and sums["filter/first_round_groups"] == 4.0


def test_drop_samples_more_only_while_nothing_is_informative():
    first = batch("a", [[0, 0, 0], [1, 1, 1]])
    rounds = {1: batch("b", [[0, 0, 0], [0, 0, 0]]), 2: batch("c", [[0, 0, 0], [0, 1, 0]]), 3: batch("d", [[0, 1, 0]] * 2)}
    out, sums = fill_informative(first, rounds.__getitem__, want=2, group_size=N, max_rounds=3, enough=1, topup=False)
    assert [p.group_id for p in out.prompts] == ["c1"] and sums["filter/rounds"] == 2.0
    assert sums["filter/dropped_uniform_groups"] == 5.0  # a0, a1, b0, b1, c0
    # nothing informative after every round: the earliest uniform group alone, so the step has rows
    out0, sums0 = fill_informative(first, lambda r: batch("b", [[0, 0, 0], [1, 1, 1]]), want=2, group_size=N, max_rounds=1,
                                   enough=1, topup=False)
    assert [p.group_id for p in out0.prompts] == ["a0"] and sums0["filter/dropped_uniform_groups"] == 3.0
    # with filter_groups (enough = want): rounds continue until want informative groups, and no top-up
    out2, sums2 = fill_informative(first, rounds.__getitem__, want=2, group_size=N, max_rounds=3, topup=False)
    assert [p.group_id for p in out2.prompts] == ["c1", "d0"] and sums2["filter/rounds"] == 3.0


def test_shuffled_control_permutes_each_batch_rewards():
    from trainer.sampled_batch import shuffled_outcomes

    outcomes = [Outcome(float(i), answer=f"ans{i}") for i in range(16)]
    a, b = shuffled_outcomes(outcomes, 7), shuffled_outcomes(outcomes, 8)
    assert sorted(o.reward for o in a) == [o.reward for o in outcomes]  # a permutation: same rewards, same rate
    assert [o.reward for o in a] != [o.reward for o in outcomes]  # really moved
    assert [o.reward for o in a] != [o.reward for o in b]  # seeded per step
    assert [o.reward for o in a] == [o.reward for o in shuffled_outcomes(outcomes, 7)]  # reproducible
    assert [o.answer for o in a] == [o.answer for o in outcomes]  # answers stay with their trajectories


def test_ranks_agree_on_the_rounds():
    """A rank that is full keeps generating while another rank is not (agree says 'not all full'); its extra
    groups are dropped, so every rank trains `want` groups and draws as many prompt batches."""
    first = batch("a", [[0, 1, 0], [1, 0, 0]])  # already full here
    answers = iter([False, True])  # the other rank: full only after one more round
    out, sums = fill_informative(first, lambda r: batch("b", [[0, 0, 1], [0, 0, 0]]), want=2, group_size=N, max_rounds=3,
                                 agree=lambda full: full and next(answers))
    assert sums["filter/rounds"] == 1.0 and sums["filter/sampled_groups"] == 4.0
    assert [p.group_id for p in out.prompts] == ["a0", "a1"]


FAST = ["logging.progress=false", "data.prompts_per_step=2", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2",
        "rollout.max_tokens_per_turn=16", "rollout.max_response_tokens=16", "run.save_every=0"]


def test_config_rules():
    base = ["model.policy=tiny-qwen2", *FAST]
    with pytest.raises(ConfigError, match="rollout.filter_groups needs rollout.n_samples >= 2"):
        load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [*base, "rollout.filter_groups=true", "rollout.n_samples=1",
                                                                      "algorithm.mini_batch_size=2"])
    with pytest.raises(ConfigError, match="rollout.uniform_groups=drop needs rollout.n_samples >= 2"):
        load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [*base, "rollout.uniform_groups=drop", "rollout.n_samples=1",
                                                                      "algorithm.mini_batch_size=2"])
    with pytest.raises(ConfigError, match="rollout.filter_max_rounds must be >= 0"):
        load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [*base, "rollout.filter_max_rounds=-1"])


def test_a_run_with_no_informative_group_samples_every_round_then_trains_a_full_batch(tmp_path, tiny_model_dir):
    """tiny-qwen2 never solves a math question: every group is all-zero, so each step generates 1 + 2 batches,
    draws 3 x prompts_per_step prompts from the sampler, and still trains on prompts_per_step groups."""
    cfg = load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml",
                      [f"run.output_dir={tmp_path}", f"model.policy={tiny_model_dir}", "run.total_steps=2", *FAST,
                       "rollout.filter_groups=true", "rollout.filter_max_rounds=2"])
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        history = trainer.train()
        assert trainer.sampler.position == 2 * 3 * 2  # 2 steps x 3 batches x 2 prompts
    finally:
        trainer.close()
    n = cfg.rollout.n_samples
    for m in history:
        assert m["filter/sampled_per_trained_group"] == 3.0 and m["filter/informative_frac"] == 0.0
        assert m["filter/sampled_reward_mean"] == m["reward/mean"] == 0.0
        assert m["reward/zero_variance_groups"] == 1.0
        assert m["actor/updates"] == 2 * n / 4  # a full batch of 2 groups trained (mini-batch 4)
