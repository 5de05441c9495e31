"""Guidance for groups that are all wrong (``algorithm.guidance=gold_answer``): the model's own search with the gold
answer written in.

A group whose every trajectory scored 0 carries no policy gradient: GRPO cannot learn from a question the policy never
solves. Off-policy guidance (LUFFY, Yan et al. 2025, arXiv 2504.14945) puts one correct trajectory into such a group.
Ours is the closest correct trajectory the policy could have sampled: its own turns (the same searches, so the same
passages from the same retriever) with the last turn replaced by ``<answer>GOLD</answer>`` -- replayed through the real
rollout loop (:func:`agent.teacher_forcing.replay_trajectories`), so its token ids, loss mask and observations are
exactly what a rollout of that text would be. It replaces the group's last trajectory and is graded like any other
(reward 1 under exact match), so the group's advantages differ.

How it is weighted: training is on-policy (π_old is the policy itself), so the guided tokens' ratio is 1 and their
gradient is the group advantage times the gradient of their log-probability -- an advantage-weighted supervised term
on the gold trajectory, which is LUFFY's off-policy term without its policy-shaping function. Its sampling
log-probabilities are not the policy's (no engine sampled it), so guidance requires ``algorithm.behavior_correction
=none``. Only the tags format is supported (the tool-call format's final answer is a plain turn).

A trajectory is guided only if it searched (its evidence came from the policy's own query); a group with none that
did, or whose replay fails, is left as it is and counted.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from trainer.group_filter import informative_groups

if TYPE_CHECKING:
    from agent.rollout import Trajectory
    from trainer.sampled_batch import SampledBatch


def guided_turns(traj: "Trajectory", tokenizer: Any, gold: str, max_turns: int) -> list[str] | None:
    """The search turns of ``traj`` (at most ``max_turns - 1``, room for the answer) followed by
    ``<answer>gold</answer>``; None when it made no search (the turns would be the gold answer alone, with no
    evidence the policy fetched)."""
    searches = [tokenizer.decode(traj.response_ids[s.start:s.end], skip_special_tokens=True)
                for s in traj.spans if s.role == "model" and s.action == "search"]
    if not searches:
        return None
    return [*searches[: max_turns - 1], f"<answer>{gold}</answer>"]


def guide_all_wrong_groups(sampled: "SampledBatch", tokenizer: Any, retriever: Any, cfg: Any,
                           grade: Any) -> tuple["SampledBatch", dict[str, float]]:
    """``sampled`` with the last trajectory of every all-wrong group replaced by its guided trajectory (graded by
    ``grade(trajectories, prompts, cfg)``); returns the batch and the ``guidance/*`` counts."""
    from agent.rollout import RolloutConfig
    from agent.teacher_forcing import ScriptedTrajectory, replay_trajectories

    n = cfg.rollout.n_samples
    rewards = sampled.rewards.view(-1, n)
    all_wrong = [g for g, ok in enumerate(informative_groups(sampled.rewards, n).tolist()) if not ok and float(rewards[g].max()) <= 0]
    trajectories, outcomes = list(sampled.trajectories), list(sampled.outcomes)
    guided = unguidable = 0
    fields = {f: getattr(cfg.rollout, f) for f in RolloutConfig.__dataclass_fields__}
    replay_cfg = replace(RolloutConfig(**fields), n_samples=1)
    for g in all_wrong:
        prompt = sampled.prompts[g]
        source = next((t for t in sampled.trajectories[g * n:(g + 1) * n] if t.num_searches > 0 and t.stop_reason != "error"), None)
        turns = guided_turns(source, tokenizer, prompt.example.answers[0], cfg.rollout.max_turns) if source is not None else None
        if turns is None:
            unguidable += 1
            continue
        try:
            (traj,) = replay_trajectories(tokenizer, [ScriptedTrajectory(prompt.example.question, turns, prompt.example.id)],
                                          retriever, replay_cfg, max_model_len=cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens)
        except ValueError:  # a script no engine could have produced (e.g. a turn cut by the budget): leave the group
            unguidable += 1
            continue
        if traj.stop_reason == "error" or traj.prompt_ids != source.prompt_ids:
            unguidable += 1
            continue
        outcome = grade([traj] * n, [prompt], cfg)[0]  # graded as a member of its group (one prompt, n rows)
        last = (g + 1) * n - 1
        traj.group_id, traj.prompt_index, traj.sample_index = source.group_id, source.prompt_index, n - 1
        trajectories[last], outcomes[last] = traj, outcome
        guided += 1
    out = replace(sampled, trajectories=trajectories, outcomes=outcomes)
    return out, {"guidance/all_wrong_groups": float(len(all_wrong)), "guidance/guided_groups": float(guided),
                 "guidance/unguidable_groups": float(unguidable)}



class Guidance:
    """``algorithm.guidance`` as a batch shaper of the step (before the informative filter: a guided group is
    informative): every all-wrong group's last trajectory replaced by :func:`guide_all_wrong_groups`; the ``reward/*``
    counts recounted, ``guidance/*`` counted in the batch's ``sampling``. ``trainer``: the run (its ``tokenizer``,
    ``retriever`` and ``cfg``)."""

    def __call__(self, trainer: Any, sampled: "SampledBatch") -> "SampledBatch":
        from trainer.sampled_batch import grade, reward_counts

        out, counts = guide_all_wrong_groups(sampled, trainer.tokenizer, trainer.retriever, trainer.cfg, grade)
        return replace(out, reward_counts=reward_counts(out.trajectories, out.outcomes, trainer.cfg),
                       sampling={**out.sampling, **counts})
