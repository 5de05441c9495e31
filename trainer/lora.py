"""LoRA adapters on the policy (``model.lora``), with ``peft``: apply, iterate, save, load, merge.

Pure helpers; :func:`trainer.policy.build_policy` composes them (the optimizer over
:func:`adapter_parameters`, the EMA anchor over the same tensors) and ``emapg sft`` reuses them.
Loading a folder (with its adapters, or merged) and writing a merged HF folder live one layer down, in
:mod:`emapg.models` (``resolve_model`` merges the shipped starter with them); they are re-exported here.

Adapter folders are peft's format, so peft (``PeftModel.from_pretrained``) and vLLM (a
``LoRARequest``) load them as they are: ``adapter_config.json`` (rank, alpha, target modules,
``base_model_name_or_path``) and ``adapter_model.safetensors`` with peft's saved key names
(``base_model.model.<module>.lora_A.weight``: the adapter name removed). The base named in the
config is resolved by :func:`emapg.models.resolve_model`, so an alias (``tiny-qwen2``) or a local
folder both work.

Names. In the live model the adapters are ``base_model.model.<module>.lora_{A,B}.default.weight``
and the frozen weight of an adapted layer is ``<module>.base_layer.weight``; :func:`merged_state_dict`
maps such a state dict back to plain HF names with W + (alpha/r)·B·A folded in.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from emapg.config import ConfigError
from emapg.models import (
    ADAPTER_CONFIG, adapter_base_model, is_adapter_folder, load_adapter_model, load_merged_model, merge_adapter_folder,
    read_adapter_config,
)  # fmt: skip
from trainer.config import LoraConfig

__all__ = [
    "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_PREFIX", "is_adapter_folder", "adapter_base_model", "read_adapter_config",
    "matching_modules",
    "peft_lora_config", "apply_lora", "adapter_parameters", "adapter_state_dict", "save_adapter", "AdapterFolderWriter",
    "load_adapter_model", "load_merged_model", "merged_state_dict", "merge_adapter_folder", "adapter_scaling",
    "saved_adapter_name", "AdaptersOffReference", "serves_adapters", "engine_lora_config", "check_engine_serves_lora",
]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: What peft puts in front of the wrapped HF model's parameter names.
PEFT_PREFIX = "base_model.model."
_ADAPTER_NAME = "default"


def adapter_scaling(path: str | Path) -> float:
    """alpha / r of the adapter folder ``path``."""
    cfg = read_adapter_config(path)
    return float(cfg["lora_alpha"]) / float(cfg["r"])


def matching_modules(model: nn.Module, target_modules: list[str]) -> list[str]:
    """Names of the linear layers of ``model`` that ``target_modules`` select (peft's rule: a name equal to
    a target or ending in ``.<target>``; ``all-linear``: every linear layer but the output head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if "all-linear" in target_modules:
        return [n for n, m in linear if m is not head]
    return [n for n, _ in linear if any(n == t or n.endswith("." + t) for t in target_modules)]


def peft_lora_config(cfg: LoraConfig, *, base_model_name_or_path: str | None = None) -> Any:
    """The ``peft.LoraConfig`` of ``model.lora`` (bias untouched; ``init=default``: B = 0, A Kaiming-uniform)."""
    import peft

    targets: Any = "all-linear" if "all-linear" in cfg.target_modules else list(cfg.target_modules)
    return peft.LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets, bias="none",
        init_lora_weights=True if cfg.init == "default" else cfg.init, task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
    )


def apply_lora(model: nn.Module, cfg: LoraConfig, *, base_model_name_or_path: str | None = None) -> Any:
    """Wrap the HF causal LM ``model`` with fresh LoRA adapters (a ``peft.PeftModel``; only the adapters require grad).

    Target modules that select no linear layer are a :class:`~emapg.config.ConfigError` naming
    ``model.lora.target_modules`` and the layer names the model has.
    """
    import peft

    head = model.get_output_embeddings()
    matched = matching_modules(model, cfg.target_modules)
    if any(m is head for n, m in model.named_modules() if n in matched):
        raise ConfigError("model.lora.target_modules: the output head cannot take an adapter "
                          "(the fused log-prob path reads its weight directly)")
    if not matched:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(f"model.lora.target_modules {list(cfg.target_modules)} match no linear layer of this "
                          f"{type(model).__name__}; its linear layers are named {', '.join(names)}")
    wrapped = peft.get_peft_model(model, peft_lora_config(cfg))
    if base_model_name_or_path:  # peft records the folder the base was loaded from; keep an alias as given
        wrapped.peft_config[_ADAPTER_NAME].base_model_name_or_path = base_model_name_or_path
    return wrapped


