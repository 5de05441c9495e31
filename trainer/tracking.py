"""Metrics sinks: ``metrics.jsonl`` (always), TensorBoard, wandb (optional), progress (:mod:`emapg.progress`).

Only rank 0 logs. Every record is a flat ``{"step": N, "<group>/<name>": value}``
dict; the JSONL file is the source of truth for ``emapg plot`` and for tests.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

from emapg.console import echo
from emapg.jsonl import append_jsonl, read_jsonl

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"

# What the progress bar shows, in order: (metric key, short label, format).
PROGRESS_FIELDS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("kl/mean", "kl", "{:.2e}"),
    ("loss/clip_frac", "clip", "{:.3f}"),
    ("actor/entropy", "ent", "{:.2f}"),
    ("response/length_mean", "len", "{:.0f}"),
    ("search/per_traj", "srch", "{:.2f}"),
    ("search/failures", "sfail", "{:.0f}"),
    ("search/rejected_batches", "sdrop", "{:.0f}"),
    ("tools/calls", "tools", "{:.0f}"),  # rollout.tools: calls of every tool, and the failed ones
    ("tools/failures", "tfail", "{:.0f}"),
    ("rollout/session_splits", "splits", "{:.0f}"),  # rollout.agent: recorded sessions that split
    ("perf/tokens_per_s", "tok/s", "{:.0f}"),
    ("perf/padding_frac", "pad", "{:.2f}"),
    ("time/generation", "gen", "{:.1f}s"),
    ("time/retrieval", "ret", "{:.1f}s"),
    ("time/training", "train", "{:.1f}s"),
)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a run's ``metrics.jsonl`` (a run folder or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} at {path}")
    return read_jsonl(path)  # a line cut by a kill -9 mid-write is skipped


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records after ``last_step`` (a resumed run re-logs the steps it redoes)."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if int(r.get("step", 0)) <= last_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


class Tracker:
    """Fan a step's metrics out to every enabled sink. A no-op on ranks other than 0."""

    @classmethod
    def for_run(cls, cfg: Any, *, start_step: int, enabled: bool) -> "Tracker":
        """The tracker of a run of :class:`trainer.config.TrainConfig` ``cfg`` (``logging.*``), from ``start_step``."""
        from emapg.config import to_dict

        lg = cfg.logging
        return cls(cfg.output_path, total_steps=cfg.run.total_steps, start_step=start_step, tensorboard=lg.tensorboard,
                   wandb=lg.wandb, wandb_project=lg.wandb_project, run_name=cfg.run.name, config=to_dict(cfg),
                   progress=lg.progress, enabled=enabled)

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "ema-pg",
        run_name: str = "run",
        config: dict[str, Any] | None = None,
        progress: bool = True,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._tb = None
        self._wandb = None
        self._progress = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        truncate_metrics(self.metrics_path, start_step)
        self._jsonl = open(self.metrics_path, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
        if wandb:
            try:
                import wandb as wandb_mod
            except ImportError:
                warnings.warn("logging.wandb=true but the wandb package is not installed; skipping wandb", stacklevel=2)
            else:
                self._wandb = wandb_mod.init(
                    project=wandb_project, name=run_name, config=config or {}, dir=str(self.run_dir), resume="allow"
                )
        if progress:
            self._start_progress(total_steps, start_step)

    def _start_progress(self, total: int, start: int) -> None:
        from emapg.progress import StepProgress

        self._progress = StepProgress("train", total, start=start)  # a bar on a terminal, a line per step otherwise

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: _plain(v) for k, v in metrics.items()}
        record = {"step": step, **clean}
        self._jsonl.write(json.dumps(record) + "\n")
        numbers = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.log_scalars(step, numbers)
        if self._progress is not None:
            self._progress.update(step, format_stats(numbers))

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        """Scalars to TensorBoard and wandb only: :meth:`log`'s, and extra ones of a step already logged (the
        stability guard's), since ``metrics.jsonl`` keeps one record per step."""
        if not self.enabled:
            return
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Append a few decoded trajectories to ``samples.jsonl`` (for reading what the policy does); a NaN/inf reward
        or advantage is written as a string, as in ``metrics.jsonl`` (bare ``NaN`` is not JSON: a browser's parser,
        the viewer's, refuses the whole response)."""
        if not self.enabled or not samples:
            return
        rows = [{"step": step, **{k: _plain(v) for k, v in s.items()}} for s in samples]
        append_jsonl(self.run_dir / SAMPLES_FILE, rows, escape_non_ascii=True, durable=False)

    def message(self, text: str) -> None:
        """A line above the progress bar (or on the console's stderr: :func:`emapg.console.echo`)."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.message(text)
        else:
            echo(text)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        self._jsonl.close()


def format_stats(metrics: dict[str, float]) -> str:
    parts = []
    for key, label, fmt in PROGRESS_FIELDS:
        if key in metrics and math.isfinite(metrics[key]):
            parts.append(f"{label}={fmt.format(metrics[key])}")
    return " ".join(parts)


def _plain(v: Any) -> Any:
    if hasattr(v, "item") and callable(v.item):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible as strings
    return v
