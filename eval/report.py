"""Reports: markdown tables, JSON and PNG plots for one run or several side by side.

A run directory holds ``results.json`` (written by :mod:`eval.runner`)::

    {"name", "model", "suite", "engine", "protocol": {...}, "grader", "timestamp",
     "primary_metric": "em" | "pass@1", "metric_names": [...],
     "datasets": {"<dataset>": {"n_items": int, "<metric>": value, ...}, ...},
     "average": {"<metric>": unweighted mean over datasets, ...}}

Metric values are fractions in [0, 1] in JSON (``searches``, ``turns`` and
``response_tokens`` are means of counts; ``timeouts``, ``rollout_errors`` and
``search_failures`` are totals); tables show rates as percentages with one decimal.

``emapg eval compare RUN_DIR... --out DIR`` puts several runs side by side, plus the
paper's published numbers in a table of their own, labelled as another model at another scale
(Qwen2.5-3B base for search, DeepSeek-R1-Distill-Qwen-1.5B for math, on the full test sets and
wiki-18): never a column or a bar beside ours, which a reader would compare with them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tasks.task import get_task

__all__ = [
    "PAPER_REFERENCE",
    "COUNT_METRICS",
    "load_run",
    "results_table",
    "contamination_line",
    "comparison_table",
    "paper_table",
    "plot_bars",
    "plot_learning",
    "plot_passk",
    "write_run_report",
    "compare_runs",
]

#: Published numbers (percent) from the EMA-PG paper (arXiv 2602.04417), GRPO vs EMA-PG.
PAPER_REFERENCE: dict[str, dict[str, Any]] = {
    "qa": {
        "metric": "em",
        "model": "Qwen2.5-3B base, wiki-18 e5 retriever, full test sets",
        "columns": {
            "paper GRPO": {"hotpotqa": 29.7, "2wikimultihopqa": 27.4, "bamboogle": 12.8},
            "paper EMA-PG": {"hotpotqa": 44.1, "2wikimultihopqa": 40.1, "bamboogle": 33.1},
        },
        "note": "The paper reports EMA-PG +33.3% relative to GRPO on the average over the 7 QA sets; "
        "per-dataset numbers for NQ, TriviaQA, PopQA and MuSiQue are not public.",
    },
    "math": {
        "metric": "pass@1",
        "model": "DeepSeek-R1-Distill-Qwen-1.5B, n=32, T=0.8, top_p=0.9",
        "columns": {
            "paper GRPO": {"olympiadbench": 50.8},
            "paper EMA-PG": {"olympiadbench": 53.9},
        },
        "note": "Only OlympiadBench is public per dataset. The paper's AMC is LiveMathBench AMC, "
        "not the bundled AMC 2022-23 set, and its grader is mathd-or-sympy, not math-verify.",
    },
}

#: Metrics that are counts or means of counts, shown as plain numbers rather than percentages.
COUNT_METRICS = {"searches", "turns", "response_tokens", "timeouts", "n_items", "n_samples", "rollout_errors",
                 "search_failures"}


def load_run(run_dir: str | Path) -> dict[str, Any]:
    """``results.json`` of a run directory, with ``run_dir`` added."""
    path = Path(run_dir) / "results.json"
    if not path.is_file():
        from emapg.errors import UserError

        raise UserError(f"{run_dir} is not an evaluation run directory (no results.json)")
    data = json.loads(path.read_text())
    data["run_dir"] = str(run_dir)
    return data


def _fmt(metric: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if metric in COUNT_METRICS:
        return f"{value:.2f}" if isinstance(value, float) and not float(value).is_integer() else str(int(value))
    return f"{100 * value:.1f}"


def _label(metric: str) -> str:
    return metric if metric in COUNT_METRICS else f"{metric} (%)"


def results_table(results: dict[str, Any], *, part: str = "datasets") -> str:
    """One run: datasets × all metrics, plus the unweighted average row; ``part="trained_on"``: the questions
    the model was trained on, scored apart (:mod:`eval.contamination`), without an average."""
    metrics = list(results["metric_names"])
    head = "| dataset | n | " + " | ".join(_label(m) for m in metrics) + " |"
    sep = "|---|---:|" + "---:|" * len(metrics)
    rows = [head, sep]
    for ds, vals in results[part].items():
        rows.append(f"| {ds} | {vals['n_items']} | " + " | ".join(_fmt(m, vals.get(m)) for m in metrics) + " |")
    if part != "datasets":
        return "\n".join(rows)
    avg = results["average"]
    n_total = sum(v["n_items"] for v in results["datasets"].values())
    rows.append(f"| **average** | {n_total} | " + " | ".join(f"**{_fmt(m, avg.get(m))}**" for m in metrics) + " |")
    return "\n".join(rows)


def _run_label(run: dict[str, Any]) -> str:
    return str(run.get("name") or Path(run.get("run_dir", "run")).name)


def _unique_labels(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Run labels, with ``#2``, ``#3`` ... appended to repeats so columns stay distinguishable."""
    seen: dict[str, int] = {}
    out = []
    for run in runs:
        label = _run_label(run)
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return out