def adapter_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every LoRA adapter tensor of ``model``, named as in ``model.named_parameters()``."""
    for name, p in model.named_parameters():
        if _is_adapter_key(name):
            yield name, p


def saved_adapter_name(name: str) -> str:
    """The peft saved-format name of a live adapter parameter (``...lora_A.default.weight`` → ``...lora_A.weight``)."""
    return name.replace(f".{_ADAPTER_NAME}.", ".")


def _is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_A." in name or ".lora_embedding_B." in name


def adapter_state_dict(model: nn.Module, state_dict: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The adapters in peft's saved format (``...lora_A.weight``, adapter name removed), from ``model`` or from a
    full ``state_dict`` of it (e.g. gathered from FSDP shards)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=state_dict, adapter_name=_ADAPTER_NAME, save_embedding_layers=False)


def save_adapter(folder: str | Path, model: nn.Module, state_dict: dict[str, Tensor] | None = None) -> Path:
    """Write ``model``'s adapter folder: ``adapter_config.json`` and ``adapter_model.safetensors``.

    ``state_dict``: the adapters in saved format (:func:`adapter_state_dict`), when they do not come
    from ``model`` itself (FSDP: gathered on rank 0).
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.peft_config[_ADAPTER_NAME].save_pretrained(str(folder))
    tensors = adapter_state_dict(model) if state_dict is None else state_dict
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(folder / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    return folder


class AdapterFolderWriter:
    """What :func:`trainer.checkpoint.save_checkpoint` calls ``save_pretrained`` on for a LoRA policy: the checkpoint's
    ``policy/`` is then an adapter folder (``state_dict``: the adapters in saved format, or ``None`` to read the model's)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def save_pretrained(self, folder: str | Path, *, state_dict: dict[str, Tensor] | None = None, **_: Any) -> None:
        save_adapter(folder, self.model, state_dict)


@torch.no_grad()
def merged_state_dict(state: dict[str, Tensor], scaling: float) -> dict[str, Tensor]:
    """HF-named weights with the adapters merged: ``W + scaling·B·A`` for each adapted layer.

    ``state``: a full state dict of a peft-wrapped model (``base_model.model.`` prefix, ``base_layer``
    weights, adapters named ``lora_A.default.weight``/``lora_A.weight``). The product is formed in
    float32 and cast to W's dtype; ``state`` is not modified.
    """
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if _is_adapter_key(key):
            continue
        name = key.removeprefix(PEFT_PREFIX)
        if ".base_layer." in name:
            module = key[: key.index(".base_layer.")]
            name = name.replace(".base_layer.", ".")
            if key.endswith(".base_layer.weight"):
                a = state.get(f"{module}.lora_A.{_ADAPTER_NAME}.weight", state.get(f"{module}.lora_A.weight"))
                b = state.get(f"{module}.lora_B.{_ADAPTER_NAME}.weight", state.get(f"{module}.lora_B.weight"))
                if a is None or b is None:
                    raise KeyError(f"{module}: an adapted layer without its lora_A/lora_B weights")
                delta = (b.float() @ a.float()) * scaling
                value = (value.float() + delta.to(value.device)).to(value.dtype)
        out[name] = value
    return out


class AdaptersOffReference:
    """The frozen reference of a LoRA run whose anchor never moves (``algorithm.ema.decay=1``, GRPO): the base
    with the adapters disabled. With B = 0 at initialisation that *is* the initial policy, and it costs no
    memory: no tensors, no blends; :meth:`swap_into` runs the model under peft's ``disable_adapter``.
    The rest mirrors :class:`trainer.ema.EMAAnchor`'s interface (schedule counters, checkpoint state)."""

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}
        self.num_updates = 0
        self.last_update_step: int | None = None

    def maybe_update(self, step: int) -> bool:
        return False

    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        return {}

    def load_full_state_dict(self, tensors: dict[str, Tensor], *, num_updates: int = 0, last_update_step: int | None = None) -> None:
        if tensors:
            raise ValueError(f"the checkpoint has an EMA anchor ({len(tensors)} tensors) but algorithm.ema.decay=1 "
                             "makes the reference the base model; resume with the run's algorithm.ema.decay")
        self.num_updates, self.last_update_step = int(num_updates), last_update_step

    @contextlib.contextmanager
    def swap_into(self, model: nn.Module) -> Iterator[nn.Module]:
        with model.disable_adapter():
            yield model


def serves_adapters(cfg: LoraConfig) -> bool:
    """Whether a run with ``model.lora`` = ``cfg`` hands its engine adapters (not merged weights)."""
    return cfg.enabled and cfg.engine_weights == "adapters"


def engine_lora_config(model: nn.Module) -> dict[str, Any]:
    """What an engine needs to serve ``model``'s adapters (``agent.engines.base.lora_adapter_config``): rank, alpha and
    the target module names peft resolved (``all-linear`` becomes the names it matched)."""
    c = model.peft_config[_ADAPTER_NAME]
    targets = c.target_modules if isinstance(c.target_modules, (set, list, tuple)) else [c.target_modules]
    return {"r": int(c.r), "lora_alpha": float(c.lora_alpha), "target_modules": sorted(targets)}


def check_engine_serves_lora(info: Any, cfg: LoraConfig) -> None:
    """Before any rollout: the engine (``info``: its ``agent.engines.base.EngineInfo``) can serve rank-``cfg.rank``
    adapters, else a :class:`~emapg.config.ConfigError` naming the way out (never a silent merged fallback)."""
    problem = info.lora_problem(cfg.rank)
    if problem:
        raise ConfigError(f"model.lora.engine_weights=adapters, but {problem}; start `emapg engine serve` with "
                          f"--max-lora-rank {cfg.rank} (vLLM), or set model.lora.engine_weights=merged to sync merged full weights")
