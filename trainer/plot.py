"""``emapg plot RUN_DIR... --out curves.png``: training curves of one or several runs side by side.

One panel per metric (reward, KL, response length by default), one line per run,
read from each run's ``metrics.jsonl``. Lines can be smoothed with a trailing
moving average; the raw values are drawn faintly underneath.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from emapg.errors import UserError

DEFAULT_METRICS = ("reward/mean", "kl/mean", "response/length_mean")
TITLES = {"reward/mean": "mean reward", "kl/mean": "KL(policy || anchor)", "response/length_mean": "response length (tokens)"}


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def load_curves(run_dir: Path, metrics: list[str]) -> dict[str, tuple[list[int], list[float]]]:
    from trainer.tracking import read_metrics

    try:
        records = read_metrics(run_dir)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    curves = {}
    for m in metrics:
        pts = [(int(r["step"]), float(r[m])) for r in records if isinstance(r.get(m), (int, float))]
        curves[m] = ([s for s, _ in pts], [v for _, v in pts])
    return curves


def plot_runs(
    run_dirs: list[Path], out: Path, *, metrics: list[str], labels: list[str] | None = None, smooth: int = 1, title: str | None = None
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or [p.name for p in run_dirs]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.6 * len(metrics), 3.6), squeeze=False)
    for run_dir, label, color in zip(run_dirs, labels, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10):
        curves = load_curves(run_dir, metrics)
        for ax, m in zip(axes[0], metrics):
            steps, values = curves[m]
            if not steps:
                continue
            if smooth > 1:
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
                ax.plot(steps, moving_average(values, smooth), color=color, label=label, linewidth=2)
            else:
                ax.plot(steps, values, color=color, label=label, linewidth=2)
    for ax, m in zip(axes[0], metrics):
        ax.set_title(TITLES.get(m, m))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="emapg plot", description="Plot training curves (metrics.jsonl) of one or several runs to PNG.")
    p.add_argument("runs", nargs="+", type=Path, help="run folders (each holding metrics.jsonl)")
    p.add_argument("--out", type=Path, required=True, help="output PNG")
    p.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS), help="metric keys, one panel each")
    p.add_argument("--labels", nargs="+", help="legend labels, one per run (default: folder names)")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window (1: raw)")
    p.add_argument("--title", help="figure title")
    args = p.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        raise UserError(f"--labels needs one label per run ({len(args.runs)}), got {len(args.labels)}")
    if args.smooth < 1:
        raise UserError("--smooth must be >= 1")
    for r in args.runs:
        if not r.is_dir():
            raise UserError(f"run folder not found: {r}")
    out = plot_runs(args.runs, args.out, metrics=args.metrics, labels=args.labels, smooth=args.smooth, title=args.title)
    print(out)
    return 0
