"""Warm-start trajectories for ``emapg sft``: constructed from QA training pairs, or read from a file.

Both paths produce :class:`agent.rollout.Trajectory` objects assembled by the rollout loop
itself (:func:`agent.teacher_forcing.replay_trajectories`), so prompt, chat template, observation
formatting and budgets are exactly those of an RL rollout with the same ``rollout`` config.

**Constructed** (``data.source=construct``): for each training question the teacher's script
is one search with the question as the query, then the answer::

    <search> {question} </search>   -> the live retriever's passages ->   <answer> {gold} </answer>

A trajectory is kept only when the passages the model is shown (the observation tokens, after
truncation) contain a gold answer (token-bounded, SQuAD-normalised: ``tasks.qa.retrieval_recall``);
the answer written is the first gold alias that appears there. Questions whose normalised text is in
the held-out split of a bundled QA set are dropped first (:func:`tasks.heldout.heldout_questions`), so warm
start never sees a question the held-out evaluations use.

**File** (``data.source=file``): jsonl rows ``{"question", "turns": [model turn, ...]}`` (the
observations come from the configured retriever) or ``{"question", "response": "<search> q
</search>\\n\\n<information>Doc 1(Title: ...) ...</information>\\n\\n<answer> a </answer>"}``
(Search-R1 text: the recorded passages are replayed exactly, no retriever needed).
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent.formats import ToolCallFormat
from agent.teacher_forcing import ReplayError, ReplayRetriever, ScriptedTrajectory, parse_passages, replay_trajectories
from agent.rollout import RolloutConfig, Trajectory
from emapg.config import ConfigError
from tasks.contamination import TrainedQuestions
from tasks.datasets import DatasetError, Example, load_dataset
from tasks.heldout import heldout_questions, question_key
from tasks.qa import retrieval_recall


@dataclass
class ConstructionReport:
    """How many questions each filter removed, per dataset, and how many trajectories were kept."""

    questions: dict[str, int] = field(default_factory=dict)
    eval_overlap: dict[str, int] = field(default_factory=dict)  # dropped: the question is in an eval set
    duplicates: dict[str, int] = field(default_factory=dict)  # dropped: seen earlier (same normalised text)
    errors: dict[str, int] = field(default_factory=dict)  # the loop could not follow the script
    answer_not_retrieved: dict[str, int] = field(default_factory=dict)  # dropped: no gold in the passages
    kept: dict[str, int] = field(default_factory=dict)

    @property
    def total_kept(self) -> int:
        return sum(self.kept.values())

    @property
    def total_constructed(self) -> int:
        """Trajectories that were built (went through the retriever), kept or not."""
        return self.total_kept + sum(self.answer_not_retrieved.values()) + sum(self.errors.values())

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_kept": self.total_kept, "total_constructed": self.total_constructed}


def observed_text(tokenizer, t: Trajectory) -> str:
    """The retrieved passages exactly as the model saw them (observation tokens, after truncation)."""
    return "\n".join(tokenizer.decode(ids, skip_special_tokens=True) for ids in t.span_ids("observation", "information"))


def _gold_in(text: str, answers: list[str]) -> str | None:
    return next((a for a in answers if retrieval_recall([text], [a])), None)


def _script(ex: Example, answer: str, fmt: ToolCallFormat | None = None) -> ScriptedTrajectory:
    """Search the question, then answer: in Search-R1 tags, or (``fmt``, rollout.format=tool_calls) as a search
    tool call and a plain-text answer, each turn ended by the model's end-of-turn token."""
    question = ex.question.strip()
    if fmt is not None:
        return ScriptedTrajectory(question, fmt.script_turns(question, answer), ex.id)
    return ScriptedTrajectory(question, [f"<search> {question} </search>", f"<answer> {answer} </answer>"], ex.id)


