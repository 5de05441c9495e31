"""Step metrics (trainer/metrics.py): named sums, one reduction over ranks, the derived means."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.multiprocessing as mp

from trainer.batch import build_token_batch
from trainer.metrics import MetricSums, rollout_sums, step_metrics
from tests.fixtures.spawn import free_port


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    sums = MetricSums()
    sums.add("b", 10.0 * (rank + 1))
    sums.add("a", rank + 0.5)
    sums.add("a", 1.0)
    calls = []
    original = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), original(*a, **k))[1]  # count the collectives
    try:
        total = sums.reduce()
    finally:
        dist.all_reduce = original
    torch.save({"total": total, "collectives": len(calls)}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_sums_are_reduced_over_ranks_in_one_collective(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["total"] == {"a": 0.5 + 1.0 + 1.5 + 1.0, "b": 30.0}
        assert got["collectives"] == 1


def test_sums_alone_and_merged():
    a, b = MetricSums(), MetricSums()
    a.add("x", 1.5)
    b.add("x", 2.0)
    b.add("y", 3.0)
    assert a.merge(b).reduce() == {"x": 3.5, "y": 3.0}
    assert "y" in a and "z" not in a


def _traj(i: int, searches: int, fails: int, turns: int, stop: str):
    from agent.rollout import Trajectory

    return Trajectory(uid=f"t{i}", group_id=f"g{i // 2}", prompt_index=i // 2, sample_index=i % 2, question="q",
                      example_id=None, prompt_ids=[1], stop_reason=stop, num_turns=turns, num_searches=searches,
                      search_failures=fails)


def test_rollout_and_update_metrics_from_sums():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])  # groups of 2: (1, 0) varies, (1, 1) does not
    batch = build_token_batch([[1, 2], [3], [4, 5, 6], [7]], [[8, 9, 10], [11], [12, 13], [14, 15, 16, 17]],
                              [[1, 0, 1], [1], [1, 1], [1, 1, 1, 1]], pad_id=0)
    from agent.rollout import RolloutStats

    trajs = [_traj(0, 1, 0, 2, "stop"), _traj(1, 2, 1, 3, "length"), _traj(2, 0, 0, 1, "stop"), _traj(3, 1, 0, 2, "context")]
    sums = rollout_sums(rewards, 2, trajs, RolloutStats(generation_s=2.0, retrieval_wait_s=0.5), {"no_answer": 3.0}, batch)
    sums.add("rollout/entropy_sum", 9.0)
    for name, value in {"update/tokens": 9.0, "update/clipfrac_sum": 0.9, "update/ppo_kl_sum": -0.18,
                        "update/ratio_sum": 9.09, "update/pg_loss": 0.4, "update/kl_token_sum": 0.27, "update/kl_loss": 0.06,
                        "update/computed_tokens": 40.0, "update/real_tokens": 30.0}.items():
        sums.add(name, value)
    m = step_metrics(sums.reduce(), world_size=1, grad_norms=[0.5, 1.5], updates=2, skipped=0, lr=1e-3, kl_enabled=True)
    assert m["reward/mean"] == 0.75 and m["reward/std"] == pytest.approx(math.sqrt(0.75 - 0.5625))
    assert m["reward/zero_variance_groups"] == 0.5 and m["reward/no_answer"] == 3.0
    assert m["response/length_mean"] == 10 / 4 and m["response/model_tokens_mean"] == 9 / 4
    assert m["response/truncated_frac"] == 0.5 and m["actor/entropy"] == 1.0
    assert (m["search/per_traj"], m["search/failures"], m["search/turns_per_traj"]) == (1.0, 1.0, 2.0)
    assert m["loss/clip_frac"] == pytest.approx(0.1) and m["loss/ppo_kl"] == pytest.approx(-0.02)
    assert m["loss/ratio_mean"] == pytest.approx(1.01) and m["loss/pg"] == pytest.approx(0.2)
    assert m["kl/mean"] == pytest.approx(0.03) and m["kl/loss"] == pytest.approx(0.03)
    assert (m["actor/grad_norm"], m["actor/lr"], m["actor/updates"], m["actor/skipped_updates"]) == (1.0, 1e-3, 2.0, 0.0)
    assert m["perf/padding_frac"] == 0.25
    no_kl = step_metrics(sums.reduce(), world_size=1, grad_norms=[], updates=0, skipped=1, lr=1e-3, kl_enabled=False)
    assert "kl/mean" not in no_kl and math.isnan(no_kl["actor/grad_norm"]) and no_kl["loss/pg"] == pytest.approx(0.4)
    totals = sums.reduce()
    assert totals["rollout/tokens"] == 7 + 10 and totals["rollout/generation_s"] == 2.0


def test_maxima_merge_and_reduce_as_maxima():
    from trainer.metrics import MetricSums

    a, b = MetricSums(), MetricSums()
    a.add("x", 1.0)
    a.maximum("m", 0.5)
    b.maximum("m", 2.0)
    b.maximum("m", -1.0)
    b.add("x", 2.0)
    assert a.merge(b).reduce() == {"x": 3.0, "m": 2.0} and "m" in a


def test_text_health_metrics_from_the_model_text_and_answers():
    from dataclasses import replace

    from agent.rollout import RolloutStats
    from trainer.metrics import rollout_metrics

    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    batch = build_token_batch([[1], [2], [3], [4]], [[5], [6], [7], [8]], [[1], [1], [1], [1]], pad_id=0)
    texts = ["<answer>Paris</answer>", "go go go go go go", "a1b2 Paris", "<answer>I don't know</answer>"]
    trajs = [replace(_traj(i, 0, 0, 1, "stop"), model_text=t) for i, t in enumerate(texts)]
    sums = rollout_sums(rewards, 2, trajs, RolloutStats(), {"no_answer": 0.0}, batch,
                        answers=["Paris", None, None, "I don't know"])
    sums.add("rollout/entropy_sum", 0.0)
    m = rollout_metrics(sums.reduce())
    assert m["response/repeated_ngram_share"] == (0 + 2 / 3 + 0 + 0) / 4  # six go's: three 4-grams, one distinct
    assert m["response/non_text_share"] == (0 + 0 + 1 / 2 + 0) / 4
    assert m["response/no_answer_rate"] == 3 / 4  # two without an answer, one refusal (the task counted none)
    without = rollout_sums(rewards, 2, trajs, RolloutStats(), {"no_answer": 1.0}, batch)
    without.add("rollout/entropy_sum", 0.0)
    m = rollout_metrics(without.reduce())
    assert "response/repeated_ngram_share" not in m and m["response/no_answer_rate"] == 1 / 4
    assert "kl/to_start" not in m
    without.add("health/kl_to_start_sum", 0.75)  # trainer.start_kl.StartPolicy.kl_sums (logging.kl_to_start)
    without.add("health/kl_to_start_tokens", 3.0)
    assert rollout_metrics(without.reduce())["kl/to_start"] == 0.25
