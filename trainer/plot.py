"""``emapg plot RUN_DIR... --out curves.png``: training curves of one or several runs side by side.

One panel per metric (reward, KL, response length by default), one line per run, every logged
step, read from each run's ``metrics.jsonl``. Lines can be smoothed with a trailing moving
average; the raw values are drawn faintly underneath. The KL panel is titled by the run's
estimator (``algorithm.kl.type`` of its checkpoint's ``config.yaml``): ``kl/mean`` is the
per-token mean of that *estimate* at the sampled tokens, not the exact KL; a sampled or Top-k
estimate can be negative. Stability-guard events (the run's ``guard.jsonl``, :mod:`trainer.recovery`)
are marked on every panel: a dotted line at the step of a warning, a dashed one where the guard
acted (lower_lr, rollback, reset_to_anchor, stop). The command's options come from
:class:`PlotConfig` (help written once, on its fields).
"""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import dataclass
from pathlib import Path

from emapg.config import ConfigError, add_config_arguments, config_from_args, option
from emapg.errors import UserError

DEFAULT_METRICS = ("reward/mean", "kl/mean", "response/length_mean")
#: Every figure is :data:`WIDTH_IN` x :data:`DPI` = 800 px wide, readable at Markdown width with no zoom.
WIDTH_IN, DPI, PANEL_HEIGHT_IN = 8.0, 100, 2.7
#: The two reward curves, named the same in every report and in ``emapg view``: with groups left out of the
#: update (``rollout.uniform_groups=drop``, ``rollout.filter_groups``) the kept groups' reward is not the policy's.
REWARD_SAMPLED = "reward of every sampled group (the policy's)"
REWARD_KEPT = "reward of the groups kept for the update"
TITLES = {
    "reward/mean": REWARD_KEPT,
    "filter/sampled_reward_mean": REWARD_SAMPLED,
    "filter/informative_frac": "trained groups whose rewards differ",
    "filter/first_round_informative_frac": "sampled groups whose rewards differ (first round)",
    "kl/mean": "KL(policy || anchor) estimate (can be < 0)",
    "response/length_mean": "response length (tokens)",
    "response/answered_frac": "format rate (ended with an answer)",
    "search/per_traj": "searches per question",
    "response/repeated_ngram_share": "repeated word 4-grams (share)",
    "response/non_text_share": "non-text words (share)",
    "response/no_answer_rate": "no answer or a refusal (share)",
    "response/length_drift": "response length vs the run's start (-1 .. )",
    "kl/to_start": "exact KL(policy || starting policy)",
    "probe/flip_rate": "probe answers flipped since the last probe",
}
#: Curves flat by construction under a setting: key -> (the value they keep, why). A run where one stays at that value
#: over every step shows nothing there (``emapg view`` leaves it out of its default panels and says why; the demo's
#: report does not draw it).
FLAT_BY_CONSTRUCTION: dict[str, tuple[float, str]] = {
    "filter/informative_frac": (1.0, "as it is by construction when uniform groups are dropped or filtered "
                                     "(rollout.uniform_groups=drop, rollout.filter_groups): every trained group's rewards differ"),
    "reward/zero_variance_groups": (0.0, "as it is by construction when uniform groups are dropped or filtered: it counts "
                                         "the trained groups"),
}
#: ``kl/mean`` titles by ``algorithm.kl.type``: which estimate the curve is.
KL_TITLES = {
    "topk_reverse": "Top-k reverse KL estimate (policy || anchor; can be < 0)",
    "topk_forward": "Top-k forward KL estimate (anchor || policy; can be < 0)",
    "exact_reverse": "exact reverse KL (policy || anchor)",
    "exact_forward": "exact forward KL (anchor || policy)",
    "k3": "K3 estimate of KL(policy || anchor)",
    "low_var_kl": "K3 estimate of KL(policy || anchor)",
}


def kl_type(run_dir: Path) -> str | None:
    """``algorithm.kl.type`` of the run's latest checkpoint (None when there is none)."""
    from trainer.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    path = ckpt / "config.yaml" if ckpt is not None else None
    if path is None or not path.is_file():
        return None
    import yaml

    try:
        cfg = yaml.safe_load(path.read_text()) or {}
        return str(cfg["algorithm"]["kl"]["type"])
    except (yaml.YAMLError, KeyError, TypeError):
        return None


