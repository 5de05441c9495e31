"""Before vs after training on the same questions: per dataset and pooled, with a paired bootstrap interval.

Two QA runs of ``emapg eval`` over the same held-out questions (same datasets, same ``--limit`` and
``--data-seed``) are paired question by question from their ``items/<dataset>.jsonl``; each question
contributes its EM (mean over samples) and whether its first sample ended with an ``<answer>`` (the
format rate). *Pooled* numbers are over all questions of all datasets (each question weighs the same),
unlike the unweighted per-dataset ``average`` of ``results.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable, Mapping
from typing import Any

from eval.significance import paired_bootstrap


@dataclass(frozen=True)
class PairedItems:
    """One dataset's questions scored by both runs, in the same order."""

    ids: list[str]
    base: list[float]  # EM per question, in [0, 1]
    trained: list[float]
    base_answered: list[float]  # 1.0 where the first sample ended with an answer
    trained_answered: list[float]


def _items(run_dir: Path, dataset: str) -> dict[str, dict[str, Any]]:
    from eval.items import items_file, read_items

    records = read_items(Path(run_dir), dataset)
    if not records:
        raise ValueError(f"{items_file(Path(run_dir), dataset)}: no evaluated questions")
    return {r["id"]: r for r in records}


def _answered(record: dict[str, Any]) -> float:
    samples = record.get("samples") or [{}]
    return float(samples[0].get("stop_reason") == "answer")


def _trained_on(run_dir: Path, dataset: str) -> set[str]:
    """Ids of the questions a run scored apart as trained on (``results.json`` ``contamination``, eval.contamination)."""
    path = Path(run_dir) / "results.json"
    if not path.is_file():
        return set()
    return set(((json.loads(path.read_text()).get("contamination") or {}).get("excluded_ids") or {}).get(dataset, []))


#: What :func:`paired_items` can pair per question: a score of the record (``em``, ``f1``, ...: with n samples per
#: question, the mean over them -- mean@n), or ``pass``: 1.0 when any of the question's samples is an exact match
#: (pass@n).
PASS = "pass"


def question_score(record: dict[str, Any], metric: str) -> float:
    """One question's ``metric`` (:data:`PASS` or a key of its ``scores``) from its ``items/*.jsonl`` record."""
    if metric == PASS:
        samples = record.get("samples") or [record]
        return float(any(float((s.get("scores") or {}).get("em", 0.0)) >= 1.0 for s in samples))
    return float(record["scores"][metric])


def paired_items(base_dir: str | Path, trained_dir: str | Path, datasets: list[str], metric: str = "em",
                 only: Mapping[str, Iterable[str]] | None = None) -> dict[str, PairedItems]:
    """Per dataset, the questions both runs scored; they must be the same questions. Questions either run scored
    apart as trained on (``--score-trained-apart``) are left out of both. ``only``: per dataset, the question ids to
    keep (a slice such as the reader slice, :mod:`tasks.reader_slice`); a dataset it names no question of is left
    out, and an id it names that the runs did not score is an error."""
    out = {}
    for ds in datasets:
        a, b = _items(Path(base_dir), ds), _items(Path(trained_dir), ds)
        if set(a) != set(b):
            raise ValueError(f"{ds}: the two runs scored different questions ({len(set(a) ^ set(b))} not in both); "
                             "evaluate both on the same --limit and --data-seed")
        ids = sorted(set(a) - _trained_on(Path(base_dir), ds) - _trained_on(Path(trained_dir), ds))
        if only is not None:
            wanted = set(only.get(ds, ()))
            missing = wanted - set(a)
            if missing:
                raise ValueError(f"{ds}: {len(missing)} question(s) of the slice were not evaluated, e.g. {sorted(missing)[:3]}")
            ids = [i for i in ids if i in wanted]
            if not ids:
                continue
        if not ids:
            raise ValueError(f"{ds}: every question was trained on by one of the runs; nothing unseen to compare")
        out[ds] = PairedItems(ids, [question_score(a[i], metric) for i in ids], [question_score(b[i], metric) for i in ids],
                              [_answered(a[i]) for i in ids], [_answered(b[i]) for i in ids])
    if not out:
        raise ValueError("no question of the slice was evaluated by both runs")
    return out


