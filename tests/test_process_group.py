"""stop_process_group: returns only when nothing in the child's process group runs any more."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from emapg.process_group import live_group_members, stop_process_group

# The leader starts one grandchild, which sets how it reacts to SIGTERM, then writes its own pid.
LEADER = """
import subprocess, sys, time
pid_file, behaviour = sys.argv[1], sys.argv[2]
on_term = {"slow": "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.5), exit(0)))",
           "ignore": "signal.signal(signal.SIGTERM, signal.SIG_IGN)",
           "zombie": "pass"}[behaviour]
lifetime = 0 if behaviour == "zombie" else 60
subprocess.Popen([sys.executable, "-c", f"import os, signal, time; {on_term}; "
                  f"open({pid_file!r}, 'w').write(str(os.getpid())); time.sleep({lifetime})"])
time.sleep(60)
"""


def _start(tmp_path: Path, grandchild: str) -> tuple[subprocess.Popen, int]:
    pid_file = tmp_path / "grandchild.pid"
    proc = subprocess.Popen([sys.executable, "-c", LEADER, str(pid_file), grandchild], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (pid_file.is_file() and pid_file.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "the leader did not start its grandchild"
        time.sleep(0.02)
    return proc, int(pid_file.read_text())


def _running(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return not stat.read_text().rsplit(") ", 1)[1].startswith("Z")
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_waits_for_a_grandchild_that_outlives_its_parent_on_sigterm(tmp_path):
    proc, grandchild = _start(tmp_path, "slow")
    assert sorted(live_group_members(proc.pid)) == sorted([proc.pid, grandchild])
    assert stop_process_group(proc, signal.SIGTERM, grace_s=10)
    assert proc.returncode == -signal.SIGTERM
    assert not _running(grandchild)  # reaping the leader alone would leave it running for 0.5 s
    assert live_group_members(proc.pid) == []


def test_sigkills_what_ignores_the_first_signal(tmp_path):
    proc, grandchild = _start(tmp_path, "ignore")
    t0 = time.monotonic()
    assert stop_process_group(proc, signal.SIGTERM, grace_s=0.5)
    assert time.monotonic() - t0 >= 0.5  # it waited the grace out before SIGKILL
    assert not _running(grandchild) and live_group_members(proc.pid) == []


def test_zombies_do_not_count_and_a_finished_group_returns_at_once(tmp_path):
    proc, grandchild = _start(tmp_path, "zombie")  # the leader never reaps its finished child
    deadline = time.monotonic() + 30
    while _running(grandchild):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert Path(f"/proc/{grandchild}/stat").exists()  # a zombie: still in the process table
    assert live_group_members(proc.pid) == [proc.pid]
    assert stop_process_group(proc, signal.SIGTERM, grace_s=10)
    assert stop_process_group(proc, signal.SIGTERM, grace_s=10)  # again, on a group that is gone
