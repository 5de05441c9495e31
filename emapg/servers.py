"""What the project's HTTP servers (the retriever, the generation engine) share, outside a request.

* :class:`ServerOptions`: the options both ``emapg serve`` and ``emapg engine serve`` take (bind
  address, API key from a file or the environment, header and body bounds, idle connections, log
  level), with the refusal to serve a non-loopback address without a key; :func:`run_uvicorn`: the
  in-process side of both (its connections guarded by :mod:`emapg.connection_guard`).
  What a request handler does with its input is in :mod:`emapg.server_input`.
* :class:`ServerProcess`: start one of them as a subprocess, wait for ``/health``, stop it
  (``retriever.launch.RetrieverServer``, ``agent.engines.launch.EngineServer``); a server it started
  shuts down by itself when the starting process dies without stopping it (:func:`watch_launcher`).
* :func:`response_error`: how their clients quote a failed response.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx

from emapg import CLI_MODULE
from emapg.config import ConfigError, option
from emapg.connection_guard import MAX_HEAD_BYTES, guarded_protocol
from emapg.paths import REPO_ROOT
from emapg.process_group import stop_process_group

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(kw_only=True)
class ServerOptions:
    """Options every server command shares: where to bind, the API key, header and body bounds, idle
    connections, logging.

    The API key comes from ``--api-key-file`` or the environment variable ``--api-key-env`` names
    (the ways to use); ``--api-key KEY`` still works but puts the key in the process list, where
    every local user can read it. A server bound to anything but loopback refuses to start without
    a key unless ``--insecure`` says that is intended (e.g. inside a container whose port is
    published on 127.0.0.1 only).
    """

    host: str = option("127.0.0.1", help="address to bind; any address but loopback needs an API key (or --insecure)")
    port: int = option(8000, help="TCP port")
    api_key_file: str | None = option(None, help="file holding the API key requests must send as 'Authorization: Bearer KEY' "
                                                 "or 'X-API-Key: KEY' (recommended, like the environment variable)")  # fmt: skip
    api_key_env: str = option("EMAPG_API_KEY", help="environment variable holding the API key when no --api-key-file is given "
                                                    "(unset or empty: no key)")  # fmt: skip
    api_key: str | None = option(None, help="the API key itself; discouraged: a command line is visible to every local user "
                                            "(ps), use --api-key-file or the environment variable")  # fmt: skip
    insecure: bool = option(False, help="serve a non-loopback address without an API key (anyone who can reach the port "
                                        "can use every endpoint)")  # fmt: skip
    body_timeout: float = option(60.0, gt=0, help="seconds a client may take to send a request body; then it gets 408 "
                                                  "and the connection is closed")  # fmt: skip
    header_timeout: float = option(10.0, gt=0, help="seconds a connection may take to send a request's headers, counted "
                                                    "from its opening or, kept alive, from the previous answer; then it is "
                                                    "closed, with a 408 if part of a request came (slow or idle clients)")  # fmt: skip
    max_idle_connections: int = option(256, ge=1, help="most open connections without a request in progress (awaiting or "
                                                       "reading headers, or kept alive); one more closes the longest idle one")  # fmt: skip
    max_body_bytes: int = option(4 << 20, help="reject request bodies larger than this many bytes")
    log_level: Literal["debug", "info", "warning", "error"] = option("info", help="log level")

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port} is not a TCP port")
        if self.max_body_bytes < 1:
            raise ConfigError("--max-body-bytes must be at least 1")
        if self.api_key_file and self.api_key:
            raise ConfigError("give the API key once: --api-key-file or --api-key, not both")

    def api_key_value(self) -> str | None:
        """The key requests must carry (from the file, the command line or the environment), or None."""
        if self.api_key_file:
            path = Path(self.api_key_file).expanduser()
            try:
                key = path.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"--api-key-file {path}: cannot read it ({type(e).__name__}: {e})") from None
            if not key or "\n" in key:
                raise ConfigError(f"--api-key-file {path}: the file must hold the key on one line")
            return key
        return self.api_key or os.environ.get(self.api_key_env) or None


def help_of(cls: type, name: str) -> str:
    """The help text of field ``name`` of config dataclass ``cls`` (to redeclare a field with another default)."""
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)


def run_uvicorn(create_app: Callable[..., Any], cfg: ServerOptions, *, log: logging.Logger, exposes: str, banner: str) -> int:
    """Serve ``create_app(cfg, on_fatal=...)`` on ``cfg.host:cfg.port`` until interrupted; returns the exit code.

    Refuses (:class:`ConfigError`, before binding) a non-loopback address without an API key unless
    ``cfg.insecure``; ``exposes`` completes that message ("anyone who can reach the port could ...").
    ``banner`` is logged just before serving. The code is 1 when the app reported a fatal error
    (``on_fatal``) or uvicorn returned without starting, else 0; when it cannot bind the port, uvicorn
    logs why and exits the process itself (code 3).
    """
    import uvicorn

    key = cfg.api_key_value()
    if not is_loopback(cfg.host) and not key and not cfg.insecure:
        raise ConfigError(
            f"refusing to serve {cfg.host} without an API key: anyone who can reach the port could {exposes}. "
            f"Set ${cfg.api_key_env} or --api-key-file, bind 127.0.0.1, or pass --insecure if that is intended"
        )
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exit_code = {"code": 0}
    server: uvicorn.Server | None = None

    def on_fatal(message: str) -> None:
        exit_code["code"] = 1
        if server is not None:
            server.should_exit = True

    launcher = os.environ.pop(LAUNCHER_PID_ENV, None)  # before the app starts anything: its children are not watched
    app = create_app(cfg, on_fatal=on_fatal)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False, timeout_keep_alive=60, backlog=4096,
                            proxy_headers=False,  # no X-Forwarded-For rewriting: ~5% of a small request's time
                            http=guarded_protocol(cfg.header_timeout, cfg.max_idle_connections),  # slowloris
                            h11_max_incomplete_event_size=MAX_HEAD_BYTES)
    server = uvicorn.Server(config)
    if not is_loopback(cfg.host) and not key:
        log.warning("serving %s without an API key (--insecure): anyone who can reach this port can %s", cfg.host, exposes)
    if cfg.api_key:
        log.warning("the API key is on the command line, where every local user can read it; use --api-key-file or $%s", cfg.api_key_env)
    log.info("%s", banner)
    if launcher:
        watch_launcher(int(launcher), lambda: setattr(server, "should_exit", True), log)
    server.run()
    if not server.started and exit_code["code"] == 0:
        return 1
    return exit_code["code"]


# Set by ServerProcess to its own pid: the server then exits when that process is gone.
LAUNCHER_PID_ENV = "EMAPG_LAUNCHER_PID"
LAUNCHER_POLL_S = 0.5


def watch_launcher(pid: int, shut_down: Callable[[], None], log: logging.Logger, poll_s: float = LAUNCHER_POLL_S) -> threading.Thread:
    """Call ``shut_down`` once this process's parent is no longer ``pid`` (it exited and this process was
    re-parented), checking every ``poll_s`` seconds from a daemon thread.

    A launcher killed by SIGKILL, the OOM killer or an unhandled SIGTERM runs no cleanup, and its
    servers, in their own process groups, would keep their ports, memory and (with vLLM) the GPU
    until someone finds them. ``prctl(PR_SET_PDEATHSIG)`` is not used: it fires when the *thread*
    that forked exits, and servers are often started from pool threads that end long before the launcher.
    """

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(poll_s)
        log.warning("the process that started this server (pid %d) has exited; shutting down", pid)
        shut_down()

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread


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

    Not ``python -m app.cli``: that runs the module as ``__main__``, whose ``UserError`` class is
    not the one the subcommands raise, so user errors would print tracebacks instead of one line.
    """
    return [sys.executable, "-c", f"import sys; from {CLI_MODULE} import main; sys.exit(main(sys.argv[1:]))"]