def evaluated_datasets(run_dir: str | Path) -> list[str]:
    """The datasets an evaluation scored, in its ``results.json`` order (the suite's); what every comparison of two
    runs pools in, so that the same two runs always give the same pooled interval (the bootstrap resamples the
    pooled questions in this order)."""
    from eval.items import ITEMS_DIR

    path = Path(run_dir) / "results.json"
    if path.is_file():
        names = list((json.loads(path.read_text()).get("datasets") or {}))
        if names:
            return names
    return sorted(p.stem for p in (Path(run_dir) / ITEMS_DIR).glob("*.jsonl"))


def sampling_protocol(run_dir: str | Path) -> str:
    """How an evaluation answered each question, and of which recorded slice, in words: ``greedy``, or ``sampled
    mean@n (T=..., top_p=...)``, followed by ``, search slice`` (or ``reader``) for a run restricted to a recorded
    slice (``emapg eval --slice``); from its ``results.json`` (``run.json``'s fingerprint while it runs). Two
    evaluations compare like for like only under the same one: the demo's greedy run of its 105 held-out questions and
    its greedy run of search-slice questions answer alike but not the same questions."""
    results, run = Path(run_dir) / "results.json", Path(run_dir) / "run.json"
    if results.is_file():
        record = json.loads(results.read_text())
    elif run.is_file():
        record = json.loads(run.read_text())["fingerprint"]
    else:
        raise ValueError(f"{run_dir}: neither results.json nor run.json says how it sampled")
    p = record["protocol"]
    where = f", {record['slice']} slice" if record.get("slice") not in (None, "none") else ""
    if float(p["temperature"]) == 0 and int(p["n"]) == 1:
        return "greedy" + where
    return f"sampled mean@{int(p['n'])} (T={float(p['temperature']):g}, top_p={float(p['top_p']):g})" + where


def _percent_difference(a: list[float], b: list[float], seed: int, resamples: int) -> dict[str, float | int]:
    d = paired_bootstrap(a, b, seed=seed, resamples=resamples)
    return {"mean": 100 * d.mean, "low": 100 * d.low, "high": 100 * d.high, "n": d.n, "confidence": d.confidence,
            "resamples": d.resamples, "method": "paired bootstrap over questions, percentile interval"}


def _mean_pct(values: list[float]) -> float:
    return 100 * sum(values) / len(values)


def compare_learning(base_dir: str | Path, trained_dir: str | Path, datasets: list[str], *, metric: str = "em",
                     seed: int = 0, resamples: int = 10_000, only: Mapping[str, Iterable[str]] | None = None) -> dict[str, Any]:
    """Base vs trained, in percent: per dataset and pooled over all questions, each with the paired
    bootstrap interval of the difference, and the format rate (questions answered in ``<answer>``).
    ``metric``: a per-question score (:func:`question_score`); ``only``: a slice of the questions (:func:`paired_items`)."""
    pairs = paired_items(base_dir, trained_dir, datasets, metric, only)

    def block(p_base: list[float], p_trained: list[float], f_base: list[float], f_trained: list[float]) -> dict[str, Any]:
        return {"n": len(p_base), "base": _mean_pct(p_base), "trained": _mean_pct(p_trained),
                "difference": _percent_difference(p_base, p_trained, seed, resamples),
                "format_rate": {"base": _mean_pct(f_base), "trained": _mean_pct(f_trained)}}

    per_ds = {ds: block(p.base, p.trained, p.base_answered, p.trained_answered) for ds, p in pairs.items()}
    pooled = block(*([x for p in pairs.values() for x in getattr(p, f)]
                     for f in ("base", "trained", "base_answered", "trained_answered")))
    return {"metric": metric, "datasets": per_ds, "pooled": pooled}


#: The sampled metrics :func:`compare_sampled` reports: per-question mean@n EM and token F1, and pass@n.
SAMPLED_METRICS = {"mean_em": "em", "mean_f1": "f1", "pass": PASS}


def compare_sampled(base_dir: str | Path, trained_dir: str | Path, datasets: list[str], *, seed: int = 0,
                    resamples: int = 10_000, only: Mapping[str, Iterable[str]] | None = None) -> dict[str, Any]:
    """Two evaluations with n samples per question at the training temperature (``emapg eval --n K --temperature T``),
    paired by question: ``mean_em`` (mean@n exact match: each question's mean over its samples), ``mean_f1`` (mean@n
    token F1) and ``pass`` (pass@n: an exact match among the n samples), each a :func:`compare_learning` block
    (per dataset and pooled, with the paired bootstrap interval of the difference); ``samples`` per question."""
    out: dict[str, Any] = {name: compare_learning(base_dir, trained_dir, datasets, metric=metric, seed=seed,
                                                  resamples=resamples, only=only) for name, metric in SAMPLED_METRICS.items()}
    out["samples"] = {"base": samples_per_question(base_dir, datasets), "trained": samples_per_question(trained_dir, datasets)}
    return out


