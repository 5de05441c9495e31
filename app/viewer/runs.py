"""The folders ``emapg view`` opens, read and never written.

A *training run* is a folder with ``metrics.jsonl`` or ``samples.jsonl`` (``emapg train``; the curves and each
step's sampled trajectories); an *eval run* one with ``items/`` or ``run.json`` (``emapg eval``; one record
per question); a folder holding runs one level down -- ``emapg demo``'s ``train/``, ``eval_base/``,
``eval_trained/`` -- opens as all of them. Anything else is refused with one line (:class:`emapg.errors.UserError`).

Files are read by :mod:`app.viewer.run_files` (regular files inside the run folder only, record by record) and
re-read when they change (size and modification time), so a run still being written shows its new steps; a line cut
by a kill mid-write, or any record the viewer cannot show, is skipped and counted (``problems`` in the run's summary),
never repaired: the viewer is read-only.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from app.viewer.run_files import RunFiles, int_field
from app.viewer.trajectory import render, shown
from emapg.errors import UserError

METRICS_FILE, SAMPLES_FILE, GUARD_FILE = "metrics.jsonl", "samples.jsonl", "guard.jsonl"  # trainer.tracking's, trainer.recovery's
RESULTS_FILE, ITEMS_DIR, EVAL_RUN_FILE = "results.json", "items", "run.json"  # eval.runner's, eval.items'

Kind = Literal["train", "eval"]
#: The eval-item filters: right, wrong, wrong although a gold answer was in the passages shown, wrong without it.
OUTCOMES = ("right", "wrong", "shown_wrong", "not_shown_wrong")


def run_kind(path: Path) -> Kind | None:
    # exists(), not is_file(): a run whose metrics.jsonl is damaged (a named pipe in its place) still opens, and says so
    if (path / METRICS_FILE).exists() or (path / SAMPLES_FILE).exists():
        return "train"
    if (path / ITEMS_DIR).is_dir() or (path / EVAL_RUN_FILE).exists():  # a demo's report/ has a results.json only
        return "eval"
    return None


def _stepped(record: dict[str, Any]) -> bool:
    return int_field(record.get("step")) is not None


def _summarizable(record: dict[str, Any]) -> bool:
    item_summary("", record)  # raises on a record whose fields have the wrong types
    return True


@dataclass
class Run:
    id: str
    label: str
    kind: Kind
    path: Path
    files: RunFiles = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.files = RunFiles(self.path)

    # ------------------------------------------------------------------ training runs
    def metrics(self) -> list[dict[str, Any]]:
        return self.files.records(METRICS_FILE, keep=_stepped)

    def samples(self) -> list[dict[str, Any]]:
        return self.files.records(SAMPLES_FILE, keep=_stepped)

    def guard_events(self) -> list[dict[str, Any]]:
        return self.files.records(GUARD_FILE, keep=_stepped)

    def sample_steps(self) -> list[int]:
        return sorted({int_field(s.get("step")) for s in self.samples()})

    def step_samples(self, step: int) -> tuple[list[dict[str, Any]], int]:
        """The step's samples as display data, and how many of its records could not be shown (skipped)."""
        shown_, skipped = [], 0
        for s in self.samples():
            if int_field(s.get("step")) == step:
                try:
                    shown_.append(render(s))
                except (TypeError, ValueError, AttributeError, KeyError, IndexError):  # a field of the wrong type
                    skipped += 1
        return shown_, skipped

    # ------------------------------------------------------------------ eval runs
    def results(self) -> dict[str, Any]:
        return self.files.document(RESULTS_FILE)

    def datasets(self) -> list[str]:
        return self.files.listing(ITEMS_DIR, ".jsonl")

    def records(self, dataset: str) -> list[dict[str, Any]]:
        if dataset not in self.datasets():  # only names found on disk reach a path
            return []
        return self.files.records(f"{ITEMS_DIR}/{dataset}.jsonl", keep=_summarizable)

    def items(self) -> list[dict[str, Any]]:
        """One summary per question of every dataset (what the filters and the comparison read)."""
        return [item_summary(ds, r) for ds in self.datasets() for r in self.records(ds)]

    def item(self, dataset: str, item_id: str, sample: int = 0) -> dict[str, Any] | None:
        """One question (``item_id`` as the API shows ids: :func:`app.viewer.trajectory.shown`): its ``sample``-th
        sample's trajectory, and every sample's answer and score (each one click away on the page). None: no such
        question or sample."""
        for r in self.records(dataset):
            if shown(str(r.get("id"))) == item_id:
                samples = [s if isinstance(s, dict) else {} for s in (r.get("samples") or [{}])]
                if not 0 <= sample < len(samples):
                    return None
                chosen = samples[sample]
                return {**item_summary(dataset, r), **render({**r, **chosen, "golds": r.get("golds"), "question": r.get("question"),
                                                              "prompt": r.get("prompt"), "prompt_tokens": None}), "sample": sample,
                        "sample_scores": [{"prediction": s.get("prediction"), "right": _score(s.get("scores") or {}) >= 1.0}
                                          for s in samples]}
        return None

    # ------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "label": self.label, "kind": self.kind, "path": str(self.path),
                               "updated": _mtime(self.path)}
        if self.kind == "train":
            metrics = self.metrics()
            out.update(steps=len(metrics), last_step=int_field(metrics[-1].get("step")) if metrics else 0,
                       sample_steps=len(self.sample_steps()))
            self.guard_events()
        else:
            from app.viewer.summary import protocol_of

            items = self.items()
            out.update(datasets=self.datasets(), questions=len(items), right=sum(i["right"] for i in items),
                       em=100 * sum(i["score"] for i in items) / len(items) if items else None,
                       samples=max((i["samples"] for i in items), default=1), protocol=protocol_of(self.path),
                       model=str(self.results().get("model", "")), search=self.search())
        problems = self.files.problems()
        out.update(problems=problems, skipped_records=sum(p["skipped"] for p in problems.values()),
                   unreadable_files=sum(p["unreadable"] is not None for p in problems.values()))
        return out

    def search(self) -> dict[str, Any]:
        """How the agent searched, per slice (search slice, reader slice, rest; :mod:`eval.search_metrics`), from the
        items, so older runs show it too."""
        from eval.search_metrics import by_slice

        return by_slice([r for ds in self.datasets() for r in self.records(ds)])


