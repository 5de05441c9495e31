"""The trained policy: model build, FSDP2, optimizer, LR schedule, EMA anchor, and its forwards.

:func:`build_policy` is the one place a policy is built from ``model.*``/``optim.*``/
``algorithm.ema.*``. With ``model.lora`` it wraps the model with peft adapters (:mod:`trainer.lora`),
the optimizer holds only them, the anchor is the EMA of the adapters over the shared frozen base
(or, with ``ema.decay=1``, the base with the adapters off), and :meth:`Policy.export_weights` hands
the engine the adapters (or the weights with them merged, ``model.lora.engine_weights=merged``).  :class:`Policy` runs it: the differentiable
statistics pass (:meth:`Policy.stats`), the anchor's no-grad passes (:meth:`Policy.anchor_stats`,
:meth:`Policy.anchor_hidden`), the anchor's lm_head for the exact KL (:meth:`Policy.exact_kl_anchor`)
and the full weights for the engine and checkpoints (:meth:`Policy.export_weights`).
"""

from __future__ import annotations

from collections.abc import Callable

import contextlib
import logging
import os
from typing import Any

import torch

from emapg.config import ConfigError
from emapg.cpu import cpu_has_bf16
from trainer import distributed as D
from trainer.batch import MicroBatch
from trainer.config import LoraConfig, TrainConfig
from trainer.errors import TrainingError
from trainer.lora import AdaptersOffReference, adapter_parameters, is_adapter_folder
from trainer.algo import DEFAULT_CHUNK_SIZE
from trainer.algo.token_stats import TokenStats, token_stats_from_hidden
from trainer.algo.topk_kl import ExactKLAnchor, exact_kl_from_hidden
from trainer.model_forward import activation_checkpointing_active, causal_lm_hidden

log = logging.getLogger(__name__)

__all__ = ["PolicyForward", "Policy", "build_policy", "use_bf16", "linear_warmup_constant"]


class PolicyForward(torch.nn.Module):
    """The trainer's only entry into the policy: token statistics or final hidden states.

    Why a wrapper: the fused log-prob path runs the decoder body and then uses the lm_head
    *weight* directly (no ``(T, V)`` logits), so the HF model's own ``forward`` never runs.
    Under FSDP2 the root unit must be a module whose forward is called, so that its parameters
    (embeddings, final norm, lm_head) are all-gathered for the pass and their gradients
    reduce-scattered after backward; this wrapper is that root.  For the same reason the exact
    KL against the anchor is computed in here: the lm_head weight is unsharded only inside.
    """

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_response_tokens: int, *,
                hidden_only: bool = False, share_prompt: bool = False, exact_kl_to: ExactKLAnchor | None = None,
                **stats_kwargs: Any) -> tuple[torch.Tensor | None, ...]:
        """``hidden_only``: ``(hidden,)``, the final hidden states ``(B, T, H)``; else the fields of
        :class:`trainer.algo.token_stats.TokenStats` as a tuple (FSDP hooks see plain tensors), ``exact_kl``
        computed when ``exact_kl_to`` is given."""
        hidden, head = causal_lm_hidden(self.lm, input_ids, attention_mask, num_response_tokens, share_prompt=share_prompt)
        if hidden_only:
            return (hidden,)
        st = token_stats_from_hidden(hidden, head.weight, input_ids[:, -num_response_tokens:], bias=head.bias, **stats_kwargs)
        kl = None
        if exact_kl_to is not None:
            a = exact_kl_to
            kl = exact_kl_from_hidden(
                hidden, head.weight, a.hidden, a.weight, bias=head.bias, ref_bias=a.bias, direction=a.direction,
                temperature=stats_kwargs.get("temperature", 1.0), chunk_size=stats_kwargs.get("chunk_size", DEFAULT_CHUNK_SIZE),
            )
        return st.logp, st.logsumexp, st.topk_logits, st.topk_indices, st.entropy, kl


def linear_warmup_constant(warmup_steps: int):
    """LR multiplier: linear from 1/(w+1) up to 1 over ``warmup_steps`` steps, then 1 (paper search §3.1)."""

    def factor(step: int) -> float:
        if warmup_steps <= 0:
            return 1.0
        return min(1.0, (step + 1) / (warmup_steps + 1))

    return factor