def comparison_table(runs: Sequence[dict[str, Any]], metric: str) -> str:
    """Datasets × runs for one metric (percent) and the unweighted average row (the paper's numbers are never a
    column here: :func:`paper_table`)."""
    datasets: list[str] = []
    for run in runs:
        datasets += [d for d in run["datasets"] if d not in datasets]
    cols = _unique_labels(runs)
    rows = ["| dataset | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for ds in datasets:
        cells = [_fmt(metric, r["datasets"].get(ds, {}).get(metric)) for r in runs]
        rows.append(f"| {ds} | " + " | ".join(cells) + " |")
    cells = [f"**{_fmt(metric, r['average'].get(metric))}**" if set(r["datasets"]) == set(datasets)
             else "–" for r in runs]  # an average over different datasets would not compare
    rows.append("| **average** | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


def plot_bars(runs: Sequence[dict[str, Any]], metric: str, path: str | Path) -> Path:
    """Grouped bar chart: one group per dataset, one bar per run (800 px wide); each group's label carries its
    number of questions (of the first run)."""
    plt = _pyplot()
    datasets: list[str] = []
    for run in runs:
        datasets += [d for d in run["datasets"] if d not in datasets]
    labels = _unique_labels(runs)
    series = [(lab, [100 * r["datasets"].get(d, {}).get(metric, float("nan")) for d in datasets]) for lab, r in zip(labels, runs)]
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for i, (label, values) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(datasets))]
        ax.bar(xs, values, width, label=label)
    n = [runs[0]["datasets"].get(d, {}).get("n_items") for d in datasets]
    ax.set_xticks(range(len(datasets)))
    ax.set_xticklabels([f"{d}\nn={k}" if k is not None else d for d, k in zip(datasets, n)], fontsize=8)
    ax.set_ylabel(_label(metric))
    ax.set_title(f"{metric} per dataset")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def paper_table(reference: dict[str, Any]) -> list[str]:
    """Markdown lines: the paper's published numbers (:data:`PAPER_REFERENCE` ``[suite]``) as a table of their own,
    headed as another model at another scale, so that no reader sets them beside this run's columns."""
    columns = reference["columns"]
    datasets = [d for col in columns.values() for d in col]
    datasets = list(dict.fromkeys(datasets))
    rows = ["| dataset | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    rows += [f"| {ds} | " + " | ".join(f"{col[ds]:.1f}" if ds in col else "–" for col in columns.values()) + " |"
             for ds in datasets]
    return ["### Published numbers of the EMA-PG paper: another model, another scale", "",
            f"{reference['metric']} (%) of {reference['model']} (arXiv 2602.04417) -- **not produced by this code or "
            f"these runs**, and not comparable with the columns above. {reference['note']}", "", *rows]


