"""The plan beside what the run measured: what ``emapg view`` and the demo report show, so a drift is visible.

``emapg train`` writes its plan to ``<run>/plan.json`` and logs ``perf/peak_memory_bytes`` (the CUDA allocator's
peak) or, on a CPU, ``perf/peak_rss_bytes`` (the process's peak resident memory: it also holds the interpreter and
the libraries, so it sits above the plan's tensor bytes by a fixed few hundred MiB) with ``time/step``,
``time/rollout`` and ``time/training`` every step.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

PLAN_FILE = "plan.json"


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def plan_beside_measured(run_dir: str | Path, metrics: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Rows ``{what, predicted, measured, drift, unit}`` for peak memory and the step's phases, or None without a
    plan. Times are medians over the steps after the first (the first warms up); drift = measured / predicted - 1."""
    path = Path(run_dir) / PLAN_FILE
    try:
        plan = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    steady = metrics[1:] or metrics
    peaks = [r for r in metrics if "perf/peak_memory_bytes" in r or "perf/peak_rss_bytes" in r]
    gpu = any("perf/peak_memory_bytes" in r for r in peaks)
    key = "perf/peak_memory_bytes" if gpu else "perf/peak_rss_bytes"
    measured_peak = max((float(r[key]) for r in peaks if key in r), default=None)
    step = plan.get("step_seconds", {})
    rows = [
        ("peak memory" + ("" if gpu else " (process RSS, includes the interpreter and libraries)"),
         plan.get("memory_bytes", {}).get("total"), measured_peak, "bytes"),
        ("step time", step.get("total"), _median(steady, "time/step"), "s"),
        ("rollout", step.get("rollout"), _median(steady, "time/rollout"), "s"),
        ("update", step.get("update"), _median(steady, "time/training"), "s"),
    ]
    out = []
    for what, predicted, measured, unit in rows:
        drift = measured / predicted - 1 if predicted and measured is not None else None
        out.append({"what": what, "predicted": predicted, "measured": measured, "drift": drift, "unit": unit})
    device = plan.get("device", {})
    return {"device": device.get("name"), "devices": device.get("devices_per_node", 1) * device.get("nodes", 1),
            "fits": plan.get("fits"), "rates": plan.get("rates", {}).get("source"), "rows": out}


def plan_lines(compared: dict[str, Any] | None) -> list[str]:
    """Markdown lines of :func:`plan_beside_measured` (none without a plan)."""
    if not compared:
        return []

    def fmt(v: float | None, unit: str) -> str:
        if v is None:
            return "–"
        return f"{v / 2**30:.2f} GiB" if unit == "bytes" else f"{v:.2f} s"

    lines = [f"Planned by `emapg plan` for {compared['devices']} x {compared['device']} (rates {compared['rates']}) "
             "beside what the run measured:", "", "| | predicted | measured | drift |", "|---|---:|---:|---:|"]
    for r in compared["rows"]:
        drift = "–" if r["drift"] is None else f"{r['drift']:+.0%}"
        lines.append(f"| {r['what']} | {fmt(r['predicted'], r['unit'])} | {fmt(r['measured'], r['unit'])} | {drift} |")
    return lines
