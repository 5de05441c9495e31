"""GRPO: group advantages, the PPO clipped policy loss, loss aggregation, and the KL loss entry.

One EMA-PG step with TopkReverseKL (search setting), shapes ``(B, T)`` over response tokens::

    # after the rollout, no grad: π_old's log-probs and top-k ids, then the anchor at those ids
    old = causal_lm_token_stats(model, ids, attn, T, topk=32).detach()
    with anchor.swap_into():
        ref = causal_lm_token_stats(model, ids, attn, T, gather_indices=old.topk_indices).compact()
    adv = grpo_advantages(rewards, prompt_uuids)                  # (N,)
    # per optimizer step, per micro-batch
    agg = LossAggregation.for_batch("token-mean", step_loss_masks, num_micro_batches=M)
    cur = causal_lm_token_stats(model, ids, attn, T, gather_indices=old.topk_indices)
    pg, m1 = compute_policy_loss(cur.logp, old.logp, adv, mask, agg, clip_low=0.2, clip_high=0.28)
    kl, m2 = get_kl_kind("topk_reverse").loss(cur, ref, ids[:, -T:], mask, agg,
                                              cfg=KLConfig(topk=32), old_logp=old.logp)
    (pg + beta * kl).backward()
    # after the step's optimizer updates
    anchor.maybe_update(step)                                     # steps count from 1

(The math setting: kind ``k3`` with ``importance_weight=False``, ``seq-mean-token-mean``,
``dual_clip_c=3.0``, ``log_ratio_clamp=20.0``; η = 0.95.)

``agg`` is built once per optimizer step from the loss mask of the **whole** step (every
micro-batch, and every data-parallel rank with ``all_reduce``), so summing the
micro-batch losses gives exactly the full-batch loss whatever the micro-batch size.  The one
exception is the ``microbatch-token-mean`` mode, which reproduces the Search-R1 / paper-search
behaviour (per-micro-batch masked mean divided by the accumulation count) and therefore does
depend on how the batch is split.

Loss masks are 0 on tool-observation and padding tokens; those tokens then receive exactly
zero gradient: the per-token losses are multiplied by the mask, not indexed, non-finite values
there are zeroed first so a NaN in an observation cannot leak into the value, and the PPO ratio
of a masked token is exp(0) (its log ratio is masked *before* the exponential), so a ratio that
would overflow there cannot turn its zero gradient into 0·inf = NaN either.

The KL term of the loss is its kind's (:mod:`trainer.algo.kl_kinds`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Literal, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.algo.kl import LOG_RATIO_CLAMP

__all__ = [
    "group_index",
    "grpo_advantages",
    "broadcast_advantages",
    "ppo_clip_loss",
    "AggMode",
    "AGG_MODES",
    "LossAggregation",
    "aggregate_loss",
    "compute_policy_loss",
    "masked_mean",
]

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "microbatch-token-mean"]
AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "microbatch-token-mean",
)

# ---------------------------------------------------------------------------------------------
# Advantages


def group_index(group_ids: Sequence[Hashable] | Tensor) -> Tensor:
    """Map arbitrary hashable group ids (uuid strings, ints, tuples) to 0..G−1, first-seen order.

    Ids must be unique **per prompt** (e.g. a uuid4 per prompt); per-dataset row indices are
    not, and merge groups across datasets (the Search-R1 / ema-pg-search uid quirk).
    """
    ids = group_ids.tolist() if isinstance(group_ids, Tensor) else list(group_ids)
    mapping: dict[Hashable, int] = {}
    return torch.tensor([mapping.setdefault(g, len(mapping)) for g in ids], dtype=torch.long)


def grpo_advantages(
    rewards: Tensor,
    group_ids: Sequence[Hashable] | Tensor,
    *,
    norm_by_std: bool = True,
    unbiased_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Outcome advantages ``(N,)`` from scalar rewards ``(N,)`` grouped by prompt.

    A_i = (R_i − mean_g) / (std_g + eps), std unbiased (N−1, the paper's torch default) or
    biased; ``norm_by_std=False`` is Dr.GRPO's A_i = R_i − mean_g.  A group of size 1 gets
    mean 0 and std 1 (paper code), so its advantage is R_i / (1 + eps), or R_i with Dr.GRPO.
    Computed in float64 and returned in the rewards' float dtype.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (N,), got {tuple(rewards.shape)}")
    idx = group_index(group_ids).to(rewards.device)
    if idx.numel() != rewards.numel():
        raise ValueError(f"{idx.numel()} group ids for {rewards.numel()} rewards")
    r = rewards.to(torch.float64)
    G = int(idx.max()) + 1 if idx.numel() else 0
    count = torch.bincount(idx, minlength=G).to(torch.float64)
    mean = torch.zeros(G, dtype=torch.float64, device=r.device).index_add_(0, idx, r) / count
    sq = torch.zeros(G, dtype=torch.float64, device=r.device).index_add_(0, idx, (r - mean[idx]) ** 2)
    var = sq / (count - 1).clamp(min=1) if unbiased_std else sq / count
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(var), var.sqrt())
    adv = r - mean[idx]
    if norm_by_std:
        adv = adv / (std[idx] + eps)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def broadcast_advantages(advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """``(N,)`` sequence advantages → ``(N, T)`` token advantages, zero where the mask is 0."""
    return advantages[:, None].to(torch.float32) * loss_mask.to(torch.float32)


# ---------------------------------------------------------------------------------------------
# PPO clipped loss


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip_c: float | None = None,
    log_ratio_clamp: float | None = None,
    loss_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO loss ``(B, T)`` and per-token indicator tensors.

    loss = max(−A·ρ, −A·clip(ρ, 1−clip_low, 1+clip_high)), ρ = exp(logp − old_logp); with
    ``dual_clip_c = c`` (math: 3.0) tokens with A < 0 are further capped at −A·c.
    ``log_ratio_clamp`` (math: 20.0) clamps log ρ before ``exp``.  ``advantages`` is ``(B, T)``
    or ``(B,)`` (broadcast over tokens).  With ``loss_mask`` the log ratio is 0 outside the mask
    (ρ = 1 there): masked tokens are dropped from the loss anyway, and an overflowing ρ would
    make their zero gradient 0·inf = NaN.

    Returned indicators (float, ``(B, T)``): ``ratio``, ``clipped_low`` (ρ < 1−ε_low with A < 0,
    the clipped branch is active), ``clipped_high`` (ρ > 1+ε_high with A > 0), ``dual_clipped``.
    """
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    if clip_low < 0 or clip_high < 0:
        raise ValueError("clip ranges must be non-negative")
    if advantages.dim() == logp.dim() - 1:
        advantages = advantages[..., None]
    advantages = advantages.to(logp.dtype).detach()
    log_ratio = logp - old_logp.detach()
    if loss_mask is not None:
        log_ratio = torch.where(loss_mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    if log_ratio_clamp is not None:
        log_ratio = torch.clamp(log_ratio, -log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = (clipped > unclipped).detach()
    neg = (advantages < 0).expand_as(loss)
    info = {
        "ratio": ratio.detach(),
        "clipped_low": (clip_active & neg).float(),
        "clipped_high": (clip_active & ~neg).float(),
    }
    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c
        dual = neg & (loss > cap).detach()
        loss = torch.where(neg, torch.minimum(loss, cap), loss)
        info["dual_clipped"] = dual.float()
    else:
        info["dual_clipped"] = torch.zeros_like(loss, dtype=torch.float32)
    return loss, info


# ---------------------------------------------------------------------------------------------
# Aggregation


@dataclass(frozen=True)
class LossAggregation:
    """How per-token losses of one micro-batch become the scalar to ``backward()``.

    Normalisers are those of the **whole optimizer step** (all micro-batches, all ranks):

    * ``token-mean``: Σ_tokens loss / ``global_tokens`` (DAPO; paper search ≈ this).
    * ``seq-mean-token-mean``: Σ_seqs mean_tokens(loss) / ``global_seqs`` (paper math).
    * ``seq-mean-token-sum``: Σ_seqs Σ_tokens loss / ``global_seqs``.
    * ``seq-mean-token-sum-norm``: Σ_tokens loss / (``global_seqs`` · ``norm_length``) (Dr.GRPO;
      ``norm_length`` is a constant, usually the maximum response length).
    * ``microbatch-token-mean`` (legacy): masked mean over the micro-batch / ``num_micro_batches``
      (Search-R1 / paper search code; depends on micro-batch composition).

    Sequences without any loss token count in neither normaliser.  ``dp_size`` multiplies the
    loss to undo the gradient *averaging* of DDP/FSDP, so the rank-summed gradient is that of
    the global normalised loss.
    """

    mode: AggMode
    global_tokens: float
    global_seqs: float
    norm_length: float | None = None
    num_micro_batches: int = 1
    dp_size: int = 1

    def __post_init__(self) -> None:
        if self.mode not in AGG_MODES:
            raise ValueError(f"unknown loss aggregation mode {self.mode!r}; known: {', '.join(AGG_MODES)}")
        if self.mode == "seq-mean-token-sum-norm" and not (self.norm_length and self.norm_length > 0):
            raise ValueError("seq-mean-token-sum-norm needs norm_length > 0 (e.g. the max response length)")
        if self.num_micro_batches < 1 or self.dp_size < 1:
            raise ValueError("num_micro_batches and dp_size must be >= 1")

    @classmethod
    def for_batch(
        cls,
        mode: AggMode,
        loss_mask: Tensor | Sequence[Tensor],
        *,
        num_micro_batches: int = 1,
        norm_length: float | None = None,
        all_reduce: Callable[[Tensor], Tensor] | None = None,
    ) -> "LossAggregation":
        """Build from the loss mask(s) of every micro-batch of this optimizer step.

        ``loss_mask``: one ``(N, T)`` tensor or a list of per-micro-batch masks (lengths may
        differ).  ``all_reduce`` (e.g. :func:`trainer.distributed.all_reduce_sum`) sums the counts over
        the default process group, and ``dp_size`` becomes its world size.
        """
        masks = [loss_mask] if isinstance(loss_mask, Tensor) else list(loss_mask)
        tokens = sum(float(m.sum()) for m in masks)
        seqs = sum(float((m.sum(-1) > 0).sum()) for m in masks)
        dp = 1
        if all_reduce is not None and dist.is_available() and dist.is_initialized():
            counts = all_reduce(torch.tensor([tokens, seqs], dtype=torch.float64))
            tokens, seqs = float(counts[0]), float(counts[1])
            dp = dist.get_world_size()
        return cls(mode, tokens, seqs, norm_length, num_micro_batches, dp)

    def __call__(self, values: Tensor, loss_mask: Tensor) -> Tensor:
        return aggregate_loss(values, loss_mask, self)


def aggregate_loss(values: Tensor, loss_mask: Tensor, agg: LossAggregation) -> Tensor:
    """Scalar loss of one micro-batch from per-token ``values`` ``(B, T)`` and ``loss_mask`` ``(B, T)``."""
    if values.shape != loss_mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and loss_mask {tuple(loss_mask.shape)} differ")
    mask = loss_mask.to(values.dtype)
    # Zero masked positions with `where` first: 0 * NaN would be NaN (and so would its gradient).
    masked = torch.where(loss_mask.bool(), values, torch.zeros_like(values)) * mask
    mode = agg.mode
    if mode == "microbatch-token-mean":
        total = masked.sum() / mask.sum().clamp(min=1) / agg.num_micro_batches
    elif mode == "token-mean":
        total = masked.sum() / max(agg.global_tokens, 1.0)
    elif mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1)
        total = per_seq.sum() / max(agg.global_seqs, 1.0)
    elif mode == "seq-mean-token-sum":
        total = masked.sum() / max(agg.global_seqs, 1.0)
    else:  # seq-mean-token-sum-norm
        total = masked.sum() / (max(agg.global_seqs, 1.0) * float(agg.norm_length))
    return total * agg.dp_size


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over the tokens where ``mask`` is set, in float32 (0 when none is); non-finite
    values outside the mask are ignored."""
    m = mask.to(torch.float32)
    return (torch.where(mask.bool(), x.float(), torch.zeros_like(x, dtype=torch.float32)) * m).sum() / m.sum().clamp(min=1)


# ---------------------------------------------------------------------------------------------
# Entries called by the trainer


def compute_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    agg: LossAggregation,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip_c: float | None = None,
    log_ratio_clamp: float | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Aggregated PPO/GRPO policy loss of one micro-batch, minus ``entropy_coef``·entropy.

    Args:
        logp, old_logp: ``(B, T)`` log-probs of the sampled tokens (current / rollout policy).
        advantages: ``(B, T)`` or ``(B,)``.
        loss_mask: ``(B, T)``, 0 on prompt padding, response padding and tool observations.
        agg: the optimizer step's :class:`LossAggregation`.
        entropy: optional ``(B, T)`` policy entropy (e.g. ``TokenStats.entropy``); always
            reported, subtracted ×``entropy_coef`` (0 in both paper settings).
        token_weights: optional ``(B, T)`` constant weights of the per-token PPO loss (the decoupled
            objective's behaviour correction, :mod:`trainer.algo.behavior`); ``None`` is weight 1.

    Returns ``(loss, metrics)``; metrics are detached 0-dim tensors, token means over this
    micro-batch's mask (weight them by ``metrics["tokens"]`` to average over micro-batches):
    ``pg_loss`` (aggregated PG term), ``pg_clipfrac``, ``pg_clipfrac_low``,
    ``pg_clipfrac_high``, ``pg_clipfrac_dual``, ``ppo_kl`` (mean log π_old − log πθ),
    ``approx_kl_k3`` (K3 of π_old vs πθ), ``ratio_mean``, ``ratio_max``, ``ratio_min``,
    ``entropy`` (if given), ``tokens``.
    """
    pg_tok, info = ppo_clip_loss(
        logp, old_logp, advantages, clip_low=clip_low, clip_high=clip_high,
        dual_clip_c=dual_clip_c, log_ratio_clamp=log_ratio_clamp, loss_mask=loss_mask,
    )
    if token_weights is not None:
        pg_tok = pg_tok * token_weights.detach().to(pg_tok.dtype)
    pg = agg(pg_tok, loss_mask)
    loss = pg
    m = loss_mask.bool()
    with torch.no_grad():
        ratio = info["ratio"]
        log_ratio = (logp - old_logp).detach()
        lr_c = torch.clamp(-log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        big = torch.finfo(ratio.dtype).max
        metrics = {
            "pg_loss": pg.detach(),
            "pg_clipfrac": masked_mean(info["clipped_low"] + info["clipped_high"], m),
            "pg_clipfrac_low": masked_mean(info["clipped_low"], m),
            "pg_clipfrac_high": masked_mean(info["clipped_high"], m),
            "pg_clipfrac_dual": masked_mean(info["dual_clipped"], m),
            "ppo_kl": masked_mean(-log_ratio, m),
            "approx_kl_k3": masked_mean(torch.exp(lr_c) - lr_c - 1, m),
            "ratio_mean": masked_mean(ratio, m),
            "ratio_max": torch.where(m, ratio, torch.full_like(ratio, -big)).max() if m.any() else ratio.new_tensor(float("nan")),
            "ratio_min": torch.where(m, ratio, torch.full_like(ratio, big)).min() if m.any() else ratio.new_tensor(float("nan")),
            "tokens": m.sum().to(torch.float32),
        }
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy.detach(), m)
        if entropy_coef:
            loss = loss - entropy_coef * agg(entropy, loss_mask)
    return loss, metrics
