"""Dynamic sampling: train only on groups whose rewards differ (``rollout.filter_groups``).

A group whose ``n_samples`` rewards are all equal has GRPO advantage 0 for every token: its policy
gradient is exactly zero, yet the step still pays its anchor and training passes. When the policy
solves few training questions (the CPU demo's starter: ~6% of NQ/HotpotQA train questions, so most
groups of 4 are all-zero) most steps then learn nothing. DAPO (Yu et al., 2025, "dynamic sampling")
keeps sampling until the batch is full of informative groups; this is that rule with a bound:

* the step's batch is generated as usual; its informative groups are kept;
* up to ``rollout.filter_max_rounds`` more batches of ``data.prompts_per_step`` prompts are drawn from
  the sampler and generated with the same weights (another seed) until ``prompts_per_step``
  informative groups are kept; extras beyond that are dropped (the last round is not re-drawn);
* if the rounds run out first, the batch is topped up with the earliest uninformative groups, so every
  step (and every rank) trains on the same number of rows. Those rows carry only the KL term.

Departure from DAPO: DAPO has no round bound (it samples until full); a bound keeps a step's cost
predictable. The KL term of the dropped groups is not trained on (DAPO has no KL).

The pure selection is :func:`fill_informative`; :class:`InformativeFilling`, one of the step's batch shapers
(:meth:`trainer.loop.Trainer.train_step`), supplies it the rollout batches. ``filter/*`` metrics say what was sampled: ``filter/sampled_reward_mean`` is the mean
reward over everything generated in the step (``reward/mean`` is over the trained batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from provision.engines import EngineSession
    from trainer.config import TrainConfig
    from trainer.data import SampledPrompt
    from trainer.distributed import DistInfo
    from trainer.sampled_batch import SampledBatch


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``rewards`` ``(G * group_size,)`` group-major -> bool ``(G,)``: the group's rewards are not all equal."""
    grouped = rewards.view(-1, group_size)
    return grouped.max(dim=1).values != grouped.min(dim=1).values


def select_groups(sampled: "SampledBatch", groups: list[int], group_size: int) -> "SampledBatch":
    """The batch made of ``sampled``'s groups ``groups`` (in that order), each trajectory with its outcome."""
    return sampled.take([g * group_size + j for g in groups for j in range(group_size)], groups)


def concat_batches(parts: list["SampledBatch"]) -> "SampledBatch":
    """One batch of ``parts``' rows in order (each trajectory with its outcome), with their rollout stats
    (wall times, calls) summed and their reward counts summed."""
    first = parts[0]
    counts: dict[str, float] = {}
    for p in parts:
        for k, v in p.reward_counts.items():
            counts[k] = counts.get(k, 0.0) + v
    return replace(first, prompts=[x for p in parts for x in p.prompts], trajectories=[x for p in parts for x in p.trajectories],
                   outcomes=[x for p in parts for x in p.outcomes], reward_counts=counts, stats=summed_stats(parts))


def summed_stats(parts: list["SampledBatch"]) -> Any:
    """The parts' ``agent.rollout.RolloutStats`` summed field by field (wall times and call counts)."""
    stats = replace(parts[0].stats)
    for p in parts[1:]:
        for f in fields(stats):
            setattr(stats, f.name, getattr(stats, f.name) + getattr(p.stats, f.name))
    return stats