def samples_per_question(run_dir: str | Path, datasets: list[str]) -> int:
    """The number of samples each question of an evaluation has (they must all have the same)."""
    counts = {len(r.get("samples") or [r]) for ds in datasets for r in _items(Path(run_dir), ds).values()}
    if len(counts) != 1:
        raise ValueError(f"{run_dir}: questions with different numbers of samples: {sorted(counts)}")
    return counts.pop()


def percent_text(value: float) -> str:
    """A score in percent as every report prints it (one decimal)."""
    return f"{value:.1f}"


def difference_text(d: dict[str, float]) -> str:
    """A difference with its interval as every report prints it: ``+1.9 [-3.7, +7.4]`` (pp)."""
    return f"{d['mean']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}]"


def learning_table(comparison: dict[str, Any], labels: tuple[str, str] = ("starter", "trained")) -> str:
    """Markdown: datasets × (n, base, trained, difference with its interval, format rates), pooled last."""
    m = comparison["metric"]
    level = round(100 * comparison["pooled"]["difference"]["confidence"])
    head = (f"| dataset | n | {labels[0]} {m} (%) | {labels[1]} {m} (%) | difference (pp, {level}% CI) "
            f"| answered {labels[0]} / {labels[1]} (%) |")
    rows = [head, "|---|---:|---:|---:|---:|---:|"]

    def row(name: str, b: dict[str, Any], bold: bool = False) -> str:
        d, f = b["difference"], b["format_rate"]
        cells = [str(b["n"]), percent_text(b["base"]), percent_text(b["trained"]), difference_text(d),
                 f"{f['base']:.0f} / {f['trained']:.0f}"]
        if bold:
            name, cells = f"**{name}**", [f"**{c}**" for c in cells]
        return f"| {name} | " + " | ".join(cells) + " |"

    rows += [row(ds, b) for ds, b in comparison["datasets"].items()]
    rows.append(row("pooled", comparison["pooled"], bold=True))
    return "\n".join(rows)


def verdict(difference: dict[str, float]) -> str:
    """One sentence on whether the interval excludes zero."""
    lo, hi = difference["low"], difference["high"]
    level = round(100 * difference["confidence"])
    if lo > 0:
        return f"the {level}% interval lies above zero: training improved the pooled score beyond noise"
    if hi < 0:
        return f"the {level}% interval lies below zero: training made the pooled score worse beyond noise"
    return f"the {level}% interval contains zero: the difference cannot be told from noise at this sample size"


@dataclass(frozen=True)
class MissBreakdown:
    """Where one QA evaluation's answers stand (each question's first sample: the greedy answer), pooled over
    datasets: right; wrong although a gold answer was in the passages the model was shown (``retrieval_recall``:
    what better reading could fix); wrong without it (the evidence never reached the model: another query or
    another hop was needed); and how many searches the model made per question."""

    questions: int
    right: int
    wrong_shown: int
    wrong_not_shown: int
    searches: dict[int, int]  # searches made -> questions

    def lines(self, label: str) -> list[str]:
        """Markdown bullets for a report."""
        pct = lambda k: 100 * k / self.questions  # noqa: E731
        searched = ", ".join(f"{n} search{'es' if n != 1 else ''}: {k}" for n, k in sorted(self.searches.items()))
        return [f"- {label}: {self.right} right ({pct(self.right):.1f}%), **{self.wrong_shown} wrong although a gold answer "
                f"was in the passages shown** ({pct(self.wrong_shown):.1f}%), {self.wrong_not_shown} wrong without it "
                f"({pct(self.wrong_not_shown):.1f}%), of {self.questions}; searches per question: {searched}"]


