"""Start and stop a retrieval server process (for the trainer, the evaluator, tests and the demo).

    with RetrieverServer("indexes/wiki_mini") as server:
        client = RetrieverClient(server.url)

The server runs as ``emapg serve`` in its own process group (so stopping it also
stops anything it spawned); output goes to a log file whose tail is quoted in every error.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


class ServerStartError(RuntimeError):
    """The server process exited or did not become healthy in time."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: Path, n_bytes: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "(no log)"
    return data[-n_bytes:].decode("utf-8", "replace").strip() or "(empty log)"


class RetrieverServer:
    """Context manager around an ``emapg serve`` subprocess.

    Args:
        index_dir: index built by ``emapg index build``.
        host, port: where to bind; ``port=None`` picks a free port.
        topk, max_batch, max_wait_ms, api_key, device: passed to ``emapg serve``.
        extra_args: more ``emapg serve`` options, e.g. ``["--hybrid-bm25"]``.
        omp_num_threads: ``OMP_NUM_THREADS`` for the server (default: inherit, else 1 on 2-core boxes).
        startup_timeout: seconds to wait for ``/health`` == 200.
        log_path: server stdout/stderr file (default: a temp file, kept for post-mortems).
    """

    def __init__(
        self,
        index_dir: str | Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        topk: int = 3,
        max_batch: int = 64,
        max_wait_ms: float = 5.0,
        api_key: str | None = None,
        device: str = "cpu",
        extra_args: list[str] | None = None,
        omp_num_threads: int | None = None,
        startup_timeout: float = 180.0,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
    ):
        self.index_dir = Path(index_dir)
        self.host = host
        self.port = port
        self.api_key = api_key
        self.startup_timeout = startup_timeout
        self.args = [
            "--index", str(self.index_dir), "--host", host, "--topk", str(topk), "--max-batch", str(max_batch),
            "--max-wait-ms", str(max_wait_ms), "--device", device, *(extra_args or []),
        ]  # fmt: skip
        self.env = dict(os.environ if env is None else env)
        if omp_num_threads is not None:
            self.env["OMP_NUM_THREADS"] = str(omp_num_threads)
        self.env.setdefault("OMP_NUM_THREADS", "1" if (os.cpu_count() or 1) <= 2 else str(min(8, os.cpu_count() or 1)))
        self.env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.env.setdefault("HF_HUB_OFFLINE", "1")
        if api_key:
            self.env["EMAPG_RETRIEVER_API_KEY"] = api_key  # not on the command line: `ps` shows argv
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="emapg-retriever-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> "RetrieverServer":
        if self.proc is not None:
            raise RuntimeError("server already started")
        fixed_port = self.port is not None
        for attempt in range(3):  # a free port can be taken between probing and binding
            if not fixed_port:
                self.port = free_port(self.host if self.host not in ("0.0.0.0", "") else "127.0.0.1")
            try:
                self._start_once()
                return self
            except ServerStartError as e:
                if fixed_port or "address already in use" not in str(e).lower() or attempt == 2:
                    raise
        return self

    def _start_once(self) -> None:
        cmd = [*emapg_command(), "serve", *self.args, "--port", str(self.port)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True, cwd=_repo_root())
        deadline = time.monotonic() + self.startup_timeout
        headers = {"X-API-Key": self.api_key} if self.api_key else {}
        with httpx.Client(timeout=2.0, headers=headers) as http:
            while True:
                code = self.proc.poll()
                if code is not None:
                    self.proc = None
                    raise ServerStartError(f"retrieval server exited with code {code} before becoming healthy; log tail:\n{_tail(self.log_path)}")
                try:
                    if http.get(self.url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerStartError(
                        f"retrieval server not healthy after {self.startup_timeout:.0f} s at {self.url}; log tail:\n{_tail(self.log_path)}"
                    )
                time.sleep(0.2)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it if it lingers."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass

    def log_tail(self) -> str:
        return _tail(self.log_path)

    def __enter__(self) -> "RetrieverServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def emapg_command() -> list[str]:
    """argv prefix that runs the ``emapg`` CLI with this interpreter, installed or not.

    Not ``python -m emapg.cli``: that runs the module as ``__main__``, whose ``UserError`` class is
    not the one the subcommands raise, so user errors would print tracebacks instead of one line.
    """
    return [sys.executable, "-c", "import sys; from emapg.cli import main; sys.exit(main(sys.argv[1:]))"]


def _repo_root() -> str:
    from emapg.paths import REPO_ROOT

    return str(REPO_ROOT)
