"""Record a finished ``make demo`` run as ``benchmarks/results/demo.json``, so the README's demo figures are bound to
a committed file (issue #54) instead of copied by hand from a run folder that is not in the repository.

    make demo OUT=/tmp/demo > /tmp/demo.log            # prints the report folder as its last line
    python scripts/record_demo.py /tmp/demo --stdout /tmp/demo.log

The file is the run's ``report/results.json`` as the demo wrote it (minus the absolute paths of its logs), with a
``recorded`` block: when the run ended, the demo's own wall time (its "demo finished in N min" line, or ``--wall-s``),
the commit it ran at (and whether the tree differed), and the machine (CPUs, bf16 instructions, load average when
recorded). Then ``python scripts/gen_performance.py`` rewrites the README's bound demo figures from it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "demo.json"
FINISHED = re.compile(r"demo finished in (?P<minutes>\d+(?:\.\d+)?) min")


def find_results(run: Path) -> Path:
    """The demo's results.json under ``run`` (the ``--out`` folder, or the report folder the demo printed)."""
    for candidate in (run / "results.json", run / "report" / "results.json"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{run}: no results.json (pass the demo's --out folder or the report folder it printed)")


def wall_seconds(stdout: Path | None, wall_s: float | None) -> float | None:
    """The whole demo's wall time: ``--wall-s``, else the demo's "demo finished in N min" line (N to 0.1 min)."""
    if wall_s is not None:
        return wall_s
    if stdout is None:
        return None
    found = FINISHED.findall(stdout.read_text(errors="replace"))
    return float(found[-1]) * 60 if found else None


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def machine() -> dict[str, Any]:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    load = [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]] if Path("/proc/loadavg").exists() else None
    return {"cpus": os.cpu_count(), "cpu_bf16_instructions": "avx512_bf16" in flags or "amx_bf16" in flags,
            "load_average_at_record": load}


def record(run: Path, stdout: Path | None = None, wall_s: float | None = None, note: str = "",
           commit: str | None = None) -> dict[str, Any]:
    """demo.json's content for the finished demo in ``run`` (``commit``: the one it ran at; default HEAD)."""
    path = find_results(run)
    results = json.loads(path.read_text())
    results.pop("logs", None)  # absolute paths on the machine that ran it
    ended = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc)
    wall = wall_seconds(stdout, wall_s)
    stages = results.get("stage_seconds") or {}
    results["date"] = ended.strftime("%Y-%m-%dT%H:%M:%SZ")  # when the run ended (the performance page's file table)
    results["recorded"] = {
        "date": ended.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit or _git("rev-parse", "--short", "HEAD"),
        "tree_differed": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "machine": machine(),
        "wall_s": wall,
        "wall_min": wall / 60 if wall else None,
        "stage_minutes": {name: seconds / 60 for name, seconds in stages.items()},
        "source": "scripts/record_demo.py from the demo's report/results.json",
        "note": note,
    }
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="the demo's --out folder (or the report folder it printed)")
    p.add_argument("--stdout", type=Path, help="the demo's captured output, for its 'demo finished in N min' line")
    p.add_argument("--wall-s", type=float, help="the demo's wall time in seconds (instead of --stdout)")
    p.add_argument("--note", default="", help="how the machine was loaded, anything a reader of the figures needs")
    p.add_argument("--commit", help="the commit the demo ran at (default: HEAD now)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    data = record(args.run, args.stdout, args.wall_s, args.note, args.commit)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{args.out}: sampled EM {data['base']['sampled_em']:.1f} -> {data['trained']['sampled_em']:.1f}, "
          f"greedy {data['base']['pooled_em']:.1f} -> {data['trained']['pooled_em']:.1f}, wall "
          f"{data['recorded']['wall_min'] or float('nan'):.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
