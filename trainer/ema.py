"""The EMA anchor: θ_ema ← η·θ_ema + (1−η)·θ every P steps (paper §1).

One coefficient, ``anchor_decay`` = η, the weight on the **old anchor** (the paper's
``ref_policy_ema_tau``; search η = 0.9, math η = 0.95, both with P = ``update_period`` = 10).
TRL's ``ref_model_mixup_alpha`` is the weight on the *policy*, α = 1 − η; convert with
:func:`from_trl_mixup_alpha` / :func:`to_trl_mixup_alpha` (TRL PR #4935 shipped this inversion
as a bug).  η = 1 disables the anchor's motion; η = 0 copies the policy at each update.

Schedule: :meth:`EMAAnchor.maybe_update` is called once per training step after the actor
update, with steps counted from 1; it blends only when ``step > 0 and step % P == 0``, so the
anchor is piecewise constant (paper code).  The anchor starts equal to the policy.

Arithmetic: each policy tensor is cast to the anchor's dtype/device, then
``anchor.mul_(η).add_(policy, alpha=1−η)`` with ``torch._foreach_*`` over buckets — exactly
the paper's order of operations.  ``dtype=torch.bfloat16`` reproduces the paper (its ref model
is bf16); the default float32 avoids bf16 rounding swallowing (1−η)-sized updates (bf16 keeps
~8 mantissa bits).  ``device="cpu"`` keeps the anchor offloaded.

Sharding: parameters that are ``DTensor`` (FSDP2) are handled shard-locally: the anchor holds
``param.to_local()``-shaped tensors and updates them pairwise with the local shards; nothing is
gathered.  ``state_dict()`` therefore holds this rank's shards (save one per rank).
Floating-point buffers are blended too (paper: "every parameter and every buffer").
"""

from __future__ import annotations

import contextlib
from typing import Collection, Iterator

import torch
from torch import Tensor, nn

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch builds without distributed
    DTensor = None  # type: ignore[assignment,misc]
    FSDPModule = None  # type: ignore[assignment,misc]

__all__ = ["EMAAnchor", "from_trl_mixup_alpha", "to_trl_mixup_alpha"]

_BUCKET_BYTES = 256 * 2**20


