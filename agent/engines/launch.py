"""Start and stop an ``emapg engine serve`` process (tests, benchmarks, local set-ups).

    with EngineServer("tiny-qwen2", engine="hf") as server:
        engine = RemoteEngine(server.url, model_path="tiny-qwen2")
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from retriever.launch import ServerStartError, _repo_root, _tail, emapg_command, free_port


class EngineServer:
    """Context manager around an ``emapg engine serve`` subprocess (own process group, log file).

    ``extra_args`` are more ``emapg engine serve`` options; the API key travels in the
    environment (``$EMAPG_ENGINE_API_KEY``), never on the command line.
    """

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
    ) -> None:
        self.port = port
        self.api_key = api_key
        self.startup_timeout = startup_timeout
        self.args = ["--model", str(model), "--engine", engine, "--max-model-len", str(max_model_len), *(extra_args or [])]
        self.env = dict(os.environ)
        self.env.update(OMP_NUM_THREADS=str(omp_num_threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.env.pop("EMAPG_ENGINE_API_KEY", None)
        if api_key:
            self.env["EMAPG_ENGINE_API_KEY"] = api_key
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="emapg-engine-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "EngineServer":
        if self.port is None:
            self.port = free_port()
        cmd = [*emapg_command(), "engine", "serve", *self.args, "--port", str(self.port)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True, cwd=_repo_root())
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=2.0) as http:
            while True:
                if self.proc.poll() is not None:
                    code, self.proc = self.proc.returncode, None
                    raise ServerStartError(f"generation server exited with code {code}; log tail:\n{_tail(self.log_path)}")
                try:
                    if http.get(self.url + "/health").status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerStartError(f"generation server not healthy after {self.startup_timeout:.0f} s; log tail:\n{_tail(self.log_path)}")
                time.sleep(0.2)

    def stop(self, timeout: float = 20.0) -> None:
        import signal

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

    def __enter__(self) -> "EngineServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