def _greedy_sample(record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A question record's first sample (its greedy answer) and that sample's scores (a record without
    ``samples`` is its own single sample)."""
    sample = (record.get("samples") or [record])[0]
    return sample, sample.get("scores") or record["scores"]


def miss_breakdown(run_dir: str | Path, datasets: list[str]) -> MissBreakdown:
    """The :class:`MissBreakdown` of one ``emapg eval`` run of the QA suite (its ``items/<dataset>.jsonl``)."""
    right = shown = not_shown = 0
    searches: dict[int, int] = {}
    for ds in datasets:
        for record in _items(Path(run_dir), ds).values():
            sample, scores = _greedy_sample(record)
            if scores["em"] >= 1.0:
                right += 1
            elif scores.get("retrieval_recall", 0.0) > 0:
                shown += 1
            else:
                not_shown += 1
            n = int(sample.get("searches", record.get("searches", 0)))
            searches[n] = searches.get(n, 0) + 1
    return MissBreakdown(right + shown + not_shown, right, shown, not_shown, dict(sorted(searches.items())))


#: The kinds of question :func:`question_kind` tells apart: a yes/no answer; an answer that is one of the options
#: the question itself names (comparison questions: "which film ..., A or B?", where choosing one of the two
#: named options scores half the time without reading anything); every other question.
QUESTION_KINDS = ("yes/no", "option in question", "open")


def question_kind(question: str, golds: list[str]) -> str:
    """One of :data:`QUESTION_KINDS` (SQuAD-normalised, whole-word containment of a gold answer in the question)."""
    from tasks.qa import normalize_answer

    answers = [normalize_answer(g) for g in golds]
    if any(a in ("yes", "no") for a in answers):
        return "yes/no"
    padded = f" {normalize_answer(question)} "
    return "option in question" if any(a and f" {a} " in padded for a in answers) else "open"


@dataclass(frozen=True)
class AnswerChanges:
    """How a trained model's greedy answers (each question's first sample) differ from the starter's on the same
    questions: how many changed at all, and the right/wrong transitions, pooled and per :func:`question_kind`.
    A pooled difference near zero can hide many changes that cancel; this shows them."""

    questions: int
    changed: int  # the normalised answer text differs (or only one of the two gave an answer)
    kept_right: int
    lost: int  # right before, wrong after
    gained: int  # wrong before, right after
    kept_wrong: int
    by_kind: dict[str, dict[str, int]]  # kind -> questions, start_right, trained_right, lost, gained

    def lines(self) -> list[str]:
        """Markdown bullets for a report."""
        kinds = "; ".join(f"{k}: {v['questions']} questions, right {v['start_right']} → {v['trained_right']} "
                          f"(lost {v['lost']}, gained {v['gained']})" for k, v in self.by_kind.items())
        return [f"- greedy answers changed on {self.changed} of {self.questions} questions: {self.gained} wrong → right, "
                f"{self.lost} right → wrong, {self.kept_right} right in both, {self.kept_wrong} wrong in both",
                f"- by kind of question: {kinds}"]


def answer_changes(base_dir: str | Path, trained_dir: str | Path, datasets: list[str]) -> AnswerChanges:
    """The :class:`AnswerChanges` from the starter's to the trained model's evaluation of the same questions
    (their ``items/<dataset>.jsonl``; the questions must be the same, as :func:`paired_items` requires)."""
    from tasks.qa import normalize_answer

    def first(record: dict[str, Any]) -> tuple[float, str | None]:
        sample, scores = _greedy_sample(record)
        prediction = sample.get("prediction", record.get("prediction"))
        return float(scores["em"]), None if prediction is None else normalize_answer(prediction)

    counts = {"changed": 0, "kept_right": 0, "lost": 0, "gained": 0, "kept_wrong": 0}
    by_kind = {k: {"questions": 0, "start_right": 0, "trained_right": 0, "lost": 0, "gained": 0} for k in QUESTION_KINDS}
    for ds, pairs in paired_items(base_dir, trained_dir, datasets).items():
        a, b = _items(Path(base_dir), ds), _items(Path(trained_dir), ds)
        for qid in pairs.ids:
            (em_a, pred_a), (em_b, pred_b) = first(a[qid]), first(b[qid])
            right_a, right_b = em_a >= 1.0, em_b >= 1.0
            transition = ("kept_right" if right_b else "lost") if right_a else ("gained" if right_b else "kept_wrong")
            counts[transition] += 1
            counts["changed"] += pred_a != pred_b
            kind = by_kind[question_kind(a[qid].get("question", ""), list(a[qid].get("golds") or []))]
            kind["questions"] += 1
            kind["start_right"] += right_a
            kind["trained_right"] += right_b
            kind["lost"] += transition == "lost"
            kind["gained"] += transition == "gained"
    return AnswerChanges(questions=sum(counts[k] for k in ("kept_right", "lost", "gained", "kept_wrong")),
                         by_kind={k: v for k, v in by_kind.items() if v["questions"]}, **counts)
