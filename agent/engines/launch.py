"""Start and stop an ``emapg engine serve`` process (tests, benchmarks, local set-ups).

    with EngineServer("tiny-qwen2", engine="hf") as server:
        engine = RemoteEngine(server.url, model_path="tiny-qwen2")

Starting, health-waiting and stopping are :class:`emapg.servers.ServerProcess`'s.
"""

from __future__ import annotations

import os
from pathlib import Path

from emapg.servers import ServerProcess


class EngineServer(ServerProcess):
    """Context manager around an ``emapg engine serve`` subprocess (own process group, log file).

    ``extra_args`` are more ``emapg engine serve`` options; ``env``, variables set for the server on top of
    this process's environment (e.g. ``VLLM_CPU_KVCACHE_SPACE``); the API key travels in the
    environment (``$EMAPG_ENGINE_API_KEY``), never on the command line.
    """

    what = "generation server"
    subcommand = ("engine", "serve")
    stop_timeout = 20.0

    def __init__(
        self,
        model: str | Path,
        *,
        engine: str = "hf",
        port: int | None = None,
        api_key: str | None = None,
        max_model_len: int = 2048,
        extra_args: list[str] | None = None,
        omp_num_threads: int = 1,
        startup_timeout: float = 300.0,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        args = ["--model", str(model), "--engine", engine, "--max-model-len", str(max_model_len), *(extra_args or [])]
        env = {**os.environ, **(env or {})}
        env.update(OMP_NUM_THREADS=str(omp_num_threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.pop("EMAPG_ENGINE_API_KEY", None)
        if api_key:
            env["EMAPG_ENGINE_API_KEY"] = api_key
        super().__init__(
            args, host="127.0.0.1", port=port, api_key=api_key, env=env, startup_timeout=startup_timeout,
            log_path=log_path, log_prefix="emapg-engine-",
        )  # fmt: skip
