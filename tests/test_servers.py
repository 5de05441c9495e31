"""emapg.servers: a server started by ServerProcess does not outlive the process that started it.

A real launcher process starts a real ``emapg serve`` from a pool thread (the thread then ends, which
must not stop the server), and is then killed with SIGKILL, which runs no cleanup at all.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from emapg.servers import LAUNCHER_POLL_S, watch_launcher

LAUNCHER = """
import sys, time
from concurrent.futures import ThreadPoolExecutor
from retriever.launch import RetrieverServer
index, log = sys.argv[1], sys.argv[2]
with ThreadPoolExecutor(1) as pool:  # started from a thread that ends long before the launcher
    server = pool.submit(lambda: RetrieverServer(index, omp_num_threads=1, device="cpu", log_path=log).start()).result()
print(server.port, server.proc.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state  # exited, not yet reaped by whoever adopted it


def test_a_server_exits_by_itself_when_its_launcher_is_killed(retriever_index, tmp_path):
    log = tmp_path / "server.log"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(retriever_index.index_dir), str(log)], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    server_pid = None
    try:
        port, server_pid = map(int, launcher.stdout.readline().split())
        time.sleep(2 * LAUNCHER_POLL_S)  # two of the watcher's polls: the pool thread that started it has ended
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 60
        while not _gone(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(server_pid), f"the server outlived its launcher; log:\n{log.read_text()[-2000:]}"
        assert f"the process that started this server (pid {launcher.pid}) has exited; shutting down" in log.read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if server_pid is not None and not _gone(server_pid):
            os.killpg(server_pid, signal.SIGKILL)


def test_watch_launcher_shuts_down_once_the_parent_is_another_process():
    called = threading.Event()
    not_my_parent = os.getppid() + 1_000_000  # no process has this pid: as after the launcher exited
    watch_launcher(not_my_parent, called.set, logging.getLogger("test"), poll_s=0.01)
    assert called.wait(10)

