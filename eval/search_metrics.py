"""How a search agent searches, per slice: the search slice, the reader slice and the rest of the questions.

For the item records of one QA evaluation (``items/<dataset>.jsonl``: each sample has ``searches`` and
``search_gold``, whether each search's passages as shown hold a gold answer, :func:`eval.scoring.score_items`):

* ``searches``: the distribution of searches per sample, and ``searches_per_question`` (its mean);
* ``searched_again_rate``: of the samples whose first passages lacked the gold, the share that searched again;
* ``second_holds_gold_rate``: of the samples that searched a second time, the share whose second passages hold it;
* ``em`` / ``f1``: the mean over samples (mean@k of a sampled run, the greedy score of a greedy run).

Slices: ``search`` (``data/qa/search_slice.json``, :mod:`tasks.multihop`), ``reader`` (``data/qa/reader_slice.json``,
:mod:`eval.reader_slice`), ``rest`` (every other question), and ``all``. :func:`slice_report` puts a sampled and a
greedy run side by side (sampled mean@k EM/F1, greedy EM).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SLICES = ("search", "reader", "rest", "all")


@functools.lru_cache(maxsize=1)
def slice_ids() -> dict[str, frozenset[str]]:
    """The recorded slices' question ids (a slice not recorded is empty); read once per process."""
    from eval.reader_slice import READER_SLICE_FILE, load_reader_slice
    from tasks.multihop import search_slice_ids

    reader = load_reader_slice().ids if READER_SLICE_FILE.is_file() else {}
    return {"search": frozenset(i for ids in search_slice_ids().values() for i in ids),
            "reader": frozenset(i for ids in reader.values() for i in ids)}


def slice_of(item_id: str, ids: Mapping[str, frozenset[str] | set[str]]) -> str:
    if item_id in ids.get("search", ()):
        return "search"
    if item_id in ids.get("reader", ()):
        return "reader"
    return "rest"


def search_metrics(samples: Sequence[Mapping[str, Any]], questions: int) -> dict[str, Any]:
    """The metrics (module docstring) of these samples (of ``questions`` questions)."""
    n = len(samples)
    dist = Counter(_count(s.get("searches")) for s in samples)
    gold = [_flags(s.get("search_gold")) for s in samples]
    missed = [g for g in gold if g and not g[0]]
    second = [g for g in gold if len(g) >= 2]
    return {
        "questions": questions,
        "samples": n,
        "searches": {str(k): v for k, v in sorted(dist.items())},
        "searches_per_question": round(sum(k * v for k, v in dist.items()) / n, 4) if n else None,
        "first_missed": len(missed),
        "searched_again_rate": round(sum(len(g) >= 2 for g in missed) / len(missed), 4) if missed else None,
        "second_searches": len(second),
        "second_holds_gold_rate": round(sum(bool(g[1]) for g in second) / len(second), 4) if second else None,
        "em": round(sum(_score(s, "em") for s in samples) / n, 4) if n else None,
        "f1": round(sum(_score(s, "f1") for s in samples) / n, 4) if n else None,
    }


def _score(sample: Mapping[str, Any], name: str) -> float:
    """A sample's ``name`` score as :func:`eval.scoring.score_items` records it (``sample["scores"][name]``); 0 where a
    damaged record lacks it (the viewer reads whatever a run folder holds)."""
    scores = sample.get("scores")
    value = scores.get(name) if isinstance(scores, Mapping) else None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def _count(value: Any) -> int:
    """A sample's number of searches; 0 where a damaged record holds no count."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _flags(value: Any) -> list[Any]:
    """A sample's per-search gold flags (``search_gold``); none where a damaged record holds no list."""
    return list(value) if isinstance(value, list) else []


def by_slice(records: Iterable[Mapping[str, Any]], ids: Mapping[str, frozenset[str] | set[str]] | None = None) -> dict[str, dict[str, Any]]:
    """:func:`search_metrics` of every slice (``ids``: default the recorded slices) over item records."""
    ids = slice_ids() if ids is None else ids
    groups: dict[str, list[Mapping[str, Any]]] = {s: [] for s in SLICES}
    for r in records:
        groups[slice_of(str(r.get("id")), ids)].append(r)
        groups["all"].append(r)
    return {name: search_metrics([s for r in recs for s in (r.get("samples") or ()) if isinstance(s, Mapping)], len(recs))
            for name, recs in groups.items()}