def construct_trajectories(
    examples: dict[str, list[Example]], tokenizer, retriever, rollout: RolloutConfig, *, max_model_len: int,
    exclude: dict[str, str] | None = None,
) -> tuple[list[tuple[Trajectory, Example]], ConstructionReport]:
    """Trajectories for the training ``examples`` (per dataset) whose passages contain the answer.

    ``exclude``: normalised questions to leave out (default: every question of a held-out split).
    Each kept trajectory is returned with its example; the report counts every drop.
    """
    exclude = heldout_questions() if exclude is None else exclude
    report = ConstructionReport()
    seen: set[str] = set()
    chosen: list[tuple[str, Example]] = []
    for name, exs in examples.items():
        report.questions[name] = len(exs)
        for kind in ("eval_overlap", "duplicates", "errors", "answer_not_retrieved", "kept"):
            getattr(report, kind)[name] = 0
        for ex in exs:
            key = question_key(ex.question)
            if key in exclude:
                report.eval_overlap[name] += 1
            elif key in seen or not key:
                report.duplicates[name] += 1
            else:
                seen.add(key)
                chosen.append((name, ex))
    # First pass answers with the first gold alias; rows whose passages show another alias are
    # replayed once more with that one (the retriever is deterministic, so the passages are the same).
    fmt = ToolCallFormat(tokenizer, rollout) if rollout.format == "tool_calls" else None
    first = replay_trajectories(tokenizer, [_script(ex, ex.answers[0], fmt) for _, ex in chosen], retriever, rollout,
                                max_model_len=max_model_len)
    kept: dict[int, Trajectory] = {}
    again: list[tuple[int, str]] = []
    for i, ((name, ex), t) in enumerate(zip(chosen, first)):
        if t.stop_reason != "answer" or t.search_failures:
            report.errors[name] += 1
            continue
        gold = _gold_in(observed_text(tokenizer, t), ex.answers)
        if gold is None:
            report.answer_not_retrieved[name] += 1
        elif gold == ex.answers[0]:
            kept[i] = t
        else:
            again.append((i, gold))
    if again:
        second = replay_trajectories(tokenizer, [_script(chosen[i][1], gold, fmt) for i, gold in again], retriever, rollout,
                                     max_model_len=max_model_len)
        for (i, _), t in zip(again, second):
            if t.stop_reason == "answer" and not t.search_failures:
                kept[i] = t
            else:
                report.errors[chosen[i][0]] += 1
    out = []
    for i in sorted(kept):
        report.kept[chosen[i][0]] += 1
        out.append((kept[i], chosen[i][1]))
    return out, report


def training_examples(datasets: list[str], *, limit: int | None, seed: int) -> dict[str, list[Example]]:
    """The bundled *train* split of each dataset (``data.datasets``); a name without one is a ConfigError."""
    out = {}
    for name in datasets:
        try:
            out[name] = load_dataset(name, split="train", limit=limit, seed=seed)
        except DatasetError as e:
            raise ConfigError(f"data.datasets: {e}") from None
    return out


_INFO_RE = re.compile(r"\s*<information>(.*?)</information>\s*", re.DOTALL)


def _file_row(row: Any, where: str) -> tuple[ScriptedTrajectory, list[list[dict]] | None]:
    """One jsonl row -> its script and, for Search-R1 text, the recorded search results."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
    question = row.get("question", row.get("prompt"))
    if not isinstance(question, str) or not question.strip():
        raise ConfigError(f"{where}: needs a non-empty string 'question'")
    ex_id = str(row["id"]) if row.get("id") is not None else None
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(x, str) and x.strip() for x in turns):
            raise ConfigError(f"{where}: 'turns' must be a non-empty list of model turn texts")
        return ScriptedTrajectory(question, [x.strip() for x in turns], ex_id), None
    response = row.get("response")
    if not isinstance(response, str) or not response.strip():
        raise ConfigError(f"{where}: needs 'turns' (a list of model turns) or 'response' (Search-R1 text)")
    parts = _INFO_RE.split(response.strip())
    turns, bodies = parts[0::2], parts[1::2]
    try:
        results = [parse_passages(b) for b in bodies]
    except ReplayError as e:
        raise ConfigError(f"{where}: {e}") from None
    if any(not x.strip() for x in turns):
        raise ConfigError(f"{where}: an <information> block must follow a model turn and be followed by one")
    return ScriptedTrajectory(question, [x.strip() for x in turns], ex_id), results


@dataclass
class FileRow:
    where: str  # "data.path: <file>:<line>", for errors
    script: ScriptedTrajectory
    recorded: list[list[dict]] | None  # Search-R1 text: the passages of each search, replayed; None: ask the retriever


def read_trajectory_file(path: str | Path) -> list[FileRow]:
    """Parse and check every row of a trajectories jsonl (no model needed: ``emapg sft`` calls this first)."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"data.path: cannot read {path}: {e}") from None
    rows = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"data.path: {path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg})") from None
        rows.append(FileRow(where, *_file_row(row, where)))
    if not rows:
        raise ConfigError(f"data.path: {path} holds no trajectories")
    return rows


