"""Progress of long work, one way for every command: a bar on a terminal, a plain line per step otherwise, nothing
when quiet.

Output redirected to a file (CI, ``nohup``, ``make demo`` logs) gets one line per step -- ``train 3/8 [0:01:42] reward=...``
-- where a bar would print nothing until the end; a terminal gets a ``rich`` bar with the same fields. Used by
``emapg train`` (through :class:`trainer.tracking.Tracker`), ``emapg sft`` and ``emapg eval``. By default it writes to
:func:`emapg.console.stream`: stderr, and the terminal's stderr while library output goes to the run's log.
"""

from __future__ import annotations

import time
from typing import Literal, TextIO

from emapg import console

Mode = Literal["auto", "bar", "lines", "off"]


def resolve_mode(mode: Mode, stream: TextIO) -> Literal["bar", "lines", "off"]:
    if mode != "auto":
        return mode
    isatty = getattr(stream, "isatty", None)
    return "bar" if isatty is not None and isatty() else "lines"


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class StepProgress:
    """``label`` advancing to ``total``; :meth:`update` after each step with the step's short stats.

    ``min_interval_s``: in line mode, print at most this often (the last step always prints); 0: every update.
    """

    def __init__(self, label: str, total: int, *, start: int = 0, mode: Mode = "auto", stream: TextIO | None = None,
                 unit: str = "step", min_interval_s: float = 0.0) -> None:
        self.label, self.total, self.done, self.unit = label, total, start, unit
        self.stream = stream or console.stream()  # the terminal, also while library output goes to a log
        self.mode = resolve_mode(mode, self.stream)
        self.min_interval_s = min_interval_s
        self._t0 = time.monotonic()
        self._last_line = float("-inf")
        self._bar = None
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn(f"[bold]{label}"), BarColumn(bar_width=24), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.fields[stats]}"), console=Console(file=self.stream),
                                 transient=False, redirect_stdout=False, redirect_stderr=False)
            self._bar.start()
            self._task = self._bar.add_task(label, total=total, completed=start, stats="")

    def update(self, done: int, stats: str = "") -> None:
        self.done = done
        if self._bar is not None:
            self._bar.update(self._task, completed=done, stats=stats)
        elif self.mode == "lines":
            now = time.monotonic()
            if now - self._last_line >= self.min_interval_s or done >= self.total:
                self._last_line = now
                line = f"{self.label} {done}/{self.total} {self.unit}s [{_clock(now - self._t0)}]" + (f" {stats}" if stats else "")
                print(line, file=self.stream, flush=True)

    def advance(self, n: int = 1, stats: str = "") -> None:
        self.update(self.done + n, stats)

    def message(self, text: str) -> None:
        """A line above the bar (or on the stream); shown even when quiet: warnings go through here."""
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