def slice_report(sampled: Iterable[Mapping[str, Any]] | None, greedy: Iterable[Mapping[str, Any]] | None,
                 ids: Mapping[str, frozenset[str] | set[str]] | None = None) -> dict[str, dict[str, Any]]:
    """Per slice: the sampled run's search metrics and mean@k EM/F1 (``sampled_em``, ``sampled_f1``) and the greedy
    run's EM (``greedy_em``) and searches per question (``greedy_searches_per_question``); either run may be None."""
    ids = slice_ids() if ids is None else ids
    s = by_slice(sampled, ids) if sampled is not None else {}
    g = by_slice(greedy, ids) if greedy is not None else {}
    out = {}
    for name in SLICES:
        row = dict(s.get(name) or g.get(name) or {})
        row.pop("em", None)
        row.pop("f1", None)
        if name in s:
            row["sampled_em"], row["sampled_f1"] = s[name]["em"], s[name]["f1"]
        if name in g:
            row["greedy_em"] = g[name]["em"]
            row["greedy_searches_per_question"] = g[name]["searches_per_question"]
        out[name] = row
    return out


SCORE_COLUMNS = (("sampled_em", "sampled EM"), ("sampled_f1", "sampled F1"), ("greedy_em", "greedy EM"))


def markdown_table(report: Mapping[str, Mapping[str, Any]],
                   scores: Sequence[tuple[str, str]] = SCORE_COLUMNS) -> str:
    """The slices as a Markdown table (rates as %); ``scores``: the (key, header) score columns."""
    def pct(x):
        return "–" if x is None else f"{100 * x:.1f}"

    lines = ["| slice | questions | searches per question | searches (samples) | searched again when first lacked gold | "
             "second search shows gold | " + " | ".join(h for _, h in scores) + " |",
             "|---|---:|---:|---|---:|---:|" + "---:|" * len(scores)]
    for name, r in report.items():
        if not r.get("questions"):
            continue
        dist = ", ".join(f"{k}: {v}" for k, v in r.get("searches", {}).items())
        spq = r.get("searches_per_question")
        lines.append(f"| {name} | {r['questions']} | {'–' if spq is None else f'{spq:.2f}'} | {dist} | "
                     f"{pct(r.get('searched_again_rate'))} ({r.get('first_missed', 0)}) | "
                     f"{pct(r.get('second_holds_gold_rate'))} ({r.get('second_searches', 0)}) | "
                     + " | ".join(pct(r.get(k)) for k, _ in scores) + " |")
    return "\n".join(lines)


def _records(run_dir, datasets: Sequence[str]) -> list[dict[str, Any]]:
    from pathlib import Path

    from eval.items import items_file, read_items

    return [r for ds in datasets if items_file(Path(run_dir), ds).is_file() for r in read_items(Path(run_dir), ds)]


def demo_section(out, datasets: Sequence[str]) -> dict[str, Any]:
    """The demo's search report: per policy (``base``, ``trained``) the slices of its greedy (``eval_<label>``) and
    sampled (``eval_<label>_sampled``) evaluations under ``out``, each joined by its search-slice evaluation
    (``eval_<label>_search``, ``eval_<label>_search_sampled``) where the demo ran one: ``all`` is every question
    evaluated."""
    from pathlib import Path

    out = Path(out)

    def records(label: str, tail: str) -> list[dict[str, Any]] | None:
        found = [d for d in (out / f"eval_{label}{tail}", out / f"eval_{label}_search{tail}") if d.is_dir()]
        return [r for d in found for r in _records(d, datasets)] if found else None

    return {label: slice_report(records(label, "_sampled"), records(label, "")) for label in ("base", "trained")}


def demo_lines(section: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The demo report's Markdown: how each policy searched, per slice."""
    lines = ["## Searching, per slice", "",
             "Search slice: held-out multi-hop questions whose first search (the question text) does not show the gold and "
             "a second search can (`data/qa/search_slice.json`); reader slice: held-out questions whose gold the first "
             "starter was shown (`data/qa/reader_slice.json`); rest: every other question evaluated.", ""]
    for label, name in (("base", "starter"), ("trained", "trained")):
        if label in section:
            lines += [f"**{name}**", "", markdown_table(section[label]), ""]
    return lines
