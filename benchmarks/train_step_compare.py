"""Time per training step of two source trees side by side: is a restructuring no slower?

Runs ``benchmarks/train_step.py`` of each tree (``--before``, ``--after``: two checkouts, e.g. a
``git archive main`` copy and this worktree) one round at a time, both sides back to back in each round,
the side that goes first alternating from round to round (before, after; after, before; ...), so load from
other processes on the machine, and the order, hit both sides alike. Each call is the tree's own benchmark in
its own processes, importing that tree's code (``PYTHONPATH`` is the tree). A round's figure per mode
is train_step.py's: the median of its steps after the warm-up. The ratio after / before is taken round
by round (both sides measured back to back) and reported as the median over rounds with its min / max;
below 1 the after tree is faster. Writes ``benchmarks/results/train_step_compare.json``.

    python benchmarks/train_step_compare.py --before /tmp/main-copy --after . --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
SIDES = ("before", "after")


def git_head(tree: Path) -> str | None:
    """The commit a tree is at, if it is a git checkout."""
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def run_round(tree: Path, args: argparse.Namespace, out: Path) -> dict:
    """One round of ``tree``'s train_step.py (every mode once); its result JSON."""
    cmd = [sys.executable, str(tree / "benchmarks" / "train_step.py"), "--config", "tiny", "--rounds", "1", "--no-trl",
           "--modes", args.modes, "--out", str(out)]  # fmt: skip
    if args.quick:
        cmd.append("--quick")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(cmd, env=env, cwd=tree, check=True)
    return json.loads(out.read_text())


def compare(rounds: dict[str, list[dict]], modes: list[str]) -> dict:
    """Per mode: each side's round figures and the after / before ratio, round by round and summarized."""
    out = {}
    for mode in modes:
        before = [r["results"][mode]["round_medians_s"][0] for r in rounds["before"]]
        after = [r["results"][mode]["round_medians_s"][0] for r in rounds["after"]]
        ratios = [a / b for a, b in zip(after, before)]
        out[mode] = {
            "before_step_s": before, "after_step_s": after,
            "before_peak_rss_mb": max(r["results"][mode]["peak_rss_mb"] for r in rounds["before"]),
            "after_peak_rss_mb": max(r["results"][mode]["peak_rss_mb"] for r in rounds["after"]),
            "after_over_before_step_time_ratio": statistics.median(ratios),
            "ratio_rounds": {"per_round": ratios, "min": min(ratios), "max": max(ratios)},
        }  # fmt: skip
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="the tree measured first in each round (e.g. a copy of main)")
    p.add_argument("--after", default=str(ROOT), help="the tree measured second in each round (default: this one)")
    p.add_argument("--rounds", type=int, default=4, help="rounds; each runs both sides, which goes first alternating")
    p.add_argument("--modes", default="ours_grpo,ours_emapg", help="train_step.py modes (comma-separated; ours_grpo first)")
    p.add_argument("--quick", action="store_true", help="train_step.py's quick sizes")
    p.add_argument("--out", help="result JSON (default benchmarks/results/train_step_compare.json)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    for side in SIDES:
        if not (Path(getattr(args, side)) / "benchmarks" / "train_step.py").is_file():
            p.error(f"--{side} {getattr(args, side)}: no benchmarks/train_step.py there")
    if args.modes.split(",")[0] != "ours_grpo":
        p.error("--modes must start with ours_grpo (train_step.py takes its ratios against it)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trees = {side: Path(getattr(args, side)).resolve() for side in SIDES}
    modes = args.modes.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="bench-train-step-compare-"))
    rounds: dict[str, list[dict]] = {side: [] for side in SIDES}
    start = time.perf_counter()
    for rnd in range(args.rounds):
        for side in SIDES if rnd % 2 == 0 else SIDES[::-1]:
            print(f"[round {rnd + 1}/{args.rounds}] {side}: {trees[side]}", flush=True)
            rounds[side].append(run_round(trees[side], args, tmp / f"{side}-{rnd}.json"))
    result = {
        "config": {**rounds["after"][0]["config"], "rounds": args.rounds, "modes": modes},
        "trees": {side: {"path": str(trees[side]), "commit": git_head(trees[side])} for side in SIDES},
        "results": compare(rounds, modes),
        "wall_s": time.perf_counter() - start,
    }
    out = Path(args.out) if args.out else RESULTS_DIR / "train_step_compare.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for mode, r in result["results"].items():
        print(f"{mode}: after/before step time {r['after_over_before_step_time_ratio']:.3f} "
              f"(rounds {r['ratio_rounds']['min']:.3f}-{r['ratio_rounds']['max']:.3f})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
