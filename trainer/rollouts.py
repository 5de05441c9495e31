"""The trainer's side of rollouts: the scored batch (:class:`Rollouts`), each step's sampling seed, calling the
agent loop, scoring, summarising.

Kept apart from the loop so that tests, benchmarks, the pipeline and the group filter use the same code
without importing the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from tasks.rewards import compute_rewards
from trainer.data import SampledPrompt

if TYPE_CHECKING:
    from agent.rollout import RolloutStats, Trajectory


def step_seed(seed: int, step: int, rank: int) -> int:
    """Sampling seed of a step: fixed by (run seed, step, rank), so a resumed run samples the same."""
    return (seed * 1_000_003 + step * 10_007 + rank * 101) % (2**31 - 1)


@dataclass
class Rollouts:
    """One rank's rollout batch after scoring: what the producer hands the update consumer."""

    prompts: list[SampledPrompt]  # one per group
    trajectories: list[Trajectory]  # group-major
    group_ids: list[str]
    rewards: torch.Tensor  # (N,)
    reward_counts: dict[str, float]
    stats: RolloutStats
    sampling: dict[str, float] = field(default_factory=dict)  # rollout.filter_groups: the filter/* sums (trainer.group_filter)


def generate(
    engine: Any, tokenizer: Any, prompts: list[SampledPrompt], retriever: Any, cfg: Any, *, seed: int
) -> tuple[list[Trajectory], RolloutStats]:
    """``cfg.rollout.n_samples`` trajectories per prompt (group-major) and the batch's
    :class:`agent.rollout.RolloutStats`, sampled with ``seed``.

    The agent loop derives a seed per (prompt, sample, turn) from ``seed``, so a step's
    samples depend only on the run seed and the step (bit-for-bit resume).
    """
    from agent.rollout import RolloutConfig, run_rollouts_with_stats

    fields = {f: getattr(cfg.rollout, f) for f in RolloutConfig.__dataclass_fields__}
    agent_cfg = replace(RolloutConfig(**fields), seed=seed)
    trajs, stats = run_rollouts_with_stats(engine, [p.example for p in prompts], retriever, agent_cfg, batch_tag=f"s{prompts[0].group_id}")
    n = cfg.rollout.n_samples
    if len(trajs) != len(prompts) * n:
        raise RuntimeError(f"the agent returned {len(trajs)} trajectories for {len(prompts)} prompts x {n}")
    errors = [t for t in trajs if t.stop_reason == "error"]
    if errors and len(errors) == len(trajs):
        # The agent isolates failures per trajectory; all of them failing means the batch crashed.
        raise RuntimeError(f"every trajectory of the batch failed, e.g.: {errors[0].error}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    for t in trajs:
        if not t.prompt_ids:  # the prompt could not be built (e.g. too long): keep the slot, train on nothing
            t.prompt_ids = [pad]
            t.response_ids, t.loss_mask = [], []
        elif t.stop_reason == "error":  # a trajectory cut short by an error is scored 0 and not trained on
            t.loss_mask = [0] * len(t.response_ids)
    return trajs, stats


def score(trajectories: list[Trajectory], prompts: list[SampledPrompt], cfg: Any, tokenizer: Any) -> tuple[list[float], dict[str, float]]:
    """Rewards of every trajectory against its prompt's gold answers (errored trajectories score 0).

    Only what the model generated is scored (``Trajectory.scored_text``: its turns, or its final plain answer
    in the tool-call format), never observation text.
    """
    n = cfg.rollout.n_samples
    golds = [prompts[i // n].example.answers for i in range(len(trajectories))]
    texts = [t.scored_text if t.stop_reason != "error" else "" for t in trajectories]
    r = cfg.reward
    if getattr(cfg.rollout, "agent_reward", None):  # the user's reward function (agent/external.py)
        from agent.external import user_rewards

        answers = [t.final_answer if t.stop_reason != "error" else None for t in trajectories]
        rewards, counts = user_rewards(cfg.rollout.agent_reward, [prompts[i // n].example for i in range(len(trajectories))], answers), {}
    else:
        rewards, counts = compute_rewards(
            cfg.rollout.task, texts, golds, math_timeout=r.math_timeout, math_workers=r.math_workers, math_grader=r.math_grader
        )
    counts = dict(counts, rollout_errors=float(sum(t.stop_reason == "error" for t in trajectories)))
    return rewards, counts


def trajectory_stats(trajectories: list[Trajectory], stats: RolloutStats) -> dict[str, float]:
    """Sums over trajectories and the batch's wall times (the caller reduces over ranks)."""
    return {
        "searches": float(sum(t.num_searches for t in trajectories)),
        "search_failures": float(sum(t.search_failures for t in trajectories)),
        "invalid_action_trajectories": float(sum(t.invalid_actions > 0 for t in trajectories)),
        "turns": float(sum(t.num_turns for t in trajectories)),
        "truncated": float(sum(t.stop_reason in ("length", "context") for t in trajectories)),
        "generation_time": float(stats.generation_s),
        "retrieval_time": float(stats.retrieval_wait_s),
    }