def _mtime(path: Path) -> float:
    """The newest modification time of the run's files (one level down, and items/): when it was last written (the
    entries' own times: a link is not followed)."""
    times = [0.0]
    for folder in (path, path / ITEMS_DIR):
        try:
            times.append(folder.lstat().st_mtime)
            times += [e.stat(follow_symlinks=False).st_mtime for e in os.scandir(folder)]
        except OSError:  # gone, not a folder, unreadable: what could be read stands
            continue
    return max(times)


def _greedy(record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A question's first sample (its greedy answer) and that sample's scores, as eval.learning reads them."""
    sample = (record.get("samples") or [record])[0]
    return sample, sample.get("scores") or record.get("scores") or {}


def _score(scores: dict[str, Any]) -> float:
    for key in ("em", "acc", "accuracy", "correct"):
        if isinstance(scores.get(key), (int, float)):
            return float(scores[key])
    return 0.0


def question_em(record: dict[str, Any]) -> float:
    """The question's EM as the reports read it (:func:`eval.learning.question_score`: with n samples, the mean over
    them -- mean@n); a record without one scores its first sample."""
    from eval.learning import question_score

    if isinstance((record.get("scores") or {}).get("em"), (int, float)):
        return question_score(record, "em")
    return _score(_greedy(record)[1])


def item_summary(dataset: str, record: dict[str, Any]) -> dict[str, Any]:
    """One question as the tables list it: ``score`` (mean@n EM in [0, 1]) over its ``samples``; ``right``: every
    sample right (a greedy run's one answer); the answer, searches and gold shown are its first sample's."""
    sample, scores = _greedy(record)
    samples = record.get("samples") or [record]
    score = question_em(record)
    right = score >= 1.0
    shown = float(scores.get("retrieval_recall", 0.0) or 0.0) > 0
    searches = int(sample.get("searches", record.get("searches", 0)) or 0)
    prediction = sample.get("prediction", record.get("prediction"))
    return {"dataset": dataset, "id": str(record.get("id")), "question": str(record.get("question", "")),
            "golds": [str(g) for g in record.get("golds") or []], "prediction": None if prediction is None else str(prediction),
            "right": right, "score": score, "samples": len(samples),
            "right_samples": sum(_score(s.get("scores") or {}) >= 1.0 for s in samples), "shown": shown, "searches": searches,
            "outcome": "right" if right else ("shown_wrong" if shown else "not_shown_wrong")}


def filter_items(items: list[dict[str, Any]], *, dataset: str | None = None, outcome: str | None = None,
                 searches: int | None = None) -> list[dict[str, Any]]:
    """The items of ``dataset``, with ``outcome`` (one of :data:`OUTCOMES`), that made ``searches`` searches;
    None: any."""
    def keep(i: dict[str, Any]) -> bool:
        if dataset and i["dataset"] != dataset:
            return False
        if outcome == "wrong" and i["right"]:
            return False
        if outcome in ("right", "shown_wrong", "not_shown_wrong") and i["outcome"] != outcome:
            return False
        return searches is None or i["searches"] == searches

    return [i for i in items if keep(i)]


def compare(a: Run, b: Run) -> dict[str, Any]:
    """Question by question, two eval runs of the same questions under the same protocol (greedy with greedy, sampled
    with sampled; :func:`app.viewer.summary.check_like_for_like` refuses others): which questions' score (mean@n
    EM) went up (``gained``) or down (``lost``), which answers changed without it."""
    from app.viewer.summary import check_like_for_like
    from tasks.qa import normalize_answer

    protocol = check_like_for_like(a.label, a.path, b.label, b.path)
    left = {(i["dataset"], i["id"]): i for i in a.items()}
    rows = []
    for i in b.items():
        j = left.get((i["dataset"], i["id"]))
        if j is None:
            continue
        change = ("gained" if i["score"] > j["score"] else "lost" if i["score"] < j["score"] else
                  "changed" if normalize_answer(j["prediction"] or "") != normalize_answer(i["prediction"] or "") else "same")
        rows.append({"dataset": i["dataset"], "id": i["id"], "question": i["question"], "golds": i["golds"],
                     "a": {k: j[k] for k in ITEM_FIELDS}, "b": {k: i[k] for k in ITEM_FIELDS}, "change": change})
    counts = {c: sum(r["change"] == c for r in rows) for c in ("gained", "lost", "changed", "same")}
    return {"a": a.summary(), "b": b.summary(), "protocol": protocol, "rows": rows, "counts": counts,
            "only_in_one": len(left) + len(b.items()) - 2 * len(rows)}


#: What the comparison shows of each side's answer to a question.
ITEM_FIELDS = ("prediction", "right", "score", "samples", "right_samples", "shown", "searches")


def finite(value: Any) -> Any:
    """JSON-safe: NaN and infinities (the trainer writes them as strings) become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _runs_inside(path: Path) -> list[tuple[Path, Kind]]:
    """The runs one level down in ``path``."""
    children = [(c, run_kind(c)) for c in sorted(path.iterdir()) if c.is_dir()]
    return [(c, k) for c, k in children if k is not None]