def file_trajectories(
    path: str | Path, tokenizer, retriever, rollout: RolloutConfig, *, max_model_len: int,
    exclude: dict[str, str] | None = None,
) -> tuple[list[Trajectory], dict[str, int]]:
    """Trajectories of a user's jsonl file; returns them and counts (rows, eval_overlap, kept).

    ``exclude``: normalised questions to drop (evaluation questions); None keeps every row.
    A row the rollout loop cannot follow (a turn past a stop string, more searches than recorded
    results) is an error naming the file and line: the file is the user's, so nothing is skipped silently.
    """
    rows = read_trajectory_file(path)
    if rollout.format == "tool_calls":
        rows = [_tool_call_row(r, tokenizer) for r in rows]
    counts = Counter(rows=len(rows), eval_overlap=0, kept=0)
    if exclude is not None:
        counts["eval_overlap"] = sum(question_key(r.script.question) in exclude for r in rows)
        rows = [r for r in rows if question_key(r.script.question) not in exclude]
    plain = [r for r in rows if r.recorded is None]
    if plain and retriever is None:
        raise ConfigError(f"{plain[0].where}: a row with 'turns' needs a retriever (retriever.urls or retriever.index_dir)")
    out: list[tuple[str, Trajectory]] = []
    if plain:
        try:
            trajs = replay_trajectories(tokenizer, [r.script for r in plain], retriever, rollout, max_model_len=max_model_len)
        except ReplayError as e:
            raise ConfigError(f"data.path: {path}: {e}") from None
        out += [(r.where, t) for r, t in zip(plain, trajs)]
    for r in rows:  # one at a time: each replays its own recorded passages
        if r.recorded is not None:
            t = replay_trajectories(tokenizer, [r.script], ReplayRetriever(r.recorded), rollout, max_model_len=max_model_len)[0]
            out.append((r.where, t))
    for where, t in out:
        if t.stop_reason == "error" or t.search_failures:
            raise ConfigError(f"{where}: the rollout loop could not follow this trajectory: {t.error or t.search_errors}")
    counts["kept"] = len(out)
    return [t for _, t in out], dict(counts)


def _tool_call_row(row: FileRow, tokenizer) -> FileRow:
    """rollout.format=tool_calls: a row's turns are the model's own text (tool calls in its syntax, a plain answer);
    each ends with the end-of-turn token, added where the file leaves it out (the model must learn to end its turns)."""
    if row.recorded is not None:
        raise ConfigError(f"{row.where}: a Search-R1 'response' row is in the tags format; with rollout.format=tool_calls "
                          "give 'turns' (the model's turns, tool calls in its own syntax)")
    eos = tokenizer.eos_token or ""
    turns = [t if t.endswith(eos) else t + eos for t in row.script.turns]
    return FileRow(row.where, ScriptedTrajectory(row.script.question, turns, row.script.id), None)


def split_heldout(items: list, fraction: float, seed: int) -> tuple[list, list]:
    """A seeded (train, held-out) split; the held-out part has at least one item."""
    if len(items) < 2:
        raise ConfigError(f"emapg sft needs at least 2 trajectories (one held out), got {len(items)}")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_held = min(len(items) - 1, max(1, round(fraction * len(items))))
    held = set(order[:n_held])
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


def trajectory_record(t: Trajectory, example: Example | None = None) -> dict[str, Any]:
    """One line of ``trajectories.jsonl``: what was trained on, ids and mask included."""
    rec = {"id": t.example_id, "question": t.question, "prompt_ids": t.prompt_ids, "response_ids": t.response_ids,
           "loss_mask": t.loss_mask, "queries": t.queries, "retrieved_ids": t.retrieved_ids,
           "model_text": t.model_text, "response_text": t.response_text}
    if example is not None:
        rec["golden_answers"] = example.answers
        rec["data_source"] = example.data_source
    return rec


def trained_questions(train: list[tuple[Trajectory, Example | None]], heldout: list[tuple[Trajectory, Example | None]],
                      *, file_source: str) -> TrainedQuestions:
    """The contamination record of an SFT run's (trajectory, example) pairs, by source: the example's dataset
    (constructed data) or ``file_source`` (a trajectories file); the held-out-loss part is listed too, apart."""
    by_source: dict[str, list[str]] = {}
    for part, pairs in (("", train), (" (held-out loss only)", heldout)):
        for t, ex in pairs:
            by_source.setdefault(f"{ex.data_source if ex is not None else file_source}{part}", []).append(t.question)
    return TrainedQuestions.from_questions(by_source)
