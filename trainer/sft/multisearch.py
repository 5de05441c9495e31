"""Multi-search demonstrations: trajectories that search again when the first passages lack the answer.

From a question's coverage (:mod:`tasks.coverage`: the first search's class and the second query a model could
write from what it was shown), the teacher's script is::

    <search> {question} </search>  -> passages ->  <answer> {gold} </answer>                           (first_search)
    <search> {question} </search>  -> passages ->  <search> {second query} </search>  -> passages ->
    <answer> {gold} </answer>                                                                           (second_search)

Every script is replayed through the rollout loop itself (:func:`agent.teacher_forcing.replay_trajectories`) against
the live retriever, so its tokens are exactly a rollout's, and it is kept only when (:func:`verdict`) the loop
answered after that many searches, the last passages *as shown* (observation tokens decoded, after truncation) hold a
gold (:func:`tasks.qa.gold_shown`) and, for two searches, the first did not. ``emapg sft`` (``data.source=file``)
replays the kept rows (``{"question", "turns"}``) once more through the same loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from agent.rollout import RolloutConfig, Trajectory
from agent.teacher_forcing import ScriptedTrajectory, replay_trajectories
from tasks.heldout import question_key
from tasks.qa import gold_shown


@dataclass(frozen=True)
class Demo:
    """One candidate demonstration: its question, the turns to replay and what it must show."""

    id: str
    question: str
    turns: list[str]
    answers: list[str]
    kind: str  # a mix bucket, e.g. "two", "one_multihop", "one_pool"
    type: str  # the question's type, for the record's searches-per-question table

    @property
    def searches(self) -> int:
        return sum(t.startswith("<search>") for t in self.turns)

    def to_row(self, searches: int) -> dict:
        return {"id": self.id, "question": self.question, "turns": self.turns, "golden_answers": self.answers,
                "kind": self.kind, "type": self.type, "searches": searches}


def script(question: str, answer: str, second_query: str | None = None) -> list[str]:
    """The turns: search the question (and, given, the second query), then answer."""
    turns = [f"<search> {question.strip()} </search>"]
    if second_query is not None:
        turns.append(f"<search> {second_query.strip()} </search>")
    return [*turns, f"<answer> {answer.strip()} </answer>"]


def shown_texts(tokenizer, t: Trajectory) -> list[str]:
    """Each search's passages as the model saw them (observation tokens decoded, after truncation)."""
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in t.span_ids("observation", "information")]


def verdict(tokenizer, t: Trajectory, demo: Demo) -> str:
    """'' when the replayed trajectory is a valid demonstration, else why not."""
    if t.stop_reason != "answer" or t.search_failures:
        return f"loop stopped: {t.stop_reason}"
    if t.num_searches != demo.searches:
        return "searches differ"
    shown = shown_texts(tokenizer, t)
    written = demo.turns[-1].removeprefix("<answer>").removesuffix("</answer>").strip()
    if gold_shown(shown[-1:], [written], demo.question) is None:  # the answer written is the gold the passages show
        return "gold not in the passages shown (after truncation)"
    if demo.searches == 2 and gold_shown(shown[:1], demo.answers, demo.question) is not None:
        return "first passages shown already hold the gold"
    return ""


def build_demonstrations(candidates: Sequence[Demo], want: dict[str, int], tokenizer, retriever, rollout: RolloutConfig,
                         *, max_model_len: int) -> tuple[list[tuple[Demo, Trajectory]], dict[str, int]]:
    """Replay the ``candidates`` (in order; one per question) and keep the first ``want[kind]`` valid ones per kind.

    Returns the kept (demo, trajectory) pairs and the counts of every drop (``"<kind>: <why>"``).
    """
    seen, uniq = set(), []
    for d in candidates:
        key = question_key(d.question)
        if key and key not in seen:
            seen.add(key)
            uniq.append(d)
    trajs = replay_trajectories(tokenizer, [ScriptedTrajectory(d.question, d.turns, d.id) for d in uniq], retriever,
                                rollout, max_model_len=max_model_len)
    kept, dropped, got = [], Counter(), Counter()
    for d, t in zip(uniq, trajs):
        why = verdict(tokenizer, t, d)
        if why:
            dropped[f"{d.kind}: {why}"] += 1
        elif got[d.kind] < want.get(d.kind, 0):
            got[d.kind] += 1
            kept.append((d, t))
    return kept, dict(dropped)


def searches_by_type(rows: Sequence[dict]) -> dict[str, dict]:
    """Per question type: trajectories, the distribution of searches and their mean (rows: ``type``, ``searches``)."""
    out: dict[str, Counter] = {}
    for r in rows:
        out.setdefault(r["type"], Counter())[r["searches"]] += 1
    return {k: {"trajectories": sum(c.values()), "searches": {str(n): m for n, m in sorted(c.items())},
                "mean_searches": round(sum(n * m for n, m in c.items()) / sum(c.values()), 4)}
            for k, c in sorted(out.items())}
