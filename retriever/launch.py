"""Start and stop a retrieval server process (for the trainer, the evaluator, tests and the demo).

    with RetrieverServer("indexes/wiki_mini") as server:
        client = RetrieverClient(server.url)

The server runs as ``emapg serve`` in its own process group (so stopping it also
stops anything it spawned); output goes to a log file whose tail is quoted in every error.
Starting, health-waiting and stopping are :class:`emapg.servers.ServerProcess`'s.
"""

from __future__ import annotations

import os
from pathlib import Path

from emapg.servers import ServerProcess, ServerStartError, emapg_command, free_port

__all__ = ["RetrieverServer", "ServerStartError", "emapg_command", "free_port"]


class RetrieverServer(ServerProcess):
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

    what = "retrieval server"
    subcommand = ("serve",)
    stop_timeout = 15.0

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
        args = [
            "--index", str(self.index_dir), "--host", host, "--topk", str(topk), "--max-batch", str(max_batch),
            "--max-wait-ms", str(max_wait_ms), "--device", device, *(extra_args or []),
        ]  # fmt: skip
        env = dict(os.environ if env is None else env)
        if omp_num_threads is not None:
            env["OMP_NUM_THREADS"] = str(omp_num_threads)
        env.setdefault("OMP_NUM_THREADS", "1" if (os.cpu_count() or 1) <= 2 else str(min(8, os.cpu_count() or 1)))
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_OFFLINE", "1")
        if api_key:
            env["EMAPG_RETRIEVER_API_KEY"] = api_key  # not on the command line: `ps` shows argv
        super().__init__(
            args, host=host, port=port, api_key=api_key, env=env, startup_timeout=startup_timeout,
            log_path=log_path, log_prefix="emapg-retriever-",
        )  # fmt: skip


class RouterServer(ServerProcess):
    """Context manager around an ``emapg router`` subprocess over shard server URLs (one list of replica URLs per shard)."""

    what = "retrieval router"
    subcommand = ("router",)
    stop_timeout = 15.0

    def __init__(self, shards: list[list[str]], host: str = "127.0.0.1", port: int | None = None, *, deadline_ms: float = 2000.0,
                 health_interval_s: float = 0.5, extra_args: list[str] | None = None, startup_timeout: float = 180.0,
                 log_path: str | Path | None = None):  # fmt: skip
        args = ["--host", host, "--deadline-ms", str(deadline_ms), "--health-interval-s", str(health_interval_s)]
        for replicas in shards:
            args += ["--shard", ",".join(replicas)]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        super().__init__([*args, *(extra_args or [])], host=host, port=port, api_key=None, env=env, startup_timeout=startup_timeout,
                         log_path=log_path, log_prefix="emapg-router-")  # fmt: skip