def from_trl_mixup_alpha(alpha: float) -> float:
    """TRL ``ref_model_mixup_alpha`` (weight on the policy) → ``anchor_decay`` η = 1 − α."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"ref_model_mixup_alpha must be in [0, 1], got {alpha}")
    return 1.0 - alpha


def to_trl_mixup_alpha(anchor_decay: float) -> float:
    """``anchor_decay`` η → TRL ``ref_model_mixup_alpha`` α = 1 − η."""
    if not 0.0 <= anchor_decay <= 1.0:
        raise ValueError(f"anchor_decay must be in [0, 1], got {anchor_decay}")
    return 1.0 - anchor_decay


def _local(t: Tensor) -> Tensor:
    """The rank-local shard of a DTensor, or the tensor itself."""
    if DTensor is not None and isinstance(t, DTensor):
        return t.to_local()
    return t


def _reshard(model: nn.Module) -> None:
    """Put every FSDP2 module of ``model`` back in its sharded state.

    A forward without backward leaves the FSDP root (and modules with
    ``reshard_after_forward=False``) holding unsharded parameters; resharding makes the sharded
    parameters the registered ones again and forces the next forward to all-gather them.
    """
    if FSDPModule is None:
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}
    if dtype not in names:
        raise ValueError(f"unknown anchor dtype {dtype!r}; use one of {', '.join(names)}")
    return names[dtype]


class EMAAnchor:
    """EMA copy of a model's parameters (and floating buffers), used as the KL anchor.

    Args:
        model: the policy (plain module, or FSDP2-sharded with DTensor parameters).
        anchor_decay: η ∈ [0, 1], weight on the old anchor.
        update_period: P ≥ 1; blend when ``step % P == 0``.
        dtype: anchor dtype (``torch.float32`` default, ``torch.bfloat16`` = paper, ``None`` =
            same as each parameter); strings ``"float32"``/``"bfloat16"`` accepted.
        device: anchor device (``None`` = next to each parameter; ``"cpu"`` = offloaded).
        include_buffers: also track floating-point buffers.
        fsdp_root: the FSDP2 root module when it *wraps* ``model`` (e.g. a forward wrapper
            that was ``fully_shard``-ed around the HF model).  It owns the parameters not in any
            inner FSDP unit (embeddings, final norm, lm_head) and must be resharded around
            :meth:`swap_into` too, or forwards would reuse its stale unsharded weights.
        only: track just these parameters (names as in ``model.named_parameters()``; no
            buffers): LoRA's anchor is the EMA of the adapters over the shared frozen base.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        anchor_decay: float,
        update_period: int = 10,
        dtype: torch.dtype | str | None = torch.float32,
        device: torch.device | str | None = None,
        include_buffers: bool = True,
        fsdp_root: nn.Module | None = None,
        only: Collection[str] | None = None,
    ) -> None:
        if not 0.0 <= anchor_decay <= 1.0:
            raise ValueError(f"anchor_decay must be in [0, 1], got {anchor_decay}")
        if int(update_period) != update_period or update_period < 1:
            raise ValueError(f"update_period must be an integer >= 1, got {update_period}")
        self.model = model
        self.anchor_decay = float(anchor_decay)
        self.update_period = int(update_period)
        self.dtype = _resolve_dtype(dtype)
        self.device = None if device is None else torch.device(device)
        self.num_updates = 0
        self.last_update_step: int | None = None
        self.fsdp_root = fsdp_root
        self._reshard_all(model)  # capture the sharded parameter objects, which FSDP2 keeps for its lifetime
        self._sources: dict[str, Tensor] = dict(model.named_parameters())
        if only is not None:
            unknown = set(only) - set(self._sources)
            if unknown:
                raise ValueError(f"the model has no parameters {sorted(unknown)[:5]}")
            self._sources = {n: t for n, t in self._sources.items() if n in set(only)}
        elif include_buffers:
            self._sources.update((n, b) for n, b in model.named_buffers() if b.is_floating_point())
        with torch.no_grad():
            self.tensors: dict[str, Tensor] = {
                name: _local(src).detach().to(
                    device=self.device or _local(src).device, dtype=self.dtype or src.dtype, copy=True
                )
                for name, src in self._sources.items()
            }

    def _reshard_all(self, model: nn.Module | None = None) -> None:
        for m in (model, self.model, self.fsdp_root):
            if m is not None:
                _reshard(m)

    # ------------------------------------------------------------------ updates
    def maybe_update(self, step: int) -> bool:
        """Blend if ``step > 0 and step % update_period == 0`` (steps count from 1). Returns whether it did.

        A step that already blended (e.g. replayed after resuming from a checkpoint taken right
        after it) is not blended twice.
        """
        if step > 0 and step % self.update_period == 0 and step != self.last_update_step:
            self.update()
            self.last_update_step = int(step)
            return True
        return False

    @torch.no_grad()
    def update(self) -> None:
        """θ_ema ← η·θ_ema + (1−η)·θ now, shard-locally, in buckets of ~256 MiB of copies."""
        self.num_updates += 1
        if self.anchor_decay >= 1.0:
            return
        eta, one_minus = self.anchor_decay, 1.0 - self.anchor_decay
        bucket_a: list[Tensor] = []
        bucket_s: list[Tensor] = []
        size = 0
        for name, src in self._sources.items():
            a = self.tensors[name]
            s = _local(src).detach().to(device=a.device, dtype=a.dtype)
            bucket_a.append(a)
            bucket_s.append(s)
            size += s.numel() * s.element_size()
            if size >= _BUCKET_BYTES:
                self._blend(bucket_a, bucket_s, eta, one_minus)
                bucket_a, bucket_s, size = [], [], 0
        if bucket_a:
            self._blend(bucket_a, bucket_s, eta, one_minus)

    @staticmethod
    def _blend(anchors: list[Tensor], sources: list[Tensor], eta: float, one_minus: float) -> None:
        if eta == 0.0:
            torch._foreach_copy_(anchors, sources)
            return
        groups: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
        for a, s in zip(anchors, sources):
            group = groups.setdefault(a.dtype, ([], []))
            group[0].append(a)
            group[1].append(s)
        for dtype, (group_a, group_s) in groups.items():
            # η as a 0-dim tensor, not a Python float: ``_foreach_mul_`` rounds a Python scalar to the
            # tensor dtype first, which for bf16 turns η = 0.95 into 0.9492 (a 1.6% larger step). The
            # tensor is float32 -- the precision bf16/fp16/fp32 multiplies run in -- except for float64
            # anchors, where a float32 η would be off by ~1e-8 relative.
            scale = torch.tensor(eta, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=group_a[0].device)
            torch._foreach_mul_(group_a, scale)
            torch._foreach_add_(group_a, group_s, alpha=one_minus)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Anchor tensors (this rank's shards) plus the schedule state."""
        return {
            "anchor_decay": self.anchor_decay,
            "update_period": self.update_period,
            "num_updates": self.num_updates,
            "last_update_step": self.last_update_step,
            "tensors": {n: t.detach().clone() for n, t in self.tensors.items()},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict, *, strict_schedule: bool = False) -> None:
        """Restore tensors (cast to this anchor's dtype/device) and counters.

        Tensor names and shapes must match exactly.  A different ``anchor_decay`` or
        ``update_period`` in the checkpoint is allowed (the new config wins) unless
        ``strict_schedule``.
        """
        tensors = state["tensors"]
        missing, unexpected = set(self.tensors) - set(tensors), set(tensors) - set(self.tensors)
        if missing or unexpected:
            raise ValueError(f"anchor checkpoint mismatch: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(self.tensors[name].shape):
                raise ValueError(f"anchor tensor {name!r}: checkpoint shape {tuple(t.shape)} != {tuple(self.tensors[name].shape)}")
        if strict_schedule and (state["anchor_decay"] != self.anchor_decay or state["update_period"] != self.update_period):
            raise ValueError("anchor checkpoint has a different anchor_decay/update_period")
        for name, t in tensors.items():
            self.tensors[name].copy_(t)
        self.num_updates = int(state.get("num_updates", 0))
        self.last_update_step = state.get("last_update_step")

    # ------------------------------------------------------------------ using the anchor as a policy
    @contextlib.contextmanager
    def swap_into(self, model: nn.Module | None = None, *, backup_device: torch.device | str | None = None) -> Iterator[nn.Module]:
        """Temporarily load the anchor weights into ``model`` (default: the tracked policy).

        Inside the block the model *is* the anchor policy (compute anchor log-probs, top-k
        stats, or generate for evaluation); on exit the original weights are restored
        bit-exactly, even on error.  ``backup_device="cpu"`` keeps the backup off the GPU.
        With FSDP2 the sharded parameters are overwritten shard-locally; the model is resharded
        on entry and on exit so that forwards inside the block all-gather the anchor weights and
        forwards after it the policy's again.
        """
        self._reshard_all(model)
        if model is None or model is self.model:
            targets = self._sources  # the (sharded) parameter objects captured at construction
        else:
            targets = dict(model.named_parameters())
            targets.update(model.named_buffers())
        missing = [n for n in self.tensors if n not in targets]
        if missing:
            raise ValueError(f"model lacks anchor tensors {missing[:5]}")
        for name, a in self.tensors.items():
            if _local(targets[name]).shape != a.shape:
                raise ValueError(
                    f"{name!r}: model tensor {tuple(_local(targets[name]).shape)} vs anchor {tuple(a.shape)}; "
                    "is this the model (and sharding) the anchor was built from?"
                )
        backups: dict[str, Tensor] = {}
        try:
            with torch.no_grad():
                for name, a in self.tensors.items():
                    loc = _local(targets[name])
                    backups[name] = loc.detach().to(device=backup_device or loc.device, copy=True)
                    loc.copy_(a)
            yield self.model if model is None else model
        finally:
            self._reshard_all(model)
            with torch.no_grad():
                for name, b in backups.items():
                    _local(targets[name]).copy_(b)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Overwrite the tracked model tensors with the anchor's (the stability guard's reset_to_anchor:
        the policy restarts from the smoothed past policy). Each rank copies its own shards."""
        for name, src in self._sources.items():
            _local(src).copy_(self.tensors[name])

    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """Anchor weights as full (unsharded) tensors keyed like ``model.state_dict()``.

        In the anchor's own dtype unless ``dtype`` is given (pass the model's dtype for an
        inference engine's ``load_weights``).  Sharded parameters are all-gathered here (and in
        :meth:`full_tensors`, for a few of them); every rank must call it.  Inverse:
        :meth:`load_full_state_dict`.
        """
        return self.full_tensors(list(self.tensors), dtype=dtype)

    def full_tensors(self, names: list[str], dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """The full (unsharded) anchor tensors ``names``; under FSDP2 every rank must call it."""
        out: dict[str, Tensor] = {}
        for name in names:
            a, src = self.tensors[name], self._sources[name]
            if DTensor is not None and isinstance(src, DTensor):
                full = DTensor.from_local(a.to(src.device), src.device_mesh, src.placements,
                                          shape=src.shape, stride=src.stride()).full_tensor()
            else:
                full = a
            out[name] = full if dtype is None else full.to(dtype)
        return out

    def sharded_tensors(self) -> dict[str, Tensor]:
        """The anchor tensors with their parameters' sharding: a DTensor around each local shard under
        FSDP2 (sharing its storage, no copy), the tensor itself otherwise. What a resharding
        (``torch.distributed.checkpoint``) save writes and its load fills in place."""
        out: dict[str, Tensor] = {}
        for name, a in self.tensors.items():
            src = self._sources[name]
            if DTensor is not None and isinstance(src, DTensor):
                out[name] = DTensor.from_local(a, src.device_mesh, src.placements, shape=src.shape,
                                               stride=src.stride(), run_check=False)
            else:
                out[name] = a
        return out

    @torch.no_grad()
    def load_sharded_tensors(self, tensors: dict[str, Tensor]) -> None:
        """Copy :meth:`sharded_tensors`-shaped tensors (e.g. filled by a DCP load) into the anchor."""
        for name, t in tensors.items():
            local = t.to_local() if DTensor is not None and isinstance(t, DTensor) else t
            if local.data_ptr() != self.tensors[name].data_ptr():
                self.tensors[name].copy_(local)

    def name_of(self, param: Tensor) -> str:
        """The anchor name of one of the tracked model's parameters (e.g. its lm_head weight)."""
        for name, src in self._sources.items():
            if src is param:
                return name
        raise KeyError("the anchor does not track this tensor")

    @torch.no_grad()
    def load_full_state_dict(
        self, tensors: dict[str, Tensor], *, num_updates: int = 0, last_update_step: int | None = None
    ) -> None:
        """Load full (unsharded) anchor tensors, e.g. a checkpoint of :meth:`full_state_dict`.

        Under FSDP2 each rank keeps only its own shard (``distribute_tensor`` with the
        parameter's mesh and placements; every rank must call it with the same tensors).
        """
        local: dict[str, Tensor] = {}
        for name, src in self._sources.items():
            if name not in tensors:
                raise ValueError(f"anchor checkpoint lacks {name!r}")
            t = tensors[name]
            if DTensor is not None and isinstance(src, DTensor):
                from torch.distributed.tensor import distribute_tensor

                t = distribute_tensor(t.to(device=src.device, dtype=src.dtype), src.device_mesh, src.placements).to_local()
            local[name] = t
        self.load_state_dict({
            "anchor_decay": self.anchor_decay,
            "update_period": self.update_period,
            "num_updates": num_updates,
            "last_update_step": last_update_step,
            "tensors": {**local, **{n: tensors[n] for n in tensors if n not in local}},
        })
