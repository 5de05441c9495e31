"""Generation engines from a spec, and the engine session a trainer rolls out through.

* :class:`EngineSpec` + :func:`build_engine`: one function builds every engine the project runs —
  ``vllm`` (colocated with the caller), ``hf`` (transformers) or ``remote`` (running
  ``emapg engine serve`` servers, :class:`agent.engines.remote.RemoteEngine`).
  :func:`available_kind` falls back from vLLM to transformers where vLLM is not installed (eval).
* :class:`EngineSession`: the engine as a trainer uses it between updates. It owns *when* the
  engine gets new weights and sleeps: :meth:`EngineSession.weights_changed` after an optimizer
  step, then :meth:`EngineSession.generating` before the next rollout pushes them (shared
  remote servers: rank 0 alone wakes them and pushes, the other ranks wait at a barrier; a
  colocated engine: every rank loads its full copy), wakes a local engine, and puts a colocated
  vLLM to sleep after generating (frees its weights and KV cache for training). The trainer's
  rollout has no engine-kind branches.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal

from agent.engines import EngineKind
from emapg.errors import UserError

__all__ = ["VLLMOptions", "RemoteOptions", "EngineSpec", "available_kind", "build_engine", "load_model_into", "EngineSession"]

@dataclass(frozen=True)
class VLLMOptions:
    """Options of a colocated vLLM engine; ``None`` keeps the engine's own default."""

    tensor_parallel_size: int | None = None
    gpu_memory_utilization: float | None = None
    enable_sleep_mode: bool | None = None


