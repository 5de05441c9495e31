"""The console keeps our lines; library output goes to the run's log file.

``emapg eval``, ``emapg train`` and ``emapg sft`` run their work inside :func:`library_output_to`. While it is
active:

* file descriptors 1 and 2 point at the log file, so everything written there goes to the log: ``print`` and
  ``sys.stdout``/``sys.stderr`` writes of libraries (tqdm bars, the handlers vLLM and transformers attach to the
  standard streams), C-level output (torch, OpenMP), and every subprocess that inherits them (vLLM's EngineCore,
  a retriever server the run launches);
* Python's root logger writes INFO and above to the log, and ``warnings`` (torch's ``FutureWarning``, ...) are
  captured into it through ``logging.captureWarnings``;
* our own output -- :class:`emapg.progress.StepProgress` bars and lines, :func:`echo`, and the records of our
  own packages' loggers (:data:`OWN_PACKAGES`, INFO and above, as ``name: message``) -- goes to :func:`stream`,
  a copy of the terminal's stderr taken on entry.

On exit the descriptors are put back, so what the command prints afterwards (result tables, the one-line
``UserError``, the traceback of a crash) reaches the terminal as before. A crash's traceback is also written to
the log, and the console is told where the log is. Each command names its log in its ``--help``.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

#: The top-level packages whose loggers are ours: their records reach the console too (the layering's list).
OWN_PACKAGES = ("emapg", "tasks", "retriever", "agent", "provision", "trainer", "eval", "app")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_console: TextIO | None = None  # the terminal's stderr while library output goes to a log


def stream() -> TextIO:
    """Where our own lines go: the terminal while :func:`library_output_to` is active, else ``sys.stderr``."""
    return _console if _console is not None else sys.stderr


def echo(text: str) -> None:
    """One line of ours on the console (stderr), also while library output goes to a log."""
    print(text, file=stream(), flush=True)


def rank_log_name(stem: str) -> str:
    """``<stem>.log`` on the main process, ``<stem>.rank<N>.log`` on the other ranks of a torchrun job."""
    rank = os.environ.get("RANK", "0")
    return f"{stem}.log" if rank in ("", "0") else f"{stem}.rank{rank}.log"


class _OwnRecords(logging.Handler):
    """Records of our own loggers, on the console as ``name: message`` (``name: warning: message`` and so on)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.partition(".")[0] in OWN_PACKAGES and super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
            text = f"{record.name}: {level}{record.getMessage()}"
            if record.exc_info:
                text += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
            echo(text)
        except Exception:  # noqa: BLE001 -- logging must never raise
            self.handleError(record)


def _writes_to_fd(s: object, fd: int) -> bool:
    try:
        return s.fileno() == fd  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return False


@contextmanager
def library_output_to(path: str | os.PathLike[str], *, title: str = "", discard_unused: bool = False) -> Iterator[Path]:
    """Library output to the log file ``path`` (appended to) while the body runs; our own lines on the console.

    ``title`` heads this run's part of the log. ``discard_unused``: when the body raises a ``UserError`` or
    ``ConfigError`` (nothing ran) and this call created the log's folder, remove the folder again if the log is
    all it holds, so a refused command leaves nothing behind.
    """
    global _console
    from emapg.errors import ConfigError, UserError

    log_path = Path(path)
    created = not log_path.parent.exists()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "a", buffering=1, encoding="utf-8", errors="replace")
    log.write(f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} {title or 'emapg'} (pid {os.getpid()}) =====\n")
    log.flush()
    for s in (sys.stdout, sys.stderr):
        s.flush()
    # our console: a copy of the terminal's stderr when sys.stderr writes to fd 2, else sys.stderr itself
    # (pytest's capture, a caller's wrapper)
    own_copy = _writes_to_fd(sys.stderr, 2)
    console = (os.fdopen(os.dup(2), "w", buffering=1, encoding=getattr(sys.stderr, "encoding", None) or "utf-8",
                         errors="backslashreplace") if own_copy else sys.stderr)
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    root = logging.getLogger()
    old_level = root.level
    was_capturing = getattr(logging, "_warnings_showwarning", None) is not None
    to_log = logging.StreamHandler(log)
    to_log.setFormatter(logging.Formatter(LOG_FORMAT))
    own = _OwnRecords()
    previous_console = _console
    failure: BaseException | None = None
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        _console = console
        if root.level > logging.INFO:  # (NOTSET on the root: everything already)
            root.setLevel(logging.INFO)
        root.addHandler(to_log)
        root.addHandler(own)
        logging.captureWarnings(True)
        yield log_path
    except BaseException as e:
        failure = e
        if not isinstance(e, (UserError, ConfigError, SystemExit)):
            log.write("".join(traceback.format_exception(e)))
        raise
    finally:
        if not was_capturing:
            logging.captureWarnings(False)
        root.removeHandler(own)
        root.removeHandler(to_log)
        root.setLevel(old_level)
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except (OSError, ValueError):
                pass
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        _console = previous_console
        if own_copy:
            console.close()
        log.close()
        if isinstance(failure, (UserError, ConfigError)):
            if discard_unused and created and [p.name for p in log_path.parent.iterdir()] == [log_path.name]:
                log_path.unlink()
                log_path.parent.rmdir()
        elif failure is not None and not isinstance(failure, SystemExit):
            print(f"(library output of this run: {log_path})", file=sys.stderr, flush=True)