def open_runs(paths: list[str | os.PathLike]) -> list[Run]:
    """The runs under ``paths`` (a run folder, or a folder holding runs one level down); a path that is neither
    is a :class:`UserError`."""
    found: list[tuple[Path, Kind, str]] = []
    for raw in paths:
        path = Path(raw).expanduser().resolve()
        if not path.is_dir():
            raise UserError(f"{raw}: no such folder")
        kind = run_kind(path)
        if kind is not None:
            found.append((path, kind, path.name))
            continue
        children = _runs_inside(path)
        if not children and (path / "report.md").is_file() and _runs_inside(path.parent):  # a demo's report/ (its last line)
            print(f"emapg view: {raw} holds no run; opening the runs of its folder {path.parent}", file=sys.stderr)
            path, children = path.parent, _runs_inside(path.parent)
        if not children:
            raise UserError(f"{raw} is not a run: no {METRICS_FILE} or {SAMPLES_FILE} (emapg train), no {ITEMS_DIR}/ or "
                            f"{EVAL_RUN_FILE} (emapg eval), and no such folder inside it (emapg demo)")
        found += [(c, k, f"{path.name}/{c.name}") for c, k in children]
    runs, seen = [], set()
    for path, kind, label in found:
        if path in seen:
            continue
        seen.add(path)
        runs.append(Run(id=str(len(runs)), label=label, kind=kind, path=path))
    return runs