def plot_learning(comparisons: dict[str, dict[str, Any]], path: str | Path, labels: tuple[str, str] = ("starter", "trained")) -> Path:
    """Starter vs trained on the same questions, 800 px wide, for each protocol side by side (``comparisons``: a
    name such as "greedy EM" -> its :func:`eval.learning.compare_learning` block): above, each dataset's and the
    pooled score of both policies; below, the difference with its paired bootstrap interval. Every group's label
    carries its number of questions."""
    plt = _pyplot()
    first = next(iter(comparisons.values()))
    groups = [*first["datasets"], "pooled"]
    n = [b["n"] for b in first["datasets"].values()] + [first["pooled"]["n"]]
    ticks = [f"{g}\nn={k}" for g, k in zip(groups, n)]
    block = lambda c, g: c["pooled"] if g == "pooled" else c["datasets"].get(g)  # noqa: E731
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.4), sharex=True)
    bars = 2 * len(comparisons)
    width = 0.8 / bars
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, comp) in enumerate(comparisons.items()):
        for j, side in enumerate(("base", "trained")):
            k = 2 * i + j
            xs = [x + (k - (bars - 1) / 2) * width for x in range(len(groups))]
            values = [block(comp, g)[side] if block(comp, g) else float("nan") for g in groups]
            top.bar(xs, values, width, color=colors[j], alpha=1.0 if i == 0 else 0.55, hatch=None if i == 0 else "//",
                    label=f"{labels[j]}, {name}")
        xs = [x + (i - (len(comparisons) - 1) / 2) * 0.3 for x in range(len(groups))]
        diffs = [block(comp, g)["difference"] if block(comp, g) else None for g in groups]
        mean = [d["mean"] if d else float("nan") for d in diffs]
        err = [[d["mean"] - d["low"] if d else 0 for d in diffs], [d["high"] - d["mean"] if d else 0 for d in diffs]]
        level = round(100 * first["pooled"]["difference"]["confidence"])
        bottom.errorbar(xs, mean, yerr=err, fmt="o", capsize=3, color=colors[2 + i], label=f"{name}, {level}% interval")
    top.set_ylabel("%", fontsize=9)
    top.set_title(f"{labels[0]} vs {labels[1]} on the same questions", fontsize=10)
    top.legend(fontsize=7, ncol=2)
    bottom.axhline(0, color="grey", linewidth=1)
    bottom.set_ylabel(f"{labels[1]} - {labels[0]} (pp)", fontsize=9)
    bottom.set_title("difference, paired bootstrap over questions", fontsize=10)
    bottom.legend(fontsize=7)
    bottom.set_xticks(range(len(groups)))
    bottom.set_xticklabels(ticks, fontsize=8)
    for ax in (top, bottom):
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_passk(runs: Sequence[dict[str, Any]], path: str | Path) -> Path | None:
    """pass@k curves (log2 k axis): one panel per dataset, one line per run. None if no run
    has pass@k beyond k = 1."""
    def curve(vals: dict[str, Any]) -> list[tuple[int, float]]:
        pts = [(int(m.split("@")[1]), v) for m, v in vals.items() if m.startswith("pass@") and v is not None]
        return sorted(pts)

    datasets: list[str] = []
    for run in runs:
        datasets += [d for d, v in run["datasets"].items() if len(curve(v)) > 1 and d not in datasets]
    if not datasets:
        return None
    plt = _pyplot()
    cols = min(3, len(datasets))
    nrows = math.ceil(len(datasets) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(8 / 3 * cols, 2.6 * nrows), squeeze=False)
    for ax, ds in zip(axes.flat, datasets):
        for label, run in zip(_unique_labels(runs), runs):
            pts = curve(run["datasets"].get(ds, {}))
            if pts:
                ax.plot([k for k, _ in pts], [100 * v for _, v in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ks = sorted({k for run in runs for k, _ in curve(run["datasets"].get(ds, {}))})
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        ax.set_title(ds)
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k (%)")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(datasets):]:
        ax.axis("off")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _header(results: dict[str, Any]) -> list[str]:
    p = results["protocol"]
    task = get_task(results["suite"])
    lines = [
        f"- model: `{results['model']}`",
        f"- suite: {results['suite']}, engine: {results.get('engine', '?')}, protocol: `{p['name']}` "
        f"(n={p['n']}, T={p['temperature']}, top_p={p['top_p']}, max_tokens={p['max_tokens']}, seed={p['seed']}"
        + (f", max_turns={p['max_turns']}, topk={p['retrieval_topk']}" if task.searches else "")
        + (f", format={p['format']} (parser {p['tool_parser']})" if p.get("format", "tags") != "tags" else "")
        + ")",
    ]
    lines.append(task.scoring_line(p, results["grader"]))
    if results.get("retriever"):
        lines.append(f"- retriever: {results['retriever']}")
    lines.append(f"- written: {results['timestamp']}; average = unweighted mean over datasets")
    lines.append(f"- {contamination_line(results)}")
    return lines


def contamination_line(results: dict[str, Any]) -> str:
    """What the contamination guard (:mod:`eval.contamination`) found, in one line."""
    c = results.get("contamination")
    if not c:
        return "contamination check: not recorded (results written before the guard existed)"
    if not c["checked"]:
        because = c.get("unchecked_because") or ("the model's folder has no trained_questions.json (a model not "
                                                 "trained by emapg, or trained before it recorded its questions)")
        return f"contamination check: none possible -- {because}"
    record = f"{c['trained_questions_count']} trained-on questions, digest `{c['trained_questions_digest'][:12]}`"
    if not c["excluded"]:
        return f"contamination check: no question here is one the model was trained on ({record})"
    per_ds = ", ".join(f"{ds}: {n}" for ds, n in c["excluded"].items())
    return (f"**contamination: {sum(c['excluded'].values())} question(s) here were trained on ({per_ds}; {record}); "
            "they are scored apart below and left out of the table and the average**")


def write_run_report(results: dict[str, Any], out_dir: str | Path, notes: str | None = None) -> Path:
    """``report.md`` (+ ``<metric>.png`` and ``pass_at_k.png`` for math) for one run."""
    out_dir = Path(out_dir)
    metric = results["primary_metric"]
    bars = plot_bars([results], metric, out_dir / f"{metric.replace('@', '_at_')}.png")
    lines = [f"# Evaluation: {results['name']}", "", *_header(results), "", results_table(results), "",
             f"![{metric}]({bars.name})"]
    passk = plot_passk([results], out_dir / "pass_at_k.png")
    if passk is not None:
        lines += ["", f"![pass@k]({passk.name})"]
    if results.get("trained_on"):
        lines += ["", "## Questions the model was trained on (scored apart)", "",
                  "Not unseen questions: these scores say how well it reproduces its training data, not how it "
                  "generalises, and are in no average above.", "", results_table(results, part="trained_on")]
    if results.get("search"):
        from eval.search_metrics import markdown_table

        lines += ["", "## Searching, per slice", "", "Search slice: `data/qa/search_slice.json`; reader slice: "
                  "`data/qa/reader_slice.json`; rest: the other questions. EM/F1: the mean over samples (this run's "
                  "sampling: mean@k when sampled, the greedy score when greedy).", "",
                  markdown_table(results["search"], scores=(("em", "EM"), ("f1", "F1")))]
    if notes:
        lines += ["", notes]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _provenance_section(reference: str, diffs: dict[str, Any]) -> list[str]:
    """The report's provenance section: every difference to the first run, the refusable ones flagged."""
    lines = ["## Provenance", ""]
    if not any(d.blocking or d.informational for d in diffs.values()):
        return lines + [f"Same index fingerprint, protocol, model and packages as {reference}." if diffs else "One run."]
    for label, d in diffs.items():
        for text in d.blocking:
            lines.append(f"- **Warning ({label} vs {reference}): not comparable**: `{text}`")
        for text in d.informational:
            lines.append(f"- {label} vs {reference}: `{text}`")
    return lines


def compare_runs(run_dirs: Sequence[str | Path], out_dir: str | Path, with_paper: bool = True,
                 allow_mismatch: bool = False, plots: bool = True) -> dict[str, Any]:
    """Side-by-side report of several runs of one suite; writes ``report.md``,
    ``comparison.json`` and (``plots``) its figures to ``out_dir``; returns the comparison data.

    Every difference between the first run and each other one (:func:`eval.provenance.run_differences`)
    is listed; runs searched against another index or under another protocol are refused, unless
    ``allow_mismatch`` (then the report carries a warning)."""
    from emapg.errors import UserError
    from eval.provenance import run_differences

    runs = [load_run(d) for d in run_dirs]
    if not runs:
        raise UserError("give at least one run directory to compare")
    suites = {r["suite"] for r in runs}
    if len(suites) != 1:
        raise UserError(f"cannot compare runs of different suites: {', '.join(sorted(suites))}")
    suite = suites.pop()
    labels = _unique_labels(runs)
    diffs = {label: run_differences(runs[0], r) for label, r in zip(labels[1:], runs[1:])}
    blocking = [f"{label}: {d}" for label, rd in diffs.items() for d in rd.blocking]
    if blocking and not allow_mismatch:
        raise UserError(f"these runs searched another index or used another protocol than {labels[0]}, so their numbers are "
                        f"not comparable: {'; '.join(blocking)} (pass --allow-mismatch to compare them anyway)")
    metric = runs[0]["primary_metric"]
    ref = PAPER_REFERENCE[suite]
    reference = ref["columns"] if with_paper and ref["metric"] == metric else None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bars = plot_bars(runs, metric, out_dir / f"{metric.replace('@', '_at_')}.png") if plots else None
    passk = plot_passk(runs, out_dir / "pass_at_k.png") if plots else None
    lines = [f"# Comparison ({suite}, {metric})", ""]
    for label, r in zip(_unique_labels(runs), runs):
        p = r["protocol"]
        lines.append(f"- **{label}**: `{r['model']}`, protocol `{p['name']}` (n={p['n']}, T={p['temperature']}), "
                     f"{'grader `' + r['grader'] + '`, ' if get_task(suite).grader_setting else ''}{r['timestamp']}"
                     + (f"; {sum(r['contamination']['excluded'].values())} question(s) it was trained on left out"
                        if (r.get("contamination") or {}).get("excluded") else ""))
    lines += ["", comparison_table(runs, metric), ""]
    if bars is not None:
        lines.append(f"![{metric}]({bars.name})")
    if reference:
        lines += ["", *paper_table(ref), ""]
    if passk is not None:
        lines += ["", f"![pass@k]({passk.name})"]
    lines += ["", *_provenance_section(labels[0], diffs)]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    data = {
        "suite": suite,
        "metric": metric,
        "runs": [{"label": label, **{k: r[k] for k in ("name", "model", "run_dir", "datasets", "average", "protocol",
                                                          "grader", "timestamp")}}
                 for label, r in zip(_unique_labels(runs), runs)],
        "paper_reference": {"columns": reference, "model": ref["model"], "note": ref["note"]} if reference else None,
        "fingerprints": {label: r.get("fingerprint") for label, r in zip(labels, runs)},
        "differences": {label: {"blocking": d.blocking, "informational": d.informational} for label, d in diffs.items()},
    }
    (out_dir / "comparison.json").write_text(json.dumps(data, indent=2) + "\n")
    return data