def metric_title(metric: str, kl_types: set[str | None]) -> str:
    """A panel's title; the KL panel names the estimator when every run (``kl_types``: theirs) used the same one."""
    if metric == "kl/mean" and len(kl_types) == 1 and None not in kl_types:
        kind = next(iter(kl_types))
        return KL_TITLES.get(kind, f"{kind} estimate of the KL (can be < 0)")
    return TITLES.get(metric, metric)


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


def guard_marks(run_dir: Path) -> list[tuple[int, bool]]:
    """(step, whether the guard acted rather than only warned) of each step with guard events."""
    from trainer.recovery import read_guard_events

    acted: dict[int, bool] = {}
    for e in read_guard_events(run_dir):
        step = int(e["step"])
        acted[step] = acted.get(step, False) or not str(e.get("detail", "")).startswith("warn")
    return sorted(acted.items())


def plot_runs(
    run_dirs: list[Path], out: Path, *, metrics: list[str], labels: list[str] | None = None, smooth: int = 1, title: str | None = None
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or [p.name for p in run_dirs]
    kinds = {kl_type(r) for r in run_dirs}
    rows, cols = grid_shape(len(metrics))
    fig, grid = plt.subplots(rows, cols, figsize=(WIDTH_IN, PANEL_HEIGHT_IN * rows), squeeze=False)
    panels = list(grid.flat)[: len(metrics)]
    for ax in list(grid.flat)[len(metrics):]:
        ax.axis("off")
    for run_dir, label, color in zip(run_dirs, labels, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10):
        curves = load_curves(run_dir, metrics)
        for ax in panels:
            for step, acted in guard_marks(run_dir):
                ax.axvline(step, color=color, alpha=0.6, linewidth=1, linestyle="--" if acted else ":")
        for ax, m in zip(panels, metrics):
            steps, values = curves[m]
            if not steps:
                continue
            marker = "o" if len(steps) <= 30 else None  # every logged step is drawn; few steps get markers
            if smooth > 1:
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
                ax.plot(steps, moving_average(values, smooth), color=color, label=label, linewidth=2)
            else:
                ax.plot(steps, values, color=color, label=label, linewidth=2, marker=marker, markersize=3)
    for ax, m in zip(panels, metrics):
        ax.set_title(textwrap.fill(metric_title(m, kinds), 44 if cols < 3 else 34), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if m.endswith(("_frac", "_share", "_rate")):  # a share: its whole range, so a flat 1.0 reads as 1.0, not as noise
            ax.set_ylim(-0.03, 1.03)
        if ax.lines and len(run_dirs) > 1:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out



def grid_shape(panels: int) -> tuple[int, int]:
    """(rows, columns) of a figure with ``panels`` panels: at most 3 across (2 from 4 panels on), so each stays
    at least ~260 px wide in an 800-px figure."""
    cols = panels if panels <= 3 else 2 if panels == 4 else 3
    return -(-panels // cols), cols


@dataclass
class PlotConfig:
    """``emapg plot``: training curves of one or several runs to a PNG."""

    runs: list[str] = option(help="run folders (each holding metrics.jsonl)")
    out: str = option(help="output PNG")
    metrics: list[str] = option(list(DEFAULT_METRICS), help="metric keys, one panel each")
    labels: list[str] = option([], help="legend labels, one per run (default: folder names)")
    smooth: int = option(1, help="moving-average window (1: raw)")
    title: str | None = option(None, help="figure title")

    def validate(self) -> None:
        if self.labels and len(self.labels) != len(self.runs):
            raise ConfigError(f"labels: one label per run ({len(self.runs)}), got {len(self.labels)}")
        if self.smooth < 1:
            raise ConfigError("smooth must be >= 1")
        if not self.metrics:
            raise ConfigError("metrics: give at least one metric key")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="emapg plot", description="Plot training curves (metrics.jsonl) of one or several runs to PNG.")
    add_config_arguments(p, PlotConfig, positional=("runs",))
    return p


def main(argv: list[str]) -> int:
    cfg = config_from_args(PlotConfig, parser().parse_args(argv))
    runs = [Path(r) for r in cfg.runs]
    for r in runs:
        if not r.is_dir():
            raise UserError(f"run folder not found: {r}")
    out = plot_runs(runs, Path(cfg.out), metrics=cfg.metrics, labels=cfg.labels or None, smooth=cfg.smooth, title=cfg.title)
    print(out)
    return 0