def fill_informative(first: "SampledBatch", more: Callable[[int], "SampledBatch"], *, want: int, group_size: int,
                     max_rounds: int, agree: Callable[[bool], bool] = bool, enough: int | None = None,
                     topup: bool = True) -> tuple["SampledBatch", dict[str, float]]:
    """Keep up to ``want`` groups whose rewards differ: ``first``'s, then those of ``more(1)``, ``more(2)``, ...
    (at most ``max_rounds`` calls, and only while fewer than ``enough`` -- default ``want`` -- are kept); short of
    ``want``, top up with the earliest uninformative groups (``topup``), or leave them out (``topup=False``:
    ``rollout.uniform_groups=drop``; if no group is informative after every round, the earliest uniform group is
    kept alone, so a step always has rows).
    ``agree(full)`` turns this rank's "full" into the data-parallel ranks' common answer (all full), so every
    rank generates the same number of rounds and their prompt samplers stay in step.

    Returns the batch -- ``want`` groups in sampling order, informative ones first, then the top-up; its
    ``stats`` are those of every batch generated (the step's generation work); its ``reward_counts`` are
    NOT recounted for the kept rows (the caller counts their kept outcomes; nothing is graded again) -- and the ``filter/*`` sums: sampled
    groups and trajectories, the reward sum over them, informative groups kept, informative groups among
    all sampled and among the first round's, extra rounds generated."""
    batches = [first]
    kept: list[tuple[int, int]] = []  # (batch, group)
    spare: list[tuple[int, int]] = []
    first_informative = 0
    rounds = 0
    while True:
        b = len(batches) - 1
        for g, ok in enumerate(informative_groups(batches[b].rewards, group_size).tolist()):
            (kept if ok else spare).append((b, g))
        if b == 0:
            first_informative = len(kept)
        if agree(len(kept) >= (want if enough is None else enough)) or rounds >= max_rounds:
            break
        rounds += 1
        batches.append(more(rounds))
    chosen = kept[:want] + spare[: max(0, want - len(kept)) if topup else (0 if kept else 1)]
    rows = concat_batches([select_groups(batches[b], [g], group_size) for b, g in chosen])
    out = replace(rows, stats=summed_stats(batches), reward_counts={})
    sampled = sum(len(x.rewards) for x in batches)
    sums = {
        "filter/sampled_groups": float(sampled // group_size),
        "filter/sampled_trajectories": float(sampled),
        "filter/sampled_reward_sum": float(sum(float(x.rewards.sum()) for x in batches)),
        "filter/informative_groups": float(min(len(kept), want)),
        "filter/sampled_informative_groups": float(len(kept)),
        "filter/first_round_informative_groups": float(first_informative),
        "filter/first_round_groups": float(len(first.rewards) // group_size),
        "filter/rounds": float(rounds),
        "filter/dropped_uniform_groups": float(0 if topup else len(spare) - (0 if kept else 1)),
    }
    return out, sums


class ProducingTrainer(Protocol):
    """What :class:`InformativeFilling` uses of the run (:class:`trainer.loop.Trainer` is one): its place, the
    prompt sampler's next share, the engine session and the produce half of a step."""

    cfg: "TrainConfig"
    step: int
    dist: "DistInfo"
    engine_session: "EngineSession"

    def sample_prompts(self) -> list["SampledPrompt"]: ...

    def produce(self, engine: Any, prompts: list["SampledPrompt"], seed: int) -> "SampledBatch": ...


class InformativeFilling:
    """``rollout.filter_groups`` (or ``rollout.uniform_groups=drop``) as a batch shaper of the step: the sampled batch
    with its groups of equal rewards replaced by informative groups of up to ``rollout.filter_max_rounds`` more prompt
    batches (:func:`fill_informative`); the ``reward/*`` counts are those of the rows kept (from their outcomes:
    nothing is graded again), the ``filter/*`` sums its ``sampling``."""

    def __call__(self, trainer: ProducingTrainer, sampled: "SampledBatch") -> "SampledBatch":
        from trainer import distributed as D
        from trainer.data import SampledPrompt
        from trainer.sampled_batch import reward_counts, step_seed

        cfg = trainer.cfg
        base_seed = step_seed(cfg.run.seed, trainer.step + 1, trainer.dist.rank)

        def more(round_: int) -> "SampledBatch":
            prompts = [SampledPrompt(p.example, f"{p.group_id}.{round_}") for p in trainer.sample_prompts()]
            with trainer.engine_session.generating(tag=f"step-{trainer.step}-fill{round_}") as engine:
                return trainer.produce(engine, prompts, (base_seed + 7_919 * round_) % (2**31 - 1))

        def all_full(full: bool) -> bool:  # one answer for all ranks: they draw from one prompt sampler
            return D.all_reduce_max(torch.tensor([0.0 if full else 1.0])).item() == 0

        drop = cfg.rollout.uniform_groups == "drop"
        out, sums = fill_informative(sampled, more, want=len(sampled.prompts), group_size=cfg.rollout.n_samples,
                                     max_rounds=cfg.rollout.filter_max_rounds, agree=all_full,
                                     enough=None if cfg.rollout.filter_groups else 1, topup=not drop)
        return replace(out, reward_counts=reward_counts(out.trajectories, out.outcomes, cfg), sampling=sums)