class ServerProcess:
    """Context manager around an ``emapg <subcommand> ... --port N`` subprocess.

    The process runs in its own process group (so stopping it also stops anything it spawned) and
    exits by itself if this process dies without stopping it (:func:`watch_launcher`);
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
        self._launched_at = 0.0

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> Self:
        """:meth:`launch` and :meth:`wait_healthy`; with no fixed port, another free port when the one probed
        was taken before the server bound it ("address already in use"), up to 3 tries."""
        fixed_port = self.port is not None
        for attempt in range(3):
            if not fixed_port:
                self.port = None
            try:
                self.launch()
                self.wait_healthy()
                return self
            except ServerStartError as e:
                if fixed_port or "address already in use" not in str(e).lower() or attempt == 2:
                    raise
        return self

    def launch(self) -> Self:
        """Start the process and return at once, without waiting for it to become healthy
        (:meth:`wait_healthy` does), so the caller can start its clients meanwhile. No port retry:
        a port taken between probing and binding surfaces in :meth:`wait_healthy`'s error."""
        if self.proc is not None:
            raise RuntimeError("server already started")
        if self.port is None:
            self.port = free_port(self.host if self.host not in ("0.0.0.0", "") else "127.0.0.1")
        cmd = [*emapg_command(), *self.subcommand, *self.args, "--port", str(self.port)]
        env = {**self.env, LAUNCHER_PID_ENV: str(os.getpid())}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=str(REPO_ROOT))
        self._launched_at = time.monotonic()
        return self

    def wait_healthy(self) -> None:
        """Wait (up to ``startup_timeout`` from the launch) until ``/health`` answers 200; a process that exits
        first, or a timeout, is a :class:`ServerStartError` quoting the log's tail (after a timeout the process is stopped)."""
        if self.proc is None:
            raise RuntimeError("server not started")
        deadline = self._launched_at + self.startup_timeout
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
        """SIGTERM the process group, SIGKILL it if any of it lingers (after ``timeout``, default ``stop_timeout``).

        Returns once the whole group has exited (an engine's worker processes too), so the port and
        the memory are free when it does.
        """
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if not stop_process_group(proc, signal.SIGTERM, self.stop_timeout if timeout is None else timeout):
            logging.getLogger(__name__).warning("%s (pid %d): part of its process group outlived SIGKILL", self.what, proc.pid)

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
