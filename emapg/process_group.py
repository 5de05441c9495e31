"""Stopping a child started in its own session (``start_new_session=True``) together with all it started.

Reaping the group's leader is not enough: a signalled grandchild (vLLM's engine core, a server's
workers) can still be running, holding a port or GPU memory, after its parent has been reaped.
``stop_process_group`` returns once nothing in the group runs any more (zombies waiting for a
reaper excluded). Group members are read from ``/proc`` (Linux); where there is none, only the
leader is waited for.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

POLL_S = 0.02
KILL_WAIT_S = 10.0


def live_group_members(pgid: int) -> list[int]:
    """Pids in process group ``pgid`` that are still running (zombies excluded)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(") ", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
        if state != "Z" and int(group) == pgid:
            members.append(int(stat.parent.name))
    return members


def wait_group_gone(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait until ``proc`` is reaped and no other member of its group runs; False at the timeout."""
    deadline = time.monotonic() + timeout_s
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    while live_group_members(proc.pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def stop_process_group(proc: subprocess.Popen, first_signal: int = signal.SIGTERM, grace_s: float = 15.0,
                       kill_wait_s: float = KILL_WAIT_S) -> bool:
    """Send ``first_signal`` to ``proc``'s group; SIGKILL the group if any of it runs after ``grace_s``.

    ``proc`` must lead its own process group. Returns True once the whole group has exited, False if
    something outlived the SIGKILL by ``kill_wait_s`` (a process stuck in the kernel); never blocks
    longer than ``grace_s + kill_wait_s``.
    """
    for sig, wait in ((first_signal, grace_s), (signal.SIGKILL, kill_wait_s)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # leader reaped and nothing left in the group
            proc.poll()
            return True
        if wait_group_gone(proc, wait):
            return True
    return False