def use_bf16(cfg: TrainConfig, dev: torch.device, *, native_cpu_bf16: bool | None = None) -> bool:
    """Whether training computes in bf16 (``run.precision``), after checking the device can.

    ``auto``: bf16 on CUDA, fp32 on CPU. ``bf16``: on CUDA always; on a CPU with native bf16 dot products
    (:func:`emapg.cpu.cpu_has_bf16`, or ``native_cpu_bf16`` when given) bf16 autocast over fp32 master weights; on a CPU
    without them fp32, with a warning that says so (emulated bf16 would be slower than fp32).
    """
    if cfg.run.device == "cuda" and dev.type != "cuda":
        raise ConfigError("run.device=cuda but no CUDA device is available")
    if cfg.run.precision == "fp32" or (cfg.run.precision == "auto" and dev.type != "cuda"):
        return False
    if dev.type == "cuda":
        return True
    native = cpu_has_bf16() if native_cpu_bf16 is None else native_cpu_bf16
    if not native:
        log.warning("run.precision=bf16: this CPU has no native bf16 dot products (avx512_bf16/amx_bf16); training in fp32")
    return native


class Policy:
    """The model being trained (``model``, its FSDP root ``forward``), ``optimizer``, ``scheduler`` and
    the EMA ``anchor`` (``None`` without a KL term). Built by :func:`build_policy`."""

    def __init__(self, model: torch.nn.Module, forward: PolicyForward, *, fsdp: bool, bf16: bool,
                 optimizer: torch.optim.Optimizer, scheduler: Any, anchor: Any, share_prompt: bool,
                 share_prompt_training: bool = False, lora: LoraConfig | None = None) -> None:
        self.model, self.forward, self.fsdp, self.bf16 = model, forward, fsdp, bf16
        self.optimizer, self.scheduler, self.anchor = optimizer, scheduler, anchor
        # model.share_prompt: the no-grad passes; model.share_prompt_training: the differentiable pass as well.
        self.share_prompt = share_prompt
        self.share_prompt_training = share_prompt and share_prompt_training
        self.lora = lora  # None: full fine-tuning; else model is a peft model whose adapters alone train
        # The lm_head tensors and the anchor's names of them, taken now: FSDP2 registers the sharded
        # parameters between passes but the unsharded ones after a no-grad forward of the root. With
        # LoRA the head is frozen and shared: the anchor tracks only adapters (no head names).
        head = model.get_output_embeddings()
        self._head = (head.weight, head.bias)
        tracked = getattr(anchor, "_sources", {})
        self._head_names = [anchor.name_of(p) for p in self._head if p is not None and any(p is t for t in tracked.values())]
        self._anchor_params: dict[str, tuple[torch.Tensor, torch.dtype, torch.device]] | None = None
        self._anchor_head: tuple[int, torch.Tensor, torch.Tensor | None] | None = None

    def parameters(self):
        return self.forward.parameters()

    @property
    def device_type(self) -> str:
        """``cuda`` or ``cpu``: where the policy's parameters live (what autocast is for)."""
        return next(self.forward.parameters()).device.type

    def autocast(self):
        if self.bf16 and not self.fsdp:
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def stats(self, mb: MicroBatch, **kwargs: Any) -> TokenStats:
        """The policy's statistics on a micro-batch (differentiable unless under ``no_grad``);
        ``kwargs`` as :func:`trainer.algo.token_stats.token_stats_from_hidden` plus ``exact_kl_to``/``share_prompt``
        (the training pass passes :attr:`share_prompt_training`: each group's prompt runs once, see
        :func:`trainer.model_forward.causal_lm_hidden`)."""
        with self.autocast():
            return TokenStats(*self.forward(mb.input_ids, mb.attention_mask, mb.response_width, **kwargs))

    @torch.no_grad()
    def anchor_stats(self, mb: MicroBatch, **kwargs: Any) -> TokenStats:
        """The anchor's statistics on a micro-batch (prompts shared within groups: ``model.share_prompt``)."""
        return TokenStats(*self._anchor_forward(mb, share_prompt=self.share_prompt, **kwargs))

    @torch.no_grad()
    def anchor_hidden(self, mb: MicroBatch) -> torch.Tensor:
        """The anchor's final hidden states ``(B, T, H)`` at the response positions (for the exact KL).

        Prompts shared exactly when the training pass shares them (``model.share_prompt_training``, not
        under activation checkpointing): the exact KL is only exactly 0 (with a zero gradient, which
        Adam would otherwise blow up to lr-sized steps of rounding noise) at policy = anchor if both
        passes round alike.
        """
        share = self.share_prompt_training and not activation_checkpointing_active(self.model)
        return self._anchor_forward(mb, hidden_only=True, share_prompt=share)[0]

    def _anchor_forward(self, mb: MicroBatch, **kwargs: Any) -> tuple[torch.Tensor | None, ...]:
        """Unsharded: ``torch.func.functional_call`` runs the policy module with the anchor's
        tensors in place of its parameters, without touching the parameters, so it is safe
        while the policy's autograd graph is alive and costs no weight copies (fp32 anchor on
        the same device). Under FSDP the anchor holds local shards, which only the module's
        own sharded parameters can carry: the anchor is swapped in and out."""
        args = (mb.input_ids, mb.attention_mask, mb.response_width)
        if isinstance(self.anchor, AdaptersOffReference):  # LoRA's frozen reference: the base, adapters off
            with self.anchor.swap_into(self.model), self.autocast():
                return self.forward(*args, **kwargs)
        if self.fsdp:
            with self.anchor.swap_into(self.model), self.autocast():
                return self.forward(*args, **kwargs)
        with self.autocast():
            return torch.func.functional_call(self.forward, self._anchor_tensors(), args, kwargs)

    def _anchor_tensors(self) -> dict[str, torch.Tensor]:
        """The anchor's tensors keyed like the forward's, in each parameter's dtype and device."""
        if self._anchor_params is None:  # (anchor tensor, dtype, device) per policy tensor; EMA updates them in place
            own = {**dict(self.forward.named_parameters()), **dict(self.forward.named_buffers())}
            self._anchor_params = {
                f"lm.{name}": (t, own[f"lm.{name}"].dtype, own[f"lm.{name}"].device) for name, t in self.anchor.tensors.items()
            }
        return {
            key: t if (t.dtype == dtype and t.device == device) else t.to(dtype=dtype, device=device)
            for key, (t, dtype, device) in self._anchor_params.items()
        }

    def exact_kl_anchor(self, hidden: torch.Tensor, direction: str) -> ExactKLAnchor:
        """The anchor side of the exact KL for stored anchor ``hidden`` states: its lm_head (in their dtype).

        Unsharded the head is the anchor's own tensor (EMA blends update it in place); under FSDP2
        it is all-gathered, once per anchor version (every rank calls this in the same step).
        """
        names = self._head_names
        if not names:  # LoRA: the anchor's head is the policy's own frozen one
            weight, bias = self._frozen_head()
        elif self.fsdp:
            version = self.anchor.num_updates
            if self._anchor_head is None or self._anchor_head[0] != version:
                full = self.anchor.full_tensors(names)
                self._anchor_head = (version, full[names[0]], full[names[1]] if len(names) > 1 else None)
            weight, bias = self._anchor_head[1], self._anchor_head[2]
        else:
            tensors = self._anchor_tensors()
            weight = tensors[f"lm.{names[0]}"]
            bias = tensors[f"lm.{names[1]}"] if len(names) > 1 else None
        to = dict(dtype=hidden.dtype, device=hidden.device)
        return ExactKLAnchor(hidden, weight.to(**to), None if bias is None else bias.to(**to), direction)  # type: ignore[arg-type]

    def _frozen_head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The frozen lm_head (LoRA), detached; under FSDP2 all-gathered once (it never changes)."""
        if self._anchor_head is None:
            full = [None if t is None else (t.full_tensor() if hasattr(t, "full_tensor") else t).detach() for t in self._head]
            self._anchor_head = (0, full[0], full[1])  # type: ignore[arg-type]
        return self._anchor_head[1], self._anchor_head[2]

    def restore(self, path: Any, anchor_state: dict[str, torch.Tensor] | None, schedule: dict[str, Any]) -> None:
        """Load the optimizer, LR schedule and anchor of the checkpoint at ``path`` (the weights came with the model),
        resharded to this run's world size. ``anchor_state``: a format-2 checkpoint's full anchor."""
        from pathlib import Path

        from trainer.checkpoint import load_optimizer_state, load_scheduler_state
        from trainer.reshard import has_training_state, load_full_optimizer_state, load_training_state

        path = Path(path)
        if has_training_state(path):
            load_training_state(path / "state", self.forward, self.optimizer, self.anchor)
        else:
            opt = load_optimizer_state(path)
            if opt is not None:
                load_full_optimizer_state(self.forward, self.optimizer, opt, sharded=self.fsdp)
        sched = load_scheduler_state(path)
        if sched is not None:
            self.scheduler.load_state_dict(sched)
        if self.anchor is not None:
            if not has_training_state(path) and getattr(self.anchor, "tensors", None):
                if anchor_state is None:
                    raise ConfigError(f"{path} has no anchor.safetensors but algorithm.kl is enabled")
                # A full (unsharded) anchor; under FSDP each rank keeps its own shards.
                self.anchor.load_full_state_dict(anchor_state)
            if hasattr(self.anchor, "num_updates"):
                self.anchor.num_updates = int(schedule.get("num_updates", 0))
                self.anchor.last_update_step = schedule.get("last_update_step")

    # ------------------------------------------------------------------ recoveries (trainer.recovery's actions)
    def lower_lr(self, factor: float) -> float:
        """Scale the learning rate, now and for the rest of the schedule, by ``factor``; the new rate."""
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
        self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]
        return self.optimizer.param_groups[0]["lr"]

    @torch.no_grad()
    def reset_to_anchor(self) -> None:
        """Copy the EMA anchor into the policy and clear the optimizer's moments (those of a collapse would
        push straight back). Needs the anchor."""
        if self.anchor is None:
            raise ConfigError("reset_to_anchor needs the EMA anchor (algorithm.kl.enabled=true)")
        self.anchor.copy_to_model()
        self.optimizer.state.clear()

    def load_weights(self, path: Any) -> None:
        """Load the policy weights saved in checkpoint ``path`` (``<path>/policy/*.safetensors``) into the model
        in place (an unsharded run); a file set that does not match the model is a :class:`TrainingError`."""
        from pathlib import Path

        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for f in sorted((Path(path) / "policy").glob("*.safetensors")):
            weights.update(load_file(str(f)))
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        if unexpected or (missing and not tied):
            raise TrainingError(f"{path}/policy does not match the policy (missing {missing[:3]}, unexpected {unexpected[:3]})")

    def checkpoint_state(self, *, is_main: bool) -> dict[str, Any]:
        """The ``save_checkpoint`` arguments this policy owns (collectives under FSDP: every rank calls it)."""
        from trainer.reshard import save_training_state

        if self.lora is not None:  # policy/ is the peft adapter folder
            from trainer.lora import AdapterFolderWriter

            policy_state, model = (self.adapter_weights() if self.fsdp else None), AdapterFolderWriter(self.model)
        else:
            policy_state, model = (self.export_weights(all_ranks=False) if self.fsdp else None), self.model
        return {
            "policy_state": policy_state,
            "model": model,
            "anchor_state": None,
            "optimizer_state": None,
            "write_state": lambda folder: save_training_state(folder, self.forward, self.optimizer, self.anchor),
            "scheduler_state": self.scheduler.state_dict(),
        }

    def anchor_schedule(self) -> dict[str, Any]:
        """The anchor's blend counters, saved in the trainer state."""
        a = self.anchor
        return {} if a is None else {"num_updates": a.num_updates, "last_update_step": a.last_update_step}

    def export_weights(self, *, all_ranks: bool) -> dict[str, torch.Tensor]:
        """What the engine loads (gathered from the shards under FSDP; ``all_ranks=False``: on rank 0 only):
        the full HF-named state dict, or with LoRA the adapters (``model.lora.engine_weights=adapters``,
        peft saved names, see :meth:`adapter_weights`) or the HF-named weights with the adapters merged."""
        if self.lora is not None and self.lora.engine_weights == "adapters":
            return self.adapter_weights()
        sd = {k.removeprefix("lm."): v for k, v in D.full_state_dict(self.forward, all_ranks=all_ranks).items()}
        if self.lora is not None and sd:
            from trainer.lora import merged_state_dict

            sd = merged_state_dict(sd, self.lora.scaling)
        return sd

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """LoRA: the adapters as full CPU tensors under peft's saved names (all-gathered under FSDP2: every
        rank calls it, and every rank gets them -- they are megabytes)."""
        from trainer.lora import adapter_parameters, saved_adapter_name

        out = {}
        for name, p in adapter_parameters(self.model):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[saved_adapter_name(name)] = full.detach().cpu().clone()
        return out


def build_policy(cfg: TrainConfig, dist: D.DistInfo, model_path: str, *, bf16: bool) -> Policy:
    """Load ``model_path`` (fp32 master weights), shard it (FSDP2 under torchrun), and add AdamW, the
    warm-up schedule and, with a KL term, the EMA anchor."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if cfg.model.attn_implementation:
        kwargs["attn_implementation"] = cfg.model.attn_implementation
    lora = cfg.model.lora if cfg.model.lora.enabled else None
    if is_adapter_folder(model_path):  # a LoRA run's checkpoint: its base plus the saved adapters
        if lora is None:
            raise ConfigError(f"{model_path} holds LoRA adapters; set model.lora.enabled=true to resume training them")
        from trainer.lora import load_adapter_model

        model = load_adapter_model(model_path, trainable=True, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
        if lora is not None:
            from emapg.models import ALIASES
            from trainer.lora import apply_lora

            # The adapter folder names its base: an alias as given (portable), else the folder loaded.
            alias = cfg.model.policy if cfg.model.policy.lower() in ALIASES else None
            # Seeded by run.seed alone: every rank draws the same A (FSDP2 shards each rank's own copy),
            # and the ranks' own RNG streams are left as they were.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.run.seed)
                model = apply_lora(model, lora, base_model_name_or_path=alias or os.path.abspath(model_path))
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    fsdp = cfg.distributed.fsdp == "on" or (cfg.distributed.fsdp == "auto" and dist.distributed)
    if dist.distributed and not fsdp:
        raise ConfigError("multi-process training needs distributed.fsdp=on or auto")
    world = dist.world_size
    if cfg.data.prompts_per_step % world or cfg.algorithm.mini_batch_size % world:
        raise ConfigError(
            f"data.prompts_per_step ({cfg.data.prompts_per_step}) and algorithm.mini_batch_size "
            f"({cfg.algorithm.mini_batch_size}) are global and must be multiples of the {world} processes"
        )
    model.to(dist.device)
    forward = PolicyForward(model)
    if fsdp:
        D.apply_fsdp2(forward, bf16=bf16, cpu_offload=cfg.distributed.cpu_offload)
    model.train()

    o = cfg.optim
    trainable = [p for p in forward.parameters() if p.requires_grad]  # LoRA: the adapters only
    optimizer = torch.optim.AdamW(
        trainable, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
        foreach=dist.device.type == "cuda" or None,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup_constant(cfg.warmup_steps))
    anchor: Any = None
    ema = cfg.algorithm.ema
    if cfg.algorithm.kl.enabled and lora is not None and ema.decay == 1.0:
        anchor = AdaptersOffReference()  # GRPO's frozen reference: the base, no tensors at all
    elif cfg.algorithm.kl.enabled:
        from trainer.ema import EMAAnchor

        anchor = EMAAnchor(
            model,
            anchor_decay=ema.decay,
            update_period=ema.period,
            dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[ema.dtype],
            device="cpu" if ema.offload else None,
            # The FSDP2 root is the forward wrapper (it owns embeddings/lm_head): resharding it around
            # swap_into keeps anchor passes from reading the policy's unsharded weights.
            fsdp_root=forward if fsdp else None,
            # LoRA: the EMA of the adapters (fp32 by default); anchor passes run the shared base with them.
            only=None if lora is None else [n for n, _ in adapter_parameters(model)],
        )
    return Policy(model, forward, fsdp=fsdp, bf16=bf16, optimizer=optimizer, scheduler=scheduler, anchor=anchor,
                  share_prompt=cfg.model.share_prompt, share_prompt_training=cfg.model.share_prompt_training, lora=lora)


def flush_denormal_on() -> bool:
    """Whether this thread's CPU arithmetic flushes subnormal floats to zero (torch has no getter: a subnormal times one)."""
    return float(torch.tensor([1e-39], dtype=torch.float32) * 1.0) == 0.0


def set_numerics(cfg: TrainConfig, dev: torch.device) -> Callable[[], None]:
    """``run.deterministic``: deterministic torch algorithms (bit-for-bit resume on GPU); ``run.flush_denormal``:
    subnormal floats flushed to zero in CPU arithmetic (this thread's, and the threads it starts after this).

    Returns what puts the flush back as it was: the flush is process state (the CPU's control register), and code that
    runs after training in the same thread (numpy, hypothesis' float strategies) must see IEEE subnormals again."""
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        if dev.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if cfg.run.flush_denormal:
        import numpy as np

        for dtype in (np.float16, np.float32, np.float64):  # numpy reads its limits once; after the flush it would warn
            np.finfo(dtype)  # that the smallest subnormal is zero
        was_on = flush_denormal_on()
        torch.set_flush_denormal(True)
        return lambda: None if was_on else torch.set_flush_denormal(False)
    return lambda: None
