"""torchrun / FSDP2 helpers. Everything degrades to plain single-process calls.

Launch: ``torchrun --nproc-per-node 8 -m app.cli train --config ...`` (multi-node:
add ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``). Each rank generates the
rollouts of its own share of the prompts (whole GRPO groups stay on one rank, so
advantages need no communication), trains on them with FSDP2-sharded parameters,
gradients and optimizer state, and keeps the EMA anchor as local shards of an
identically sharded copy of the model. Loss normalisers (token and sequence counts)
and metrics are summed across ranks so that the loss is that of the global batch.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto", backend: str = "auto") -> DistInfo:
    """Join the process group that torchrun describes in the environment (or run alone)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        chosen = backend if backend != "auto" else ("nccl" if use_cuda else "gloo")
        dist.init_process_group(chosen, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30))
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def collective_device(values: torch.Tensor) -> torch.device:
    """Where a collective on ``values`` must run: NCCL reduces CUDA tensors only (this rank's device),
    gloo reduces them where they are. Callers build small flags and counts on the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return values.device


def _all_reduce(values: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    """``values`` reduced over ranks with ``op``, on the input's device (a copy; the input is untouched)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return values
    out = values.to(collective_device(values), copy=True)
    dist.all_reduce(out, op=op)
    return out.to(values.device)


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (the input unchanged when alone); CPU inputs work under NCCL too."""
    return _all_reduce(values, dist.ReduceOp.SUM)


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """Maximum over ranks (the input unchanged when alone); CPU inputs work under NCCL too."""
    return _all_reduce(values, dist.ReduceOp.MAX)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def shard_slice(n: int, rank: int, world_size: int) -> slice:
    """Contiguous share of ``n`` items for ``rank`` (the first ``n % world`` ranks get one more)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM, also one wrapped by peft (the FSDP wrapping unit)."""
    if hasattr(model, "get_base_model"):  # a peft LoRA model: its blocks are the wrapped model's
        model = model.get_base_model()
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) if inner is not None else None
    if layers is None:
        raise ValueError(f"cannot find decoder layers in {type(model).__name__} (expected model.model.layers)")
    return list(layers)


def apply_fsdp2(model: torch.nn.Module, *, bf16: bool, cpu_offload: bool = False, reshard_after_forward: bool = True) -> torch.nn.Module:
    """Shard ``model`` (a :class:`trainer.policy.PolicyForward`, or an HF causal LM) in place with FSDP2:
    one unit per decoder layer plus the root.

    Mixed precision as in the paper's verl setup: bf16 compute with fp32 master
    parameters and fp32 gradient reduction.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(getattr(model, "lm", model)):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: torch.nn.Module, *, all_ranks: bool = True) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict. ``all_ranks=False`` returns it on rank 0 only (an empty dict elsewhere)."""
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if all_ranks:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
        return {k: v.detach().cpu() for k, v in sd.items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Full (unsharded, FQN-keyed) optimizer state on rank 0; empty on other ranks under FSDP."""
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Inverse of :func:`optimizer_state` (rank 0's full state is broadcast and re-sharded)."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(
        model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
