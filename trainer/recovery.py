"""The stability guard's step hook: run the detectors (:mod:`trainer.guard`) on every step and act.

:class:`GuardHook` is appended to :attr:`trainer.loop.Trainer.step_hooks` when ``guard.enabled``. After
each step's metrics are logged it asks :class:`trainer.guard.Guard` for trips and carries out the most
severe action among them (``warn`` < ``lower_lr`` < ``reset_to_anchor`` < ``rollback`` < ``stop``):

* ``warn``: a console line and the event record;
* ``lower_lr``: the learning rate (and the schedule's base, so the schedule does not undo it) times
  ``guard.lr_factor``;
* ``reset_to_anchor``: the EMA anchor -- a smoothed past policy -- is copied into the policy, and the
  optimizer's moments (accumulated on the way into the collapse) are cleared;
* ``rollback``: the newest checkpoint whose ``trainer_state.json`` says it passed the guard, and whose
  weights passed it too (the step after it passed: :func:`last_passing_checkpoint`), is restored (weights, optimizer, LR schedule, anchor, the guard's window) while the data loader keeps
  its position, so the batches that led to the trip are skipped; the step counter keeps counting
  (``run.total_steps`` counts every step run, lost ones included). Without such a checkpoint it falls
  back to ``reset_to_anchor`` (or ``stop`` without an anchor);
* ``stop``: :class:`trainer.errors.TrainingError` with the report of every event.

After ``guard.max_recoveries`` recoveries, the next trip that asks for one stops the run instead.

Every event goes to the console, to ``<run>/guard.jsonl`` (one JSON object per line), and as
``guard/*`` scalars to TensorBoard/wandb; ``emapg plot`` marks them on the curves; the run ends with
a summary. Checkpoints record ``guard.passed`` (no trip at the saved step) in ``trainer_state.json``.
Rollback and reset act on a single process's unsharded policy (``GuardHook`` refuses them under FSDP).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from emapg.config import ConfigError
from emapg.jsonl import append_jsonl, read_jsonl
from trainer.errors import TrainingError
from trainer.guard import Guard, GuardConfig, GuardEvent

if TYPE_CHECKING:
    from trainer.checkpoint import Checkpoint
    from trainer.distributed import DistInfo
    from trainer.tracking import Tracker

log = logging.getLogger(__name__)

GUARD_FILE = "guard.jsonl"
SEVERITY = ("warn", "lower_lr", "reset_to_anchor", "rollback", "stop")
RECOVERIES = ("lower_lr", "reset_to_anchor", "rollback")

__all__ = ["GUARD_FILE", "GuardHook", "GuardedTrainer", "read_guard_events", "last_passing_checkpoint"]


class GuardedTrainer(Protocol):
    """What the guard uses of the run (:class:`trainer.loop.Trainer` is one): where it is and writes, and the
    recoveries as its methods (the guard never touches the optimizer, the anchor or the engine itself)."""

    step: int
    run_dir: Path
    dist: DistInfo
    tracker: Tracker | None

    def message(self, text: str) -> None: ...

    def lower_lr(self, factor: float) -> float: ...

    def reset_to_anchor(self) -> None: ...

    def roll_back(self, path: Path) -> Checkpoint: ...


def read_guard_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """The events of ``<run_dir>/guard.jsonl`` ([] when the run has none)."""
    path = Path(run_dir) / GUARD_FILE
    if not path.is_file():
        return []
    return read_jsonl(path)  # a line cut by a kill mid-write is skipped


class _NoRecovery(Exception):
    """The action a trip asked for cannot be carried out: the guard stops the run instead (the message says why)."""


def last_passing_checkpoint(run_dir: Path, verdicts: dict[int, bool]) -> Path | None:
    """The newest intact checkpoint of ``run_dir`` that passed the guard *and whose weights did too*.

    A checkpoint of step s records whether step s passed, but its weights come out of update s and are
    first tried by the rollout of step s + 1: a checkpoint is trusted only when ``verdicts[s + 1]`` (the
    guard's verdict on that step, in this process) is True as well. So after a bad update at step t-1
    (seen at step t) the checkpoint of step t-1 is never the target.
    """
    from trainer.checkpoint import list_checkpoints, load_trainer_state, verify_checkpoint

    for path in reversed(list_checkpoints(run_dir)):
        try:
            state = load_trainer_state(path)
        except Exception:  # noqa: BLE001 - a damaged checkpoint is skipped like latest_checkpoint does
            continue
        step = int(state.get("step", -1))
        if (state.get("guard") or {}).get("passed") and verdicts.get(step + 1) and verify_checkpoint(path, verify="size").intact:
            return path
    return None


class GuardHook:
    """The step hook that runs the guard and carries out its actions on the trainer."""

    def __init__(self, cfg: GuardConfig, *, fsdp: bool, has_anchor: bool) -> None:
        acts = cfg.actions()
        if fsdp and acts & {"rollback", "reset_to_anchor"}:
            raise ConfigError("guard: rollback and reset_to_anchor need a single-process (unsharded) run; use warn, lower_lr or stop under FSDP")
        if not has_anchor and "reset_to_anchor" in acts:
            raise ConfigError("guard: reset_to_anchor needs the EMA anchor (algorithm.kl.enabled=true)")
        self.cfg = cfg
        self.guard = Guard(cfg)
        self.has_anchor = has_anchor
        self.actions_taken: list[GuardEvent] = []
        self.verdicts: dict[int, bool] = {}  # step -> passed, for choosing a rollback target

    # ------------------------------------------------------------------ the hook
    def __call__(self, trainer: GuardedTrainer, metrics: dict[str, float]) -> None:
        trips = self.guard.check(trainer.step, metrics)
        self.verdicts[trainer.step] = not trips
        if trainer.tracker is not None:
            trainer.tracker.log_scalars(trainer.step, {"guard/trips": float(len(trips)), "guard/passed": float(not trips)})
        if not trips:
            return
        action = max((e.action for e in trips), key=SEVERITY.index)
        if action in RECOVERIES and self.guard.recoveries >= self.cfg.max_recoveries:
            action = "stop"
            detail = f"{self.cfg.max_recoveries} recoveries already (guard.max_recoveries)"
        else:
            try:
                detail = self._act(trainer, action)
            except _NoRecovery as e:  # recorded like any stop, then the run ends
                action, detail = "stop", str(e)
        for e in trips:
            e.detail = f"{action}: {detail}" if e is trips[0] else f"{action} (see {trips[0].detector})"
            self._record(trainer, e)
        self.actions_taken.append(trips[0])
        if action == "stop":
            raise TrainingError(f"stability guard stopped the run at step {trainer.step}: "
                                + "; ".join(e.describe() for e in trips) + "\n" + self.report())

    def _act(self, trainer: GuardedTrainer, action: str) -> str:
        if action == "warn":
            return "logged"
        if action == "stop":
            return "stopping"
        self.guard.recoveries += 1
        if action == "lower_lr":
            return self._lower_lr(trainer)
        if action == "rollback":
            target = last_passing_checkpoint(trainer.run_dir, self.verdicts)
            if target is not None:
                return self._rollback(trainer, target)
            if not self.has_anchor:
                raise _NoRecovery(f"rollback impossible: no checkpoint in {trainer.run_dir} passed the guard with its next "
                                  "step (none yet, or run.keep_last removed them) and there is no anchor")
            return "no checkpoint passed the guard yet; " + self._reset_to_anchor(trainer)
        return self._reset_to_anchor(trainer)

    # ------------------------------------------------------------------ actions (methods of the trainer)
    def _lower_lr(self, trainer: GuardedTrainer) -> str:
        return f"learning rate now {trainer.lower_lr(self.cfg.lr_factor):.3g}"

    def _reset_to_anchor(self, trainer: GuardedTrainer) -> str:
        trainer.reset_to_anchor()
        return "policy reset to the EMA anchor, optimizer moments cleared"

    def _rollback(self, trainer: GuardedTrainer, path: Path) -> str:
        try:
            ckpt = trainer.roll_back(path)
        except TrainingError as e:
            raise TrainingError(f"guard rollback: {e}") from e
        self.guard.load_state_dict({**(ckpt.trainer_state.get("guard") or {}), "recoveries": self.guard.recoveries})
        # The weights now are the restored ones, which passed: a checkpoint saved from them (at this step) is a
        # rollback target once the next step passes too. Marked failed, as before 2026-12-06, it never was, and with
        # a small run.keep_last the older passing checkpoints were pruned: the next trip found no target at all.
        self.guard.last_passed = True
        # The data loader is not restored: it stays past the batches that led to the trip.
        return f"restored {path.name} (step {ckpt.step}); batches of steps {ckpt.step + 1}-{trainer.step} skipped"

    # ------------------------------------------------------------------ records
    def _record(self, trainer: GuardedTrainer, event: GuardEvent) -> None:
        trainer.message(f"[guard] {event.describe()} -> {event.detail}")
        if not trainer.dist.is_main:
            return
        record = {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in asdict(event).items()}
        append_jsonl(Path(trainer.run_dir) / GUARD_FILE, [record], escape_non_ascii=True)  # NaN/inf as strings, as in metrics.jsonl
        if trainer.tracker is not None:
            trainer.tracker.log_scalars(trainer.step, {f"guard/{event.detector}": 1.0,
                                                       f"guard/action_{event.action}": 1.0})

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint records: whether its step passed, and the window to restore on rollback."""
        return self.guard.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state)

    def report(self) -> str:
        """The end-of-run summary: trips per detector, actions, and the first few events."""
        events = self.guard.events
        if not events:
            return "stability guard: no trips"
        per = Counter(e.detector for e in events)
        acts = Counter(e.action for e in self.actions_taken)
        lines = [f"stability guard: {len(events)} trip(s) over {len({e.step for e in events})} step(s); "
                 + ", ".join(f"{d} x{n}" for d, n in per.items()) + "; actions: " + ", ".join(f"{a} x{n}" for a, n in acts.items())]
        lines += [f"  {e.describe()} -> {e.detail}" for e in events[:10]]
        if len(events) > 10:
            lines.append(f"  ... {len(events) - 10} more in {GUARD_FILE}")
        return "\n".join(lines)

    def finish(self, trainer: GuardedTrainer) -> None:
        """The run's summary line(s), at the end of :meth:`trainer.loop.Trainer.train`."""
        trainer.message(self.report())