@dataclass(frozen=True)
class RemoteOptions:
    """How to reach ``emapg engine serve`` servers (see :class:`agent.engines.remote.RemoteEngine`)."""

    urls: tuple[str, ...]
    api_key: str | None = None
    timeout: float = 600.0
    wait_s: float = 0.0
    weight_sync: Literal["http", "collective"] = "http"
    bucket_bytes: int = 256 << 20
    collective_host: str = "127.0.0.1"
    collective_port: int = 0
    collective_backend: Literal["gloo", "nccl"] = "gloo"
    #: Load the spec's model (``EngineSpec.model_path``: a full folder, or an adapter folder merged into its base)
    #: into the servers when connecting, so they serve exactly that model whatever they held before (evaluation on
    #: a shared server). Off for training, whose engine session pushes the policy's weights itself.
    load_model: bool = False


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to build one engine.

    ``model_path``: a local HF folder or an alias of :func:`emapg.models.resolve_model` (remote:
    the tokenizer's folder; the servers hold their own weights). ``max_model_len``: prompt +
    response tokens; ``seed``: the engine's base seed; ``dtype``/``device``: transformers only
    (``None``: its defaults, float32 on CPU); ``vllm``/``remote``: the other kinds' options.
    """

    kind: EngineKind
    model_path: str
    max_model_len: int | None = None
    seed: int = 0
    dtype: str | None = None
    device: str | None = None
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    remote: RemoteOptions | None = None
    max_lora_rank: int | None = None  # vllm: build it to serve LoRA adapters up to this rank (hf serves any rank)


def available_kind(kind: EngineKind, *, warn: Callable[[str], None] | None = None) -> EngineKind:
    """``kind``, or ``"hf"`` when it is ``"vllm"`` and vLLM cannot be imported (``warn`` is told why)."""
    if kind != "vllm":
        return kind
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        if warn is not None:
            warn(f"vLLM is not available ({e}); falling back to the transformers engine")
        return "hf"
    return kind


def build_engine(spec: EngineSpec) -> Any:
    """The engine ``spec`` describes (the :class:`agent.engines.base.Engine` interface).

    A model that does not exist, or a folder transformers cannot load, is a :class:`~emapg.errors.UserError`
    naming it.
    """
    from agent.engines import make_engine

    if spec.kind == "remote":
        from agent.engines.remote import RemoteEngine

        r = spec.remote
        if r is None or not r.urls:
            raise UserError("a remote engine needs the URLs of running `emapg engine serve` servers")
        engine = RemoteEngine(
            list(r.urls), model_path=spec.model_path, api_key=r.api_key, timeout=r.timeout, wait_s=r.wait_s,
            weight_sync=r.weight_sync, bucket_bytes=r.bucket_bytes, collective_host=r.collective_host,
            collective_port=r.collective_port, collective_backend=r.collective_backend,
        )  # fmt: skip
        if r.load_model:
            try:
                load_model_into(engine, spec.model_path)
            except BaseException:
                engine.close()
                raise
        return engine
    options: dict[str, Any] = {"seed": spec.seed}
    if spec.max_model_len is not None:
        options["max_model_len"] = spec.max_model_len
    if spec.kind == "hf":
        options.update({k: v for k, v in (("dtype", spec.dtype), ("device", spec.device)) if v is not None})
    elif spec.kind == "vllm":
        v = spec.vllm
        options.update({k: getattr(v, k) for k in ("tensor_parallel_size", "gpu_memory_utilization", "enable_sleep_mode")
                        if getattr(v, k) is not None})
        if spec.max_lora_rank:
            options["max_lora_rank"] = spec.max_lora_rank
    else:
        raise ValueError(f"unknown engine kind {spec.kind!r}; choose hf, vllm or remote")
    try:
        return make_engine(spec.kind, spec.model_path, **options)
    except UserError:  # emapg.models: no such folder or alias
        raise
    except (OSError, ValueError) as e:  # transformers: not a model folder, not on the hub (offline), no tokenizer
        raise UserError(f"cannot load model {spec.model_path!r} into the {spec.kind} engine: {e}") from None


def load_model_into(engine: Any, model_path: str) -> None:
    """Push the weights of the model at ``model_path`` (a full HF folder or alias, or a LoRA adapter folder, merged)
    to ``engine``'s servers, which then serve that model (same architecture and vocabulary as the one they
    started with); a model that does not fit them is a :class:`~emapg.errors.UserError`."""
    from agent.engines.remote import RemoteEngineError
    from emapg.models import load_merged_model, resolve_model

    model = load_merged_model(resolve_model(model_path))
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    del model
    try:
        engine.load_weights(state, tag=f"model:{model_path}")
    except RemoteEngineError as e:
        raise UserError(f"cannot load {model_path!r} into the engine servers {engine.urls}: {e} (servers "
                        "that serve another architecture cannot take its weights: start them with `emapg engine serve --model ...`)") from None


class EngineSession:
    """The trainer's engine between updates: weight sync, sleep/wake, the rank-0 push to shared servers.

    Args:
        engine: built by :func:`build_engine`.
        kind: the spec's kind. ``"remote"`` servers are *shared* by every rank: they start on
            weights of their own (so the first rollout syncs), only rank 0 wakes them and pushes,
            and they are never put to sleep (a server's ``/wake`` is a barrier that waits out every
            rank's in-flight generations). A colocated ``"vllm"`` engine sleeps after each rollout.
        export_weights: ``export_weights(all_ranks=...)`` → the policy's full HF-named state dict
            (a collective under FSDP: every rank calls it; ``all_ranks=False`` returns it on rank 0).
        is_main: this process is rank 0. ``barrier``: waits for every rank.
        lora_config: LoRA (``agent.engines.base.lora_adapter_config``): ``export_weights`` returns the
            adapters only, and the engine serves its base with them (``load_lora``).
    """

    def __init__(self, engine: Any, kind: EngineKind, *, export_weights: Callable[..., dict],
                 is_main: bool = True, barrier: Callable[[], None] = lambda: None, lora_config: dict | None = None) -> None:
        self.engine = engine
        self.lora_config = lora_config
        self.kind = kind
        self.shared = kind == "remote"
        self.sleeps_after_rollout = kind == "vllm"
        self.export_weights = export_weights
        self.is_main = is_main
        self.barrier = barrier
        # A colocated engine loaded the same HF folder as the policy (on resume too): no sync needed.
        self.stale = self.shared

    def weights_changed(self) -> None:
        """The policy moved: push its weights before the next rollout."""
        self.stale = True

    def sync(self, tag: str) -> None:
        """Push the policy's weights now if they changed (every rank calls this)."""
        if not self.stale:
            return
        if self.shared:  # shared servers: rank 0 wakes them and pushes once, the other ranks wait for it
            state = self.export_weights(all_ranks=False)
            if self.is_main:
                self.engine.wake()
                self._load(state, tag=tag)
            self.barrier()
        else:
            self.engine.wake()
            self._load(self.export_weights(all_ranks=True))
        self.stale = False

    def _load(self, state: dict, **tag: Any) -> None:
        if self.lora_config is not None:
            self.engine.load_lora(state, self.lora_config, **tag)
        else:
            self.engine.load_weights(state, **tag)

    @contextlib.contextmanager
    def generating(self, tag: str) -> Iterator[Any]:
        """Synced (``tag`` names the weights on shared servers), awake engine for one rollout; a colocated
        vLLM goes back to sleep after a rollout that finished."""
        self.sync(tag)
        if not self.shared:
            self.engine.wake()
        yield self.engine
        if self.sleeps_after_rollout:
            self.engine.sleep()

    def close(self) -> None:
        self.engine.close()
