"""The optimizer state and the EMA anchor in a world-size-independent form (``torch.distributed.checkpoint``).

A checkpoint's ``state/`` folder is a DCP checkpoint holding::

    optimizer   AdamW state keyed by parameter name (FQN): DTensor shards under FSDP2, plain tensors alone
    anchor      the EMA anchor's tensors (full model or LoRA adapters), with the sharding of their parameters

Every rank writes its own shards (``__<rank>_0.distcp``) at once: nothing is gathered on rank 0, so
the save costs one write of each rank's share. ``.metadata`` records each tensor's global shape and
where its pieces lie, so :func:`load_training_state` reads them into whatever sharding the resuming
run has -- a run saved by W ranks resumes at any W' (the policy weights come back with the model
from the checkpoint's ``policy/`` folder, which is unsharded already).

Checkpoints of format 2 (``optimizer.pt`` with the full state, ``anchor.safetensors``) load through
:func:`load_full_optimizer_state` at any world size as well.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import STATE_DIR, CheckpointError

DCP_METADATA = ".metadata"


def has_training_state(checkpoint: Path) -> bool:
    """Whether the checkpoint keeps its optimizer and anchor in a DCP ``state/`` folder (format 3)."""
    return (checkpoint / STATE_DIR / DCP_METADATA).is_file()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def _quiet_alone() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" when a run is alone (it is)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*assuming the intent is to (save|load) in a single process")
        yield


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, anchor: Any) -> dict[str, Any]:
    """What DCP saves or loads into: the sharded optimizer state and the anchor's tensors as their
    parameters' DTensors (their local tensors are the anchor's own, so loading fills them in place)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state: dict[str, Any] = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    tensors = getattr(anchor, "tensors", None)
    if tensors:  # an EMAAnchor (LoRA's adapters-off reference holds no tensors)
        state["anchor"] = anchor.sharded_tensors()
    return state


def save_training_state(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, anchor: Any) -> None:
    """Write the optimizer and anchor state into ``folder`` with DCP (every rank calls it; collective)."""
    import torch.distributed.checkpoint as dcp

    with _quiet_alone():
        dcp.save(_state(model, optimizer, anchor), checkpoint_id=str(folder), no_dist=not _distributed())


def load_training_state(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, anchor: Any) -> None:
    """Read the optimizer and anchor state of ``folder`` into this run's sharding (every rank calls it).

    ``model`` is the module the optimizer's parameters belong to (the FSDP2 root under torchrun).
    Raises :class:`trainer.checkpoint.CheckpointError` when the checkpoint lacks what the run needs
    (e.g. no anchor but ``algorithm.kl`` is enabled) or its tensors do not fit the model.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = _state(model, optimizer, anchor)
    saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    if "anchor" in state and not any(k.startswith("anchor.") for k in saved):
        raise CheckpointError(f"{folder} holds no EMA anchor but algorithm.kl is enabled: resume with the run's own config")
    try:
        with _quiet_alone():
            dcp.load(state, checkpoint_id=str(folder), no_dist=not _distributed())
    except (RuntimeError, ValueError, KeyError) as e:  # DCP wraps per-rank failures in CheckpointException(RuntimeError)
        text = str(e).strip().splitlines()
        raise CheckpointError(f"{folder}: the optimizer/anchor state does not fit this model "
                              f"({type(e).__name__}: {text[0] if text else ''})") from None
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if "anchor" in state:
        anchor.load_sharded_tensors(state["anchor"])


def fqn_keyed(state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A full optimizer state keyed by parameter name: a single process's ``optimizer.state_dict()``
    (keyed by position in ``param_groups``) renamed through ``optimizer``'s own parameter order; a state
    keyed by name already (what FSDP runs saved) is returned as it is."""
    groups = state.get("param_groups", [])
    if not groups or all(isinstance(p, str) for g in groups for p in g["params"]):
        return state
    names = {p: n for n, p in model.named_parameters()}
    order = [names[p] for g in optimizer.param_groups for p in g["params"]]
    index = {i: order[i] for g in groups for i in g["params"]}
    if len(index) != len(order):
        raise CheckpointError(f"the checkpoint's optimizer has {len(index)} parameters but this model trains {len(order)}")
    return {
        "state": {index[int(i)]: s for i, s in state.get("state", {}).items()},
        "param_groups": [dict(g, params=[index[i] for i in g["params"]]) for g in groups],
    }


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], *,
                              sharded: bool) -> None:
    """Load a format-2 ``optimizer.pt`` (the full state, on every rank) at this run's world size."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=fqn_keyed(state, model, optimizer),
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=sharded))


def read_training_state(checkpoint: Path) -> dict[str, Any]:
    """The ``state/`` folder of a checkpoint as full (unsharded) CPU tensors, in one process and without a
    model: ``{"optimizer": {"state": {name: {...}}, "param_groups": [...]}, "anchor": {name: tensor}}``
    (to inspect a checkpoint, compare two, or convert one with ``torch.save``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # What torch's own dcp_to_torch_save does (the public load cannot fill an empty dict).
    state: dict[str, Any] = {}
    with _quiet_alone():
        _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(Path(checkpoint) / STATE_DIR)),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state
