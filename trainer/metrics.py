"""A step's metrics: named per-rank sums, reduced across ranks in one all-reduce, then turned into means.

Every rank adds what it saw to one :class:`MetricSums` (rollout sums from
:func:`rollout_sums`, update sums from :func:`trainer.step.ppo_update`); :meth:`MetricSums.reduce`
sums them over ranks with a single collective, and :func:`step_metrics` derives the logged values
(``reward/mean``, ``loss/clip_frac``, ``kl/mean``, ...), global over all ranks' trajectories.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from trainer import distributed as D
from trainer.batch import TokenBatch
from trainer.algo.behavior import behavior_metrics
from trainer.algo.distill import distill_metrics

__all__ = ["MetricSums", "rollout_sums", "step_metrics", "rollout_metrics", "update_metrics"]


class MetricSums:
    """Named float sums of one step on this rank.

    Every rank of a run must add the same names (they follow from the config, not the data): the
    reduction sums one float64 vector laid out by the sorted names.
    """

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._maxima: dict[str, float] = {}  # reduced with a max instead of a sum

    def add(self, name: str, value: float) -> None:
        self._sums[name] = self._sums.get(name, 0.0) + float(value)

    def maximum(self, name: str, value: float) -> None:
        """A running maximum (e.g. the largest train–inference log-prob gap), the max over ranks after :meth:`reduce`."""
        self._maxima[name] = max(self._maxima.get(name, float("-inf")), float(value))

    def merge(self, other: "MetricSums") -> "MetricSums":
        for name, value in other._sums.items():
            self.add(name, value)
        for name, value in other._maxima.items():
            self.maximum(name, value)
        return self

    def __contains__(self, name: str) -> bool:
        return name in self._sums or name in self._maxima

    def local(self) -> dict[str, float]:
        return {**self._sums, **self._maxima}

    def reduce(self) -> dict[str, float]:
        """The sums (and maxima) over all ranks (one ``all_reduce`` each; the local values when running alone)."""
        names = sorted(self._sums)
        total = D.all_reduce_sum(torch.tensor([self._sums[k] for k in names], dtype=torch.float64))
        out = dict(zip(names, total.tolist()))
        if self._maxima:
            top = sorted(self._maxima)
            out.update(zip(top, D.all_reduce_max(torch.tensor([self._maxima[k] for k in top], dtype=torch.float64)).tolist()))
        return out


def learn_sums(sampled: Any, batch: TokenBatch, update: MetricSums, extra: Mapping[str, float], *, group_size: int) -> MetricSums:
    """This rank's sums of a step that learned from ``sampled`` (a :class:`trainer.sampled_batch.SampledBatch`) as
    ``batch``: the rollout's (:func:`rollout_sums`), the batch's ``sampling`` sums and the ``extra`` ones, the
    ``update``'s, and π_old's entropy from its pass when the update did not measure it."""
    sums = rollout_sums(sampled.rewards, group_size, sampled.trajectories, sampled.stats, sampled.reward_counts, batch,
                        answers=[o.answer for o in sampled.outcomes])
    for name, value in {**sampled.sampling, **extra}.items():
        sums.add(name, value)
    sums.merge(update)
    if "rollout/entropy_sum" not in sums:
        sums.add("rollout/entropy_sum", float((batch.stored["entropy"] * batch.loss_mask).sum()))
    return sums


def rollout_sums(rewards: torch.Tensor, group_size: int, trajectories: list[Any], stats: Any,
                 reward_counts: Mapping[str, float], batch: TokenBatch, *,
                 answers: Sequence[str | None] | None = None) -> MetricSums:
    """Reward, length, search and time sums of this rank's rollout batch (group-major ``rewards`` ``(N,)``);
    with ``answers`` (each trajectory's graded answer), the text signals of :func:`trainer.health_signals.health_sums`."""
    from trainer.health_signals import health_sums
    from trainer.sampled_batch import trajectory_stats

    t = trajectory_stats(trajectories, stats)
    grouped = rewards.view(-1, group_size)
    sums = MetricSums()
    for name, value in {
        "rollout/trajectories": float(len(rewards)),
        "rollout/reward_sum": float(rewards.sum()),
        "rollout/reward_sq_sum": float((rewards * rewards).sum()),
        "rollout/response_tokens": float(batch.response_lens.sum()),
        "rollout/model_tokens": float(batch.loss_mask.sum()),
        "rollout/searches": t["searches"],
        "rollout/search_failures": t["search_failures"],
        "rollout/invalid_action_trajectories": t["invalid_action_trajectories"],
        "rollout/turns": t["turns"],
        "rollout/truncated": t["truncated"],
        "rollout/answered": float(sum(tr.stop_reason == "answer" for tr in trajectories)),
        "rollout/generation_s": t["generation_time"],
        "rollout/retrieval_s": t["retrieval_time"],
        "rollout/zero_variance_groups": float((grouped.min(1).values == grouped.max(1).values).sum()),
        "rollout/groups": float(grouped.shape[0]),
        "rollout/tokens": float(batch.response_lens.sum() + batch.prompt_lens.sum()),
        **{f"reward/{key}": value for key, value in reward_counts.items()},
    }.items():
        sums.add(name, value)
    if answers is not None:
        for name, value in health_sums([t.model_text for t in trajectories], answers).items():
            sums.add(name, value)
    return sums


def step_metrics(s: Mapping[str, float], **update: Any) -> dict[str, float]:
    """The logged metrics of a step from its rank-summed sums ``s`` (timings are added by the caller):
    :func:`rollout_metrics` and :func:`update_metrics` (``update``: its keyword arguments)."""
    return {**rollout_metrics(s), **update_metrics(s, **update)}


def rollout_metrics(s: Mapping[str, float]) -> dict[str, float]:
    """Means over all ranks' trajectories of the rollout sums of :func:`rollout_sums` (+ ``rollout/entropy_sum``)."""
    n = s["rollout/trajectories"]
    mean = s["rollout/reward_sum"] / n
    model_tokens = s["rollout/model_tokens"]
    return {
        "reward/mean": mean,
        "reward/std": math.sqrt(max(s["rollout/reward_sq_sum"] / n - mean * mean, 0.0)),
        "reward/zero_variance_groups": s["rollout/zero_variance_groups"] / max(s["rollout/groups"], 1.0),
        "response/length_mean": s["rollout/response_tokens"] / n,
        "response/model_tokens_mean": model_tokens / n,
        "response/truncated_frac": s["rollout/truncated"] / n,
        # the stability guard's format-error detector reads these two; no answer: none found, empty or a refusal
        # (trainer.health_signals.avoids_answer), else the task's own count (math: nothing boxed)
        "response/invalid_action_rate": s.get("rollout/invalid_action_trajectories", 0.0) / n,
        "response/no_answer_rate": s.get("health/no_answer", s.get("reward/no_answer", 0.0)) / n,
        # the format rate: trajectories that ended with an answer action (search: an <answer> was given)
        "response/answered_frac": s["rollout/answered"] / n,
        "actor/entropy": s["rollout/entropy_sum"] / max(model_tokens, 1.0),
        "search/per_traj": s["rollout/searches"] / n,
        "search/failures": s["rollout/search_failures"],
        "search/turns_per_traj": s["rollout/turns"] / n,
        **{name: value for name, value in s.items() if name.startswith(("reward/", "guidance/"))},
        **filter_metrics(s),
        **health_metrics(s),
        **session_metrics(s),
        **tool_metrics(s),
    }


def session_metrics(s: Mapping[str, float]) -> dict[str, float]:
    """``rollout.agent`` (agent/external.py): the recorded sessions that split into several contexts (the agent
    rewrote or truncated its history; count), the contexts trained per session, and the update's rows beyond one per
    trajectory (the extra segments, and in a sharded run the filler rows that even out the ranks)."""
    if "rollout/sessions" not in s:
        return {}
    return {"rollout/session_splits": s["rollout/session_splits"],
            "rollout/segments_per_session": s["rollout/session_segments"] / max(s["rollout/sessions"], 1.0),
            "rollout/extra_rows": s["rollout/extra_rows"]}


def tool_metrics(s: Mapping[str, float]) -> dict[str, float]:
    """``rollout.tools``: per tool, from the ``tools/<name>/*`` sums of :func:`trainer.sampled_batch.tool_sums`: its
    calls, failures (all, and timeouts, oversized outputs, other errors), the trajectories that called it and their
    mean reward (``tools/<name>/reward``); and over all tools ``tools/calls`` and ``tools/failures``."""
    out: dict[str, float] = {}
    names = sorted({k.split("/")[1] for k in s if k.startswith("tools/") and k.endswith("/calls") and k.count("/") == 2})
    for name in names:
        p = f"tools/{name}/"
        for kind in ("calls", "failures", "timeouts", "oversized", "errors", "trajectories"):
            out[p + kind] = s[p + kind]
        out[p + "reward"] = s[p + "reward_sum"] / s[p + "trajectories"] if s[p + "trajectories"] else float("nan")
    if names:
        out["tools/calls"] = sum(out[f"tools/{n}/calls"] for n in names)
        out["tools/failures"] = sum(out[f"tools/{n}/failures"] for n in names)
    return out


def health_metrics(s: Mapping[str, float]) -> dict[str, float]:
    """The mean over responses of the repeated n-gram and non-text shares (:mod:`trainer.health_signals`) and,
    with ``logging.kl_to_start``, the mean over response tokens of the KL to the start (:mod:`trainer.start_kl`)."""
    out = {}
    if "health/responses" in s:
        n = max(s["health/responses"], 1.0)
        out = {"response/repeated_ngram_share": s["health/repeated_ngram_sum"] / n,
               "response/non_text_share": s["health/non_text_sum"] / n}
    if "health/kl_to_start_tokens" in s:
        out["kl/to_start"] = s["health/kl_to_start_sum"] / max(s["health/kl_to_start_tokens"], 1.0)
    return out


def filter_metrics(s: Mapping[str, float]) -> dict[str, float]:
    """``rollout.filter_groups`` (:mod:`trainer.group_filter`): the mean reward over every trajectory generated in
    the step, the share of trained groups that are informative, the share of informative groups in the first
    prompt batch and among all sampled ones, and groups generated per trained group."""
    if "filter/sampled_trajectories" not in s:
        return {}
    groups = max(s["rollout/groups"], 1.0)
    return {"filter/sampled_reward_mean": s["filter/sampled_reward_sum"] / max(s["filter/sampled_trajectories"], 1.0),
            "filter/informative_frac": s["filter/informative_groups"] / groups,
            # informative groups among the first prompt batch (what the step would train on without filtering)
            "filter/first_round_informative_frac": s["filter/first_round_informative_groups"] / max(s.get("filter/first_round_groups", groups), 1.0),
            "filter/informative_groups": s["filter/informative_groups"],  # trained groups with a policy gradient (count)
            "filter/dropped_uniform_groups": s.get("filter/dropped_uniform_groups", 0.0),  # rollout.uniform_groups=drop
            "filter/sampled_trajectories": s["filter/sampled_trajectories"],  # generated and graded in the step (count)
            "filter/sampled_informative_frac": s["filter/sampled_informative_groups"] / max(s["filter/sampled_groups"], 1.0),
            "filter/sampled_per_trained_group": s["filter/sampled_groups"] / groups}


def update_metrics(s: Mapping[str, float], *, world_size: int, grad_norms: list[float], updates: int, skipped: int,
                   lr: float, kl_enabled: bool) -> dict[str, float]:
    """The ``loss/*``, ``actor/*`` and ``kl/*`` metrics of a PPO update from its rank-summed ``update/*`` sums.

    ``loss/pg`` and ``kl/loss`` are the mean over optimizer steps of the aggregated loss terms (each
    rank's term is normalised for the global mini-batch times the data-parallel size, hence the
    division by ``world_size``); ``actor/grad_norm`` is the mean over the updates that were applied;
    ``perf/padding_frac`` the share of the training passes' tokens that were padding (micro-batching's cost).
    """
    tokens = max(s["update/tokens"], 1.0)
    steps = max(updates + skipped, 1)
    out = {
        "loss/clip_frac": s["update/clipfrac_sum"] / tokens,
        "loss/ppo_kl": s["update/ppo_kl_sum"] / tokens,
        "loss/ratio_mean": s["update/ratio_sum"] / tokens,
        "loss/pg": s["update/pg_loss"] / world_size / steps,
        "actor/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
        "actor/lr": lr,
        "actor/updates": float(updates),
        "actor/skipped_updates": float(skipped),
    }
    if "update/computed_tokens" in s:  # trainer.step.ppo_update adds both
        out["perf/padding_frac"] = 1.0 - s["update/real_tokens"] / max(s["update/computed_tokens"], 1.0)
    if kl_enabled:
        out["kl/mean"] = s["update/kl_token_sum"] / tokens
        out["kl/loss"] = s["update/kl_loss"] / world_size / steps
    return {**out, **behavior_metrics(s), **distill_metrics(s, world_size=world_size, steps=steps)}


def peak_memory(device: torch.device) -> dict[str, float]:
    """The process's peak memory so far, beside the plan (:mod:`trainer.plan.compare`): ``perf/peak_memory_bytes``
    (the CUDA allocator's peak, what ``emapg plan`` predicts) on a GPU; ``perf/peak_rss_bytes`` (peak resident set,
    ``VmHWM``: it also holds the interpreter and libraries) on a CPU."""
    if device.type == "cuda":
        return {"perf/peak_memory_bytes": float(torch.cuda.max_memory_allocated(device))}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return {"perf/peak_rss_bytes": float(int(line.split()[1]) * 1024)}
    except OSError:
        pass
    return {}
