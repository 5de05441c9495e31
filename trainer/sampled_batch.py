"""The trainer's batch of sampled groups (:class:`SampledBatch`): each step's sampling seed, calling the agent
loop (:mod:`agent.rollout`, the multi-turn rollout), grading each trajectory once, summarising.

Kept apart from the loop so that tests, benchmarks, the pipeline and the group filter use the same code
without importing the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable

import torch

from tasks.task import Grading, Outcome, get_task
from trainer.batch import pad_id_of
from trainer.data import SampledPrompt

if TYPE_CHECKING:
    from agent.rollout import RolloutStats, Trajectory


def step_seed(seed: int, step: int, rank: int) -> int:
    """Sampling seed of a step: fixed by (run seed, step, rank), so a resumed run samples the same."""
    return (seed * 1_000_003 + step * 10_007 + rank * 101) % (2**31 - 1)


@dataclass
class SampledBatch:
    """One rank's batch of sampled groups, graded: what the producer hands the update consumer.

    Each trajectory's :class:`tasks.task.Outcome` (its reward and why) is kept with it, so a batch that is cut,
    joined or shared (dynamic sampling, the pipeline's ranks) is never graded again; a group's id is its
    prompt's (:attr:`trainer.data.SampledPrompt.group_id`).
    """

    prompts: list[SampledPrompt]  # one per group
    trajectories: list[Trajectory]  # group-major, len(prompts) * group size
    outcomes: list[Outcome]  # one per trajectory
    reward_counts: dict[str, float]  # the reward/* sums of the batch (trainer.metrics)
    stats: RolloutStats
    sampling: dict[str, float] = field(default_factory=dict)  # rollout.filter_groups: the filter/* sums (trainer.group_filter)

    @property
    def group_size(self) -> int:
        return len(self.trajectories) // len(self.prompts) if self.prompts else 0

    @cached_property
    def group_ids(self) -> list[str]:
        """Per trajectory, its group's id (group-major)."""
        return [p.group_id for p in self.prompts for _ in range(self.group_size)]

    @cached_property
    def rewards(self) -> torch.Tensor:
        """``(N,)`` float32, group-major (the outcomes' rewards; computed once per batch)."""
        return torch.tensor([o.reward for o in self.outcomes], dtype=torch.float32)

    def take(self, rows: list[int] | range, groups: list[int] | range) -> "SampledBatch":
        """The batch made of trajectories ``rows`` of prompts ``groups`` (same stats and counts)."""
        return replace(self, prompts=[self.prompts[g] for g in groups], trajectories=[self.trajectories[r] for r in rows],
                       outcomes=[self.outcomes[r] for r in rows])


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
    pad = pad_id_of(tokenizer)
    for t in trajs:
        if not t.prompt_ids:  # the prompt could not be built (e.g. too long): keep the slot, train on nothing
            t.prompt_ids = [pad]
            t.response_ids, t.loss_mask = [], []
        elif t.stop_reason == "error":  # a trajectory cut short by an error is scored 0 and not trained on
            t.loss_mask = [0] * len(t.response_ids)
            t.extra_segments = []
    return trajs, stats


@dataclass
class TrainingRows:
    """The rows of a step's update: every trajectory, each followed by its extra segments (a recorded session that
    split, :attr:`agent.rollout.Trajectory.extra_segments`), then any filler rows. ``episode[i]`` is the index of the
    trajectory row ``i`` belongs to (-1: a filler row, an empty response that trains nothing)."""

    rows: list[Any]
    episode: list[int]

    @property
    def extra(self) -> int:
        """Rows beyond one per trajectory (extra segments and fillers)."""
        return len(self.rows) - len({e for e in self.episode if e >= 0})

    def per_row(self, values: torch.Tensor, filler: float = 0.0) -> torch.Tensor:
        """Per-trajectory ``values`` ``(N, ...)`` as per-row values: each segment row carries its trajectory's (the
        episode's advantage, reward or group), a filler row ``filler``."""
        index = torch.tensor([max(e, 0) for e in self.episode], dtype=torch.long)
        out = values[index].clone()
        out[torch.tensor([e < 0 for e in self.episode], dtype=torch.bool)] = filler
        return out


def training_rows(trajectories: list[Trajectory], *, pad_id: int, at_least: int = 0) -> TrainingRows:
    """:class:`TrainingRows` of ``trajectories``: each one's row, followed by its extra segments' rows, and filler
    rows up to ``at_least`` rows (a sharded run gives every rank as many rows, so every rank runs as many forwards and
    optimizer steps: the trainer passes the most rows any rank has).

    GRPO semantics: the group statistics are over the trajectories (one per sampled episode, the group size
    unchanged); a segment row carries its episode's advantage, so every context the agent's model sampled in is
    trained toward the episode's outcome, like one trajectory would be. Its tokens count in the loss's aggregation
    like any row's."""
    from agent.rollout import TrainingSegment

    rows: list[Any] = []
    episode: list[int] = []
    for i, t in enumerate(trajectories):
        rows.append(t)
        episode.append(i)
        for seg in getattr(t, "extra_segments", ()) or ():
            rows.append(seg)
            episode.append(i)
    while len(rows) < at_least:
        rows.append(TrainingSegment([pad_id]))
        episode.append(-1)
    return TrainingRows(rows, episode)


def rank_training_rows(trajectories: list[Trajectory], *, pad_id: int, cfg: Any, world_size: int) -> TrainingRows:
    """:func:`training_rows` of this rank; with an external agent (``rollout.agent``) in a sharded run, padded with
    filler rows to the most rows any rank has (its extra segments differ by rank)."""
    at_least = 0
    if cfg.rollout.agent and world_size > 1:
        from trainer import distributed as D

        own = len(training_rows(trajectories, pad_id=pad_id).rows)
        at_least = int(D.all_reduce_max(torch.tensor([own], dtype=torch.float64)).item())
    return training_rows(trajectories, pad_id=pad_id, at_least=at_least)


def session_counts(trajectories: list[Trajectory]) -> dict[str, float]:
    """External agents' recorded sessions (``rollout.agent``): ``rollout/sessions``, the sessions that split into
    several contexts (``rollout/session_splits``) and the contexts trained (``rollout/session_segments``)."""
    external = [t for t in trajectories if t.format == "external"]
    return {"rollout/sessions": float(len(external)),
            "rollout/session_splits": float(sum(bool(t.extra_segments) for t in external)),
            "rollout/session_segments": float(sum(1 + len(t.extra_segments) for t in external))}


def tool_sums(trajectories: list[Trajectory], rewards: torch.Tensor, names: list[str], *, builtin_search: bool) -> dict[str, float]:
    """``rollout.tools``: per offered tool ``name`` (every name, so that every rank adds the same sums), its calls,
    failures -- ``timeouts``, ``oversized`` outputs and other ``errors`` -- and the trajectories that called it with
    their reward sum, as ``tools/<name>/*`` sums (:func:`trainer.metrics.tool_metrics`). With ``builtin_search`` (``search``
    in ``rollout.tools``) the ``search`` tool is the built-in one: its calls are the searches and its failures the failed
    searches (a timeout when the retriever's error says so); otherwise every name is an MCP tool's."""
    from agent.tools import BUILTIN_SEARCH

    out: dict[str, float] = {}
    for name in names:
        calls = failures = timeouts = oversized = users = 0
        reward_sum = 0.0
        for t, r in zip(trajectories, rewards.tolist()):
            if builtin_search and name == BUILTIN_SEARCH:
                n, reasons = t.num_searches, list(t.search_errors)
                reasons = ["timeout" if "timeout" in e.lower() or "timed out" in e.lower() else "error" for e in reasons]
            else:
                n = t.tool_calls.get(name, 0)
                reasons = [e[len(name) + 2:] for e in t.tool_errors if e.startswith(f"{name}: ")]
            calls += n
            failures += len(reasons)
            timeouts += reasons.count("timeout")
            oversized += reasons.count("oversized")
            if n:
                users += 1
                reward_sum += r
        p = f"tools/{name}/"
        out.update({p + "calls": calls, p + "failures": failures, p + "timeouts": timeouts, p + "oversized": oversized,
                    p + "errors": failures - timeouts - oversized, p + "trajectories": users, p + "reward_sum": reward_sum})
    return {k: float(v) for k, v in out.items()}


def batch_sums(sampled: SampledBatch, rows: TrainingRows, cfg: Any) -> dict[str, float]:
    """The step's sums beside the rollout's from its batch: external agents' sessions and the segments trained
    (``rollout.agent``), per-tool calls, failures and rewards (``rollout.tools``; every offered tool's name, the rollout's
    toolbox opened once per process) -- the same names on every rank."""
    out: dict[str, float] = {}
    if cfg.rollout.agent:
        out.update(session_counts(sampled.trajectories))
        out["rollout/extra_rows"] = float(rows.extra)
    if cfg.rollout.tools:
        from agent.tools import toolbox_for

        out.update(tool_sums(sampled.trajectories, sampled.rewards, toolbox_for(cfg.rollout).names(),
                             builtin_search="search" in cfg.rollout.tools))
    return out


def produce(engine: Any, tokenizer: Any, prompts: list[SampledPrompt], retriever: Any, cfg: Any, *, seed: int,
            warn: Callable[[str], None]) -> SampledBatch:
    """Generate on ``engine`` with ``seed`` (retried ``run.rollout_retries`` times on failure, ``warn`` told: weights
    and prompts unchanged, the seed moved on) and grade (``reward.shuffle_control``: the random-reward control,
    rewards unrelated to the answers at the same rate)."""
    last: Exception | None = None
    for attempt in range(cfg.run.rollout_retries + 1):
        try:
            trajectories, stats = generate(engine, tokenizer, prompts, retriever, cfg, seed=seed + attempt)
            break
        except Exception as e:  # a crashed rollout batch is retried
            last = e
            warn(f"rollout attempt {attempt + 1} failed: {type(e).__name__}: {e}")
    else:
        from trainer.errors import TrainingError

        raise TrainingError(f"rollout failed {cfg.run.rollout_retries + 1} times; last error: {last}") from last
    outcomes = grade(trajectories, prompts, cfg)
    if cfg.reward.shuffle_control:
        outcomes = shuffled_outcomes(outcomes, seed)
    return SampledBatch(prompts, trajectories, outcomes, reward_counts(trajectories, outcomes, cfg), stats)


def grade(trajectories: list[Trajectory], prompts: list[SampledPrompt], cfg: Any) -> list[Outcome]:
    """Every trajectory's outcome against its prompt's gold answers (errored trajectories score 0), by the task
    (:meth:`tasks.task.Task.grade`) or the user's ``rollout.agent_reward``.

    Only what the model generated is graded (``Trajectory.scored_text``: its turns, or its final plain answer
    in the tool-call format), never observation text.
    """
    n = cfg.rollout.n_samples
    if getattr(cfg.rollout, "agent_reward", None):  # the user's reward function (agent/external.py)
        from agent.external import user_rewards

        answers = [t.final_answer if t.stop_reason != "error" else None for t in trajectories]
        rewards = user_rewards(cfg.rollout.agent_reward, [prompts[i // n].example for i in range(len(trajectories))], answers)
        return [Outcome(float(r), a) for r, a in zip(rewards, answers)]
    golds = [prompts[i // n].example.answers for i in range(len(trajectories))]
    texts = [t.scored_text if t.stop_reason != "error" else "" for t in trajectories]
    r = cfg.reward
    grading = Grading(r.math_grader, r.math_timeout, r.math_workers, qa_answer=getattr(r, "qa_answer", "search_r1"))
    outcomes = get_task(cfg.rollout.task).grade(texts, golds, grading)
    if cfg.rollout.task == "search" and (getattr(r, "qa_reward", "em") != "em" or getattr(r, "no_answer_penalty", 0.0)):
        outcomes = shaped_qa_outcomes(outcomes, golds, r.qa_reward, r.no_answer_penalty)
    return outcomes


def shaped_qa_outcomes(outcomes: list[Outcome], golds: list[list[str]], qa_reward: str, no_answer_penalty: float) -> list[Outcome]:
    """``reward.qa_reward`` and ``reward.no_answer_penalty``: each QA outcome's reward (its exact match) replaced by
    the token F1 of its answer (``f1``) or the mean of EM and F1 (``em_f1``), minus the penalty when it gave no answer."""
    from tasks.qa import token_f1

    out = []
    for o, g in zip(outcomes, golds):
        f1 = token_f1(o.answer, g)
        reward = {"em": o.reward, "f1": f1, "em_f1": (o.reward + f1) / 2}[qa_reward]
        if o.answer is None:
            reward -= no_answer_penalty
        out.append(replace(o, reward=reward))
    return out


def shuffled_outcomes(outcomes: list[Outcome], seed: int) -> list[Outcome]:
    """``reward.shuffle_control``: the outcomes with their rewards permuted across the batch (seeded): the same
    rewards at the same rate, each on another trajectory (answers and reasons stay with their own)."""
    import numpy as np

    order = np.random.default_rng([seed, 0x5EED]).permutation(len(outcomes))
    return [replace(o, reward=outcomes[int(j)].reward) for o, j in zip(outcomes, order)]


def reward_counts(trajectories: list[Trajectory], outcomes: list[Outcome], cfg: Any) -> dict[str, float]:
    """The ``reward/*`` counts of graded trajectories: the task's (math: timeouts, errors, no answer; none
    under ``rollout.agent_reward``) and the rollouts that failed."""
    counts = {} if getattr(cfg.rollout, "agent_reward", None) else get_task(cfg.rollout.task).counts(outcomes)
    return dict(counts, rollout_errors=float(sum(t.stop_reason == "error" for t in trajectories)))


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
