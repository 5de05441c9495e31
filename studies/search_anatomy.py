"""What RL reinforced about searching again: the search-learning study's training trajectories, read by what they did
(issue 53, the measured cause behind a missed target).

Question. ``studies/search_learning.py`` trains the second starter on ``qa_pool_v2`` and scores whether it searches again
when the first passages lacked the gold. Its first runs searched again *less* after training. Which trajectories did
the update push up, and which down?

Method. Every finished run of a study's work folder (``<arm>-seed<k>/run.json``) keeps ``samples.jsonl``: the first
group of every training step, whole (the rollout's segments, the reward, the GRPO advantage the update used). Each
trajectory is put in one class by what it did, the gold read from its own passages as shown (:func:`tasks.qa.gold_shown`,
the one matcher of the slices and the pool):

* ``one_search_gold_shown`` / ``one_search_gold_missing``: answered (or stopped) after one search;
* ``again_after_gold_shown``: searched again although the first passages held the gold;
* ``again_found_gold``: the first passages lacked it, a later search showed it;
* ``again_gold_never_shown``: the first lacked it and no later search showed it;
* ``no_search``.

Per class and arm (seeds pooled): trajectories, mean reward, mean and summed advantage (the sum is the net push the
update gave that behaviour, up to the per-token weighting), and the share stopped by the turn limit. The groups are
also split by the pool's recorded need (``searches_needed`` of ``data/qa/pool_v2``): in the groups that need a second
search, the mean advantage of searching again against answering after one search is the direction the update moved
exactly the behaviour the search slice scores. Steps are split in halves to show the drift.

    python studies/search_anatomy.py --work /work/runs/search_learning \
        --keep-from benchmarks/results/search_anatomy.json   # runs whose work folder is gone stay in

Writes ``benchmarks/results/search_anatomy.json``: the tables and every trajectory's compact row (arm, seed, step,
behaviour, need, reward, advantage, stop reason), so a later call adds runs without the earlier work folders. The
samples are the first of each step's groups (``log_samples``), a sample of the training batch and not all of it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from studies import harness  # noqa: E402
from studies.harness import RESULTS  # noqa: E402

CLASSES = ("no_search", "one_search_gold_shown", "one_search_gold_missing", "again_after_gold_shown", "again_found_gold",
           "again_gold_never_shown")
POOL = ROOT / "data" / "qa" / "pool_v2" / "train.jsonl.gz"
RUN_FOLDER = re.compile(r"^(?P<arm>[a-z_]+)-seed(?P<seed>\d+)$")


def behaviour(sample: Mapping[str, Any]) -> str:
    """The class of one ``samples.jsonl`` row by what it did (the module's list), the gold read from its
    information segments as shown."""
    from tasks.qa import gold_shown

    shown = [seg.get("text", "") for seg in sample.get("segments") or [] if seg.get("action") == "information"]
    searches = int(sample.get("searches") or 0)
    if searches == 0 or not shown:
        return "no_search"
    golds, question = sample.get("golds") or [], sample.get("question")
    holds = [gold_shown([text], golds, question) is not None for text in shown]
    if searches == 1:
        return "one_search_gold_shown" if holds[0] else "one_search_gold_missing"
    if holds[0]:
        return "again_after_gold_shown"
    return "again_found_gold" if any(holds[1:]) else "again_gold_never_shown"


def pool_need(path: Path = POOL) -> dict[str, int]:
    """Question text -> searches it needs by the pool's recorded rule (1 or 2)."""
    with gzip.open(path, "rt") as f:
        return {r["question"]: int(r["searches_needed"]) for r in map(json.loads, f)}


def summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Count, mean reward, mean and summed advantage, and the turn-limit share of ``rows``."""
    n = len(rows)
    if not n:
        return {"trajectories": 0}
    adv = [float(r.get("advantage", 0.0)) for r in rows]
    return {"trajectories": n, "reward_mean": round(sum(float(r["reward"]) for r in rows) / n, 4),
            "advantage_mean": round(sum(adv) / n, 4), "advantage_sum": round(sum(adv), 4),
            "max_turns_share": round(sum(r.get("stop_reason") == "max_turns" for r in rows) / n, 4)}


def classify(rows: Iterable[Mapping[str, Any]], need: Mapping[str, int]) -> list[dict[str, Any]]:
    """Each row with its ``behaviour`` and the pool's ``need`` (None for a question outside the pool)."""
    return [{**r, "behaviour": behaviour(r), "need": need.get(r.get("question", ""))} for r in rows]


def anatomy(rows: Sequence[Mapping[str, Any]], steps: int) -> dict[str, Any]:
    """The tables of one arm from its classified rows (every seed's)."""
    by_class = {c: summary([r for r in rows if r["behaviour"] == c]) for c in CLASSES}
    total = len(rows)
    for c in CLASSES:
        by_class[c]["share"] = round(by_class[c]["trajectories"] / total, 4) if total else None
    again = lambda r: r["behaviour"].startswith("again_")  # noqa: E731
    one = lambda r: r["behaviour"].startswith("one_search")  # noqa: E731
    by_need: dict[str, Any] = {}
    for need in (1, 2):
        part = [r for r in rows if r["need"] == need]
        by_need[str(need)] = {"trajectories": len(part),
                              "searched_again": summary([r for r in part if again(r)]),
                              "one_search": summary([r for r in part if one(r)]),
                              "groups": contrasts(part)}
    half = steps // 2
    halves = {name: {"searched_again_share": round(sum(again(r) for r in part) / len(part), 4) if part else None,
                     "searched_again": summary([r for r in part if again(r)]),
                     "one_search": summary([r for r in part if one(r)])}
              for name, part in (("first_half", [r for r in rows if int(r["step"]) <= half]),
                                 ("second_half", [r for r in rows if int(r["step"]) > half]))}
    return {"trajectories": total, "by_behaviour": by_class, "by_pool_need": by_need, "by_half": halves}


def contrasts(rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """How many stored groups ``rows`` hold, and how many of them could teach when to search again.

    A group is the rows of one seed and step (the report stores one group per step). Its GRPO advantages sum to zero,
    so a behaviour's mean advantage is zero whenever each group holds one behaviour only, even where the rewards in it
    differ. ``both_behaviours``: groups with a trajectory that searched again and one that answered after one search;
    ``reward_spread``: groups whose rewards differ (the others get a zero advantage); ``contrasted``: both at once, the
    only groups whose update can prefer one behaviour to the other.
    """
    groups: dict[tuple[int, int], list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(int(r.get("seed", 0)), int(r["step"]))].append(r)
    both = [g for g in groups.values()
            if any(r["behaviour"].startswith("again_") for r in g) and any(r["behaviour"].startswith("one_search") for r in g)]
    spread = [g for g in groups.values() if len({float(r["reward"]) for r in g}) > 1]
    return {"groups": len(groups), "both_behaviours": len(both), "reward_spread": len(spread),
            "contrasted": sum(1 for g in both if len({float(r["reward"]) for r in g}) > 1)}


ROW_KEYS = ("arm", "seed", "step", "behaviour", "need", "reward", "advantage", "stop_reason")


def compact(row: Mapping[str, Any], arm: str, seed: int) -> dict[str, Any]:
    """What the report keeps of a classified row (:data:`ROW_KEYS`)."""
    return {"arm": arm, "seed": seed, "step": int(row["step"]), "behaviour": row["behaviour"], "need": row["need"],
            "reward": float(row["reward"]), "advantage": float(row.get("advantage", 0.0)), "stop_reason": row.get("stop_reason")}


def build(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The report's seeds and per-arm tables from compact rows."""
    arms: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        arms[r["arm"]].append(r)
    return {"seeds": {arm: sorted({int(r["seed"]) for r in part}) for arm, part in arms.items()},
            "arms": {arm: anatomy(part, max(int(r["step"]) for r in part)) for arm, part in arms.items()}}


def finished_runs(work: Path) -> list[tuple[str, int, Path]]:
    """(arm, seed, folder) of every finished run in a study's work folder, by arm then seed."""
    runs = []
    for folder in sorted(p for p in work.iterdir() if p.is_dir()):
        m = RUN_FOLDER.match(folder.name)
        if m and harness.finished(folder / "run.json") is not None and (folder / "samples.jsonl").is_file():
            runs.append((m["arm"], int(m["seed"]), folder))
    return runs


def read_samples(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The usable rows of a ``samples.jsonl`` and how many lines were skipped: a line torn by a kill, one that is not
    JSON, or a row without a numeric ``step`` and ``reward`` (:func:`emapg.jsonl.parse_lines`)."""
    from emapg.jsonl import parse_lines

    records, skipped = parse_lines(path.read_bytes())
    usable = [r for r in records if isinstance(r, dict) and _number(r.get("step")) and _number(r.get("reward"))]
    return usable, skipped + len(records) - len(usable)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def markdown(report: Mapping[str, Any]) -> str:
    """The behaviour table of every arm, for the page."""
    lines = ["| arm | behaviour | trajectories | share | mean reward | mean advantage | summed advantage | stopped by the turn limit |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for arm, a in report["arms"].items():
        for c in CLASSES:
            s = a["by_behaviour"][c]
            if s["trajectories"]:
                lines.append(f"| {arm} | {c} | {s['trajectories']} | {100 * s['share']:.0f}% | {s['reward_mean']:.2f} | "
                             f"{s['advantage_mean']:+.2f} | {s['advantage_sum']:+.1f} | {100 * s['max_turns_share']:.0f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True, help="the search-learning study's work folder (its --work)")
    p.add_argument("--keep-from", default=None, help="an earlier report of this script: its rows of runs not finished "
                   "in --work are kept")
    p.add_argument("--out", default=str(RESULTS / "search_anatomy.json"), help="where to write the JSON")
    harness.add_arguments(p)
    args = p.parse_args(argv)
    work = Path(args.work)
    if not work.is_dir():
        p.error(f"--work: no folder at {work}")
    runs = finished_runs(work)
    if not runs and not args.keep_from:
        p.error(f"--work: no finished run with samples.jsonl in {work}")
    if args.keep_from and not Path(args.keep_from).is_file():
        p.error(f"--keep-from: no report at {args.keep_from}")
    provenance = harness.start(__file__, quick=False, allow_dirty=args.allow_dirty)
    need = pool_need()
    rows: list[dict[str, Any]] = []
    skipped: dict[str, int] = {}
    for arm, seed, folder in runs:
        samples, skipped[f"{arm}-seed{seed}"] = read_samples(folder / "samples.jsonl")
        rows += [compact(r, arm, seed) for r in classify(samples, need)]
    here = {(arm, seed) for arm, seed, _ in runs}
    if args.keep_from:
        earlier = json.loads(Path(args.keep_from).read_text())
        rows += [r for r in earlier["rows"] if (r["arm"], int(r["seed"])) not in here]
    rows.sort(key=lambda r: (r["arm"], int(r["seed"]), int(r["step"])))
    report = {"study": "search_learning", "work": str(work), "created": harness.now(),
              "provenance": provenance,
              "samples": "the first group of every training step (samples.jsonl, log_samples rows)",
              "skipped_lines": {run: n for run, n in skipped.items() if n},
              **build(rows), "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))
    for arm, a in report["arms"].items():
        n2 = a["by_pool_need"]["2"]
        print(f"{arm}: groups needing two searches: searched again {n2['searched_again'].get('trajectories', 0)} "
              f"(mean advantage {n2['searched_again'].get('advantage_mean', float('nan')):+.2f}), one search "
              f"{n2['one_search'].get('trajectories', 0)} (mean advantage {n2['one_search'].get('advantage_mean', float('nan')):+.2f}); "
              f"groups {n2['groups']['groups']}, with both behaviours {n2['groups']['both_behaviours']}, with a reward "
              f"spread {n2['groups']['reward_spread']}, both at once {n2['groups']['contrasted']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
