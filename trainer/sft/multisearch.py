"""Multi-search demonstrations: trajectories that search again when the first passages lack the answer.

From a question's coverage (:mod:`tasks.coverage`: the first search's class and the second query a model could
write from what it was shown), the teacher's script is::

    <search> {question} </search>  -> passages ->  <answer> {gold} </answer>                           (first_search)
    <search> {question} </search>  -> passages ->  <search> {second query} </search>  -> passages ->
    <answer> {gold} </answer>                                                                           (second_search)

The need-conditioned form (:func:`with_think`, the third starter) puts a short think step before each decision that
names what a passage shows, so that the choice between answering and searching again follows the passages::

    ... passages ->  <think> Doc 2 names {gold}; it answers the question. </think>  <answer> {gold} </answer>
    ... passages ->  <think> Doc 1 names {bridge}; the answer is not shown. </think>  <search> {second query} </search>

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

import re

from agent.rollout import RolloutConfig, Trajectory
from agent.teacher_forcing import ScriptedTrajectory, replay_trajectories
from tasks.heldout import question_key
from tasks.multihop import entity_name
from tasks.qa import extract_answer, gold_shown, normalize_answer


def extract_tag(text: str, tag: str) -> str:
    """The content of the first ``<tag>...</tag>`` of a turn ('' if none)."""
    return text.partition(f"<{tag}>")[2].partition(f"</{tag}>")[0].strip()

#: The think steps of :func:`with_think` (the decision, "it answers" / "not shown", follows what a passage names).
THINK_ANSWERS = "<think> Doc {doc} names {entity}; it answers the question. </think>\n"
THINK_MISSING = "<think> Doc {doc} names {entity}; the answer is not shown. </think>\n"
THINK_NOTHING = "<think> The answer is not shown. </think>\n"
_DOC_RE = re.compile(r"(?:^|\n|<information>)Doc (\d+)\(Title: ")  # a block opens a line or the observation


@dataclass(frozen=True)
class Demo:
    """One candidate demonstration: its question, the turns to replay and what it must show."""

    id: str
    question: str
    turns: list[str]
    answers: list[str]
    kind: str  # a mix bucket, e.g. "two", "one_multihop", "one_pool"
    type: str  # the question's type, for the record's searches-per-question table
    gold_in_question: bool = False  # "A or B?" rows: the gold the passages show is one the question names
    bridges: tuple[str, ...] = ()  # two searches: candidates for the entity the second query is about, best first

    @property
    def searches(self) -> int:
        return sum("<search>" in t for t in self.turns)

    @property
    def written_answer(self) -> str:
        return (extract_answer(self.turns[-1]) or "").strip()

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
    asked = None if demo.gold_in_question else demo.question
    if gold_shown(shown[-1:], [demo.written_answer], asked) is None:  # the answer written is the gold the passages show
        return "gold not in the passages shown (after truncation)"
    if demo.searches == 2 and gold_shown(shown[:1], demo.answers, demo.question) is not None:
        return "first passages shown already hold the gold"
    return ""


def doc_naming(shown: str, text: str) -> int | None:
    """The number of the first ``Doc i(Title: ...)`` block of an observation as shown whose text names ``text``
    (SQuAD-normalised, token-bounded), or None."""
    want = f" {normalize_answer(text)} "
    if not want.strip():
        return None
    marks = list(_DOC_RE.finditer(shown))
    for n, m in enumerate(marks):
        block = shown[m.end():marks[n + 1].start() if n + 1 < len(marks) else len(shown)].replace("</information>", "")
        if want in f" {normalize_answer(block)} ":
            return int(m.group(1))
    return None


def shown_titles(shown: str) -> list[str]:
    """The titles of an observation's ``Doc i(Title: "T")`` blocks, quotes stripped."""
    return [shown[m.end():].partition(")")[0].strip().strip('"') for m in _DOC_RE.finditer(shown)]


def with_think(demo: Demo, shown: Sequence[str]) -> Demo | None:
    """The demonstration with a think step before each decision (:data:`THINK_ANSWERS`, :data:`THINK_MISSING`),
    written from the passages as shown (``shown``: each search's observation, as the replay decoded it).

    After the passages that hold the answer: the doc that names it, then "it answers the question", then the answer.
    After first passages that lack it (two searches): the doc that names the bridge entity, then "the answer is not
    shown", then the second query (:data:`THINK_NOTHING` when no doc names the bridge, e.g. only the question does).
    The bridge is the first of ``demo.bridges`` that a doc names and that the second query starts with, else one that
    is not a shown doc's title (the first hop, already shown; titles without their disambiguation), else the first
    that a doc names. None when no doc shown names the answer written.
    """
    answer = demo.written_answer
    doc = doc_naming(shown[-1], answer) if shown else None
    if doc is None:
        return None
    turns = list(demo.turns)
    turns[-1] = THINK_ANSWERS.format(doc=doc, entity=answer) + turns[-1]
    if demo.searches == 2:
        titles = {normalize_answer(entity_name(t)) for t in shown_titles(shown[0])}
        query = f" {normalize_answer(extract_tag(turns[1], 'search'))} "
        named = [(b, d) for b in demo.bridges if (d := doc_naming(shown[0], b)) is not None]
        # the entity the second query is about (it starts with it), else one that is not a first-hop title
        named.sort(key=lambda bd: (not query.startswith(f" {normalize_answer(bd[0])} "), normalize_answer(bd[0]) in titles))
        pick = named[0] if named else None
        turns[1] = (THINK_MISSING.format(doc=pick[1], entity=pick[0]) if pick else THINK_NOTHING) + turns[1]
    return Demo(demo.id, demo.question, turns, demo.answers, demo.kind, demo.type, demo.gold_in_question, demo.bridges)


def build_demonstrations(candidates: Sequence[Demo], want: dict[str, int], tokenizer, retriever, rollout: RolloutConfig,
                         *, max_model_len: int, think: bool = False) -> tuple[list[tuple[Demo, Trajectory]], dict[str, int]]:
    """Replay the ``candidates`` (in order; one per question) and keep the first ``want[kind]`` valid ones per kind.

    With ``think``, each valid one gets its think steps (:func:`with_think`, written from what the first replay
    showed) and is replayed again, to be kept only if it is still valid (e.g. a turn within the turn budget).
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
    valid = []
    for d, t in zip(uniq, trajs):
        why = verdict(tokenizer, t, d)
        if why:
            dropped[f"{d.kind}: {why}"] += 1
        elif not think:
            valid.append((d, t))
        elif (thought := with_think(d, shown_texts(tokenizer, t))) is None:
            dropped[f"{d.kind}: no doc shown names the answer written"] += 1
        else:
            valid.append((thought, None))
    if think and valid:
        again = replay_trajectories(tokenizer, [ScriptedTrajectory(d.question, d.turns, d.id) for d, _ in valid],
                                    retriever, rollout, max_model_len=max_model_len)
        checked = []
        for (d, _), t in zip(valid, again):
            why = verdict(tokenizer, t, d)
            if why:
                dropped[f"{d.kind}: with think steps, {why}"] += 1
            else:
                checked.append((d, t))
        valid = checked
    for d, t in valid:
        if got[d.kind] < want.get(d.kind, 0):
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
