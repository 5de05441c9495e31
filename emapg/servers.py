"""What the project's HTTP servers (the retriever, the generation engine) share.

* :func:`run_uvicorn`: the in-process side of ``emapg serve`` / ``emapg engine serve``;
  :class:`HTTPError`, :func:`api_key_ok`, :func:`read_body`: pieces of their request handlers.
* :class:`ServerProcess`: start one of them as a subprocess, wait for ``/health``, stop it
  (``retriever.launch.RetrieverServer``, ``agent.engines.launch.EngineServer``).
* :func:`response_error`: how their clients quote a failed response.
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from emapg.paths import REPO_ROOT

if TYPE_CHECKING:
    from starlette.requests import Request
    from typing_extensions import Self  # typing.Self needs Python 3.11

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def run_uvicorn(create_app: Callable[..., Any], cfg: Any, *, log: logging.Logger, exposes: str, banner: str) -> int:
    """Serve ``create_app(cfg, on_fatal=...)`` on ``cfg.host:cfg.port`` until interrupted; returns the exit code.

    ``cfg`` needs ``host``, ``port``, ``api_key`` and ``log_level``. ``exposes`` completes the warning for
    a non-loopback bind without an API key ("anyone who can reach this port can ..."); ``banner`` is logged
    just before serving. The code is 1 when the app reported a fatal error (``on_fatal``) or uvicorn returned
    without starting, else 0; when it cannot bind the port, uvicorn logs why and exits the process itself (code 3).
    """
    import uvicorn

    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exit_code = {"code": 0}
    server: uvicorn.Server | None = None

    def on_fatal(message: str) -> None:
        exit_code["code"] = 1
        if server is not None:
            server.should_exit = True

    app = create_app(cfg, on_fatal=on_fatal)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False, timeout_keep_alive=60, backlog=4096)
    server = uvicorn.Server(config)
    if cfg.host not in LOOPBACK_HOSTS and not cfg.api_key:
        log.warning("binding %s without an API key: anyone who can reach this port can %s", cfg.host, exposes)
    log.info("%s", banner)
    server.run()
    if not server.started and exit_code["code"] == 0:
        return 1
    return exit_code["code"]


class HTTPError(Exception):
    """A request the server refuses: answered with ``status`` and ``{"detail": message}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def api_key_ok(request: Request, api_key: str | None) -> bool:
    """Whether ``request`` carries ``api_key`` (``Authorization: Bearer KEY`` or ``X-API-Key: KEY``); True when there is no key."""
    if not api_key:
        return True
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    return hmac.compare_digest(given.encode(), api_key.encode())


async def read_body(request: Request, limit: int, hint: str = "") -> bytes:
    """The request body, or :class:`HTTPError` 413 (message ending in ``hint``) once it exceeds ``limit`` bytes.

    Checks the declared Content-Length first and counts while streaming, so an oversized body is never held whole.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, f"body of {declared} bytes exceeds the limit of {limit} bytes{hint}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"body exceeds the limit of {limit} bytes{hint}")
        chunks.append(chunk)
    return b"".join(chunks)


class ServerStartError(RuntimeError):
    """The server process exited or did not become healthy in time."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: Path, n_bytes: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "(no log)"
    return data[-n_bytes:].decode("utf-8", "replace").strip() or "(empty log)"


def emapg_command() -> list[str]:
    """argv prefix that runs the ``emapg`` CLI with this interpreter, installed or not.

    Not ``python -m emapg.cli``: that runs the module as ``__main__``, whose ``UserError`` class is
    not the one the subcommands raise, so user errors would print tracebacks instead of one line.
    """
    return [sys.executable, "-c", "import sys; from emapg.cli import main; sys.exit(main(sys.argv[1:]))"]


class ServerProcess:
    """Context manager around an ``emapg <subcommand> ... --port N`` subprocess.

    The process runs in its own process group (so stopping it also stops anything it spawned);
    its output goes to ``log_path`` (default: a temp file, kept for post-mortems), whose tail is
    quoted in every error. ``port=None`` picks a free port, and picks another one if the server
    reports "address already in use" (a free port can be taken between probing and binding).
    Subclasses set ``what`` (named in errors), ``subcommand`` and ``stop_timeout``.
    """

    what = "server"
    subcommand: tuple[str, ...] = ()
    stop_timeout = 15.0

    def __init__(
        self,
        args: list[str],
        *,
        host: str,
        port: int | None,
        api_key: str | None,
        env: dict[str, str],
        startup_timeout: float,
        log_path: str | Path | None,
        log_prefix: str,
    ) -> None:
        self.host = host
        self.port = port
        self.api_key = api_key
        self.args = args
        self.env = env
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix=log_prefix, suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> Self:
        if self.proc is not None:
            raise RuntimeError("server already started")
        fixed_port = self.port is not None
        for attempt in range(3):
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
        cmd = [*emapg_command(), *self.subcommand, *self.args, "--port", str(self.port)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True, cwd=str(REPO_ROOT))
        deadline = time.monotonic() + self.startup_timeout
        headers = {"X-API-Key": self.api_key} if self.api_key else {}
        with httpx.Client(timeout=2.0, headers=headers) as http:
            while True:
                code = self.proc.poll()
                if code is not None:
                    self.proc = None
                    raise ServerStartError(f"{self.what} exited with code {code} before becoming healthy; log tail:\n{self.log_tail()}")
                try:
                    if http.get(self.url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerStartError(f"{self.what} not healthy after {self.startup_timeout:.0f} s at {self.url}; log tail:\n{self.log_tail()}")
                time.sleep(0.2)

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM the process group, SIGKILL it if it lingers (after ``timeout``, default ``stop_timeout``)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(self.stop_timeout if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass

    def log_tail(self) -> str:
        return log_tail(self.log_path)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def response_error(resp: httpx.Response, limit: int) -> str:
    """``HTTP <status> from <url>: <detail>`` for a failed response, the detail cut to ``limit`` characters."""
    try:
        detail = resp.json().get("detail", resp.text)
    except ValueError:
        detail = resp.text
    return f"HTTP {resp.status_code} from {resp.request.url}: {str(detail)[:limit]}"
