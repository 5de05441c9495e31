"""Behaviour-policy correction: the decoupled PPO objective with the engine as the behaviour policy.

Three policies meet in one update (AReaL's *decoupled PPO*, ALGORITHM.md notation):

* the **behaviour** policy μ — the generation engine that sampled the tokens; its log-probs are
  :attr:`agent.rollout.Trajectory.sampling_logprobs` (the processed distribution: temperature,
  top-k, top-p; see :mod:`agent.engines.base`), possibly of older weights (``rollout.max_staleness``)
  and always of other kernels and precision;
* the **proximal** policy π_prox — the trainer's recomputed π_old (the weights at the start of the
  update; the training pass's own log-probs on the one-update path);
* the policy being optimised πθ.

The decoupled objective per token is ``w · ppo_clip(πθ/π_prox, A)`` with ``w`` a function of the
behaviour ratio ρ = π_prox/μ of the sampled token, treated as a constant::

    none   w = 1                                  (today's objective: μ is ignored)
    tis    w = min(ρ, cap)                        truncated importance sampling
    mis    w = ρ · 1[low ≤ ρ ≤ high]              masked importance sampling (tokens outside the band dropped)

At θ = π_prox (and inside the clip band) the expected gradient under sampling from μ is
Σ_a μ(a) w(a) A(a) ∇log πθ(a); with the exact weight w = ρ that is the on-policy gradient
Σ_a π_prox(a) A(a) ∇log πθ(a) whenever supp(π_prox) ⊆ supp(μ). TIS's bias is
−Σ_a (π_prox(a) − cap·μ(a))₊ A(a) ∇log πθ(a); MIS keeps Σ_{a in band} π_prox(a) A(a) ∇log πθ(a).
``tests/trainer/test_behavior.py`` checks all three by enumeration.

``level``: ``token`` uses each token's ρ; ``sequence`` uses the trajectory's ρ = Π_t ρ_t over its
loss tokens (the exact sequence weight) for every token of it; ``geometric`` uses exp(mean_t log ρ_t)
(length-normalised, what verl calls geometric). Log-ratios are clamped to ±20 before ``exp``.

EMA-PG: the Top-k set q and the tail's importance weight πθ/π_old use the proximal policy; the tail's
sample came from μ, so its weight becomes (πθ/π_prox)·w (:func:`kl_old_logp` folds ``w`` into the
log-prob the KL kind divides by; the distillation estimators' importance weights take the same fold,
:mod:`trainer.algo.distill`). Conditions for an unbiased tail: ``kl.importance_weight=true``,
``w = ρ`` exactly (``tis`` with a cap no ρ reaches, ``mis`` with a band containing every ρ), and
supp(π_prox) ⊆ supp(μ) on the tail (false with ``rollout.top_p < 1``: tokens outside the nucleus are
never sampled). The Top-k head is computed exactly at every visited prefix and needs no correction.

A token MIS drops (w = 0) stays in the loss normaliser (:class:`trainer.algo.grpo.LossAggregation`), unlike verl's
rollout correction, which removes it from ``response_mask``: with a fixed normaliser the loss is an unbiased estimate
of the band-restricted on-policy objective (``tests/trainer/test_behavior.py``), and on the one-pass path a micro-batch's
rejections are known only after its forward, later than the optimizer step's normaliser (``docs/ALGORITHM.md`` §3.3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Protocol

import torch
from torch import Tensor

from trainer.algo.kl import LOG_RATIO_CLAMP

__all__ = [
    "BehaviorCorrection",
    "BehaviorSettings",
    "BehaviorTerm",
    "behavior_correction",
    "behavior_metrics",
    "BehaviorLevel",
    "BehaviorWeights",
    "BEHAVIOR_CORRECTIONS",
    "behavior_log_ratio",
    "behavior_weights",
    "drop_counts",
    "kl_old_logp",
    "mismatch_stats",
    "no_correction",
    "truncated_is",
    "masked_is",
]

BehaviorCorrection = Literal["none", "tis", "mis"]
BehaviorLevel = Literal["token", "sequence", "geometric"]


@dataclass(frozen=True)
class BehaviorWeights:
    """Per-token weights of the decoupled objective and what happened to each token (all ``(B, T)``,
    detached, 0/False outside the loss mask)."""

    weights: Tensor  # w ≥ 0
    truncated: Tensor  # bool: TIS cap bound (w = cap < ρ)
    masked: Tensor  # bool: MIS dropped the token (ρ outside the band)


def behavior_log_ratio(prox_logp: Tensor, behav_logp: Tensor, loss_mask: Tensor, level: BehaviorLevel = "token") -> Tensor:
    """log ρ ``(B, T)`` = log π_prox − log μ of the sampled tokens, per ``level``; 0 outside ``loss_mask``.

    ``prox_logp``, ``behav_logp``, ``loss_mask``: ``(B, T)``. ``sequence``/``geometric``: the
    row's sum / mean over its loss tokens, broadcast to the row's loss tokens.
    """
    m = loss_mask.bool()
    per_token = torch.where(m, (prox_logp - behav_logp).detach(), torch.zeros_like(prox_logp))
    if level == "token":
        out = per_token
    elif level in ("sequence", "geometric"):
        total = per_token.sum(-1, keepdim=True)
        if level == "geometric":
            total = total / m.sum(-1, keepdim=True).clamp(min=1)
        out = torch.where(m, total.expand_as(per_token), torch.zeros_like(per_token))
    else:
        raise ValueError(f"unknown behaviour-correction level {level!r}; choose token, sequence or geometric")
    return out.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def no_correction(log_ratio: Tensor, loss_mask: Tensor, *, cap: float, band: tuple[float, float]) -> BehaviorWeights:
    """``none``: w = 1 on loss tokens (the engine's log-probs are only reported)."""
    m = loss_mask.bool()
    none = torch.zeros_like(m)
    return BehaviorWeights(m.to(log_ratio.dtype), none, none)


def truncated_is(log_ratio: Tensor, loss_mask: Tensor, *, cap: float, band: tuple[float, float]) -> BehaviorWeights:
    """``tis``: w = min(ρ, cap) (``(B, T)`` in and out)."""
    m = loss_mask.bool()
    rho = torch.exp(log_ratio)
    truncated = m & (rho > cap)
    w = torch.where(m, rho.clamp(max=cap), torch.zeros_like(rho))
    return BehaviorWeights(w, truncated, torch.zeros_like(m))


def masked_is(log_ratio: Tensor, loss_mask: Tensor, *, cap: float, band: tuple[float, float]) -> BehaviorWeights:
    """``mis``: w = ρ where ``band[0] ≤ ρ ≤ band[1]``, else 0 (the token is dropped)."""
    m = loss_mask.bool()
    rho = torch.exp(log_ratio)
    keep = (rho >= band[0]) & (rho <= band[1])
    w = torch.where(m & keep, rho, torch.zeros_like(rho))
    return BehaviorWeights(w, torch.zeros_like(m), m & ~keep)


BEHAVIOR_CORRECTIONS: dict[str, Callable[..., BehaviorWeights]] = {
    "none": no_correction,
    "tis": truncated_is,
    "mis": masked_is,
}


def behavior_weights(
    name: str,
    prox_logp: Tensor,
    behav_logp: Tensor,
    loss_mask: Tensor,
    *,
    level: BehaviorLevel = "token",
    cap: float = 2.0,
    band: tuple[float, float] = (0.5, 2.0),
) -> BehaviorWeights:
    """The weights of correction ``name`` (``none``/``tis``/``mis``) for ``(B, T)`` log-probs."""
    try:
        fn = BEHAVIOR_CORRECTIONS[name]
    except KeyError:
        raise ValueError(f"unknown behaviour correction {name!r}; choose {', '.join(BEHAVIOR_CORRECTIONS)}") from None
    return fn(behavior_log_ratio(prox_logp, behav_logp, loss_mask, level), loss_mask, cap=cap, band=tuple(band))


def kl_old_logp(prox_logp: Tensor, weights: Tensor) -> Tensor:
    """The log-prob the KL kind's importance weight divides by so that its s = πθ/π_prox becomes (πθ/π_prox)·w.

    ``(B, T)`` in and out: log π_prox − log w. Where w = 0 (a masked token) the result is +inf-like; the
    importance weight's ±20 log clamp then makes s = e⁻²⁰, zero to float precision.
    """
    return prox_logp.detach() - torch.log(weights.clamp(min=torch.finfo(weights.dtype).tiny))


def drop_counts(bw: BehaviorWeights, loss_mask: Tensor) -> dict[str, Tensor]:
    """How many sequences (rows of ``(B, T)`` weights) a correction touched, as float sums.

    ``behavior/sequences``: rows with a loss token; ``behavior/masked_seqs``: rows all of whose loss
    tokens were dropped (the sequences ``sequence``/``geometric`` masking drops; at ``token`` level a
    row whose every token left the band); ``behavior/partly_masked_seqs``: rows with at least one
    dropped token; ``behavior/truncated_seqs``: rows with a truncated weight.
    """
    m = loss_mask.bool()
    has = m.any(-1)
    masked_n = bw.masked.sum(-1)
    return {
        "behavior/sequences": has.sum().to(torch.float32),
        "behavior/masked_seqs": (has & (masked_n == m.sum(-1))).sum().to(torch.float32),
        "behavior/partly_masked_seqs": (masked_n > 0).sum().to(torch.float32),
        "behavior/truncated_seqs": bw.truncated.any(-1).sum().to(torch.float32),
    }


def mismatch_stats(prox_logp: Tensor, behav_logp: Tensor, loss_mask: Tensor) -> dict[str, Tensor]:
    """Train–inference mismatch on the loss tokens of ``(B, T)`` log-probs (detached sums and a max).

    ``abs_diff_sum`` Σ|log π_prox − log μ|, ``abs_diff_max``, ``k3_sum`` Σ(ρ − 1 − log ρ) (K3, an
    estimate of KL(μ‖π_prox) from μ's samples), ``tokens``.
    """
    m = loss_mask.bool()
    d = torch.where(m, (prox_logp - behav_logp).detach().float(), torch.zeros_like(prox_logp, dtype=torch.float32))
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = torch.where(m, torch.exp(d) - 1 - d, torch.zeros_like(d))
    return {
        "abs_diff_sum": d.abs().sum(),
        "abs_diff_max": d.abs().max() if d.numel() else d.new_tensor(0.0),
        "k3_sum": k3.sum(),
        "tokens": m.sum().to(torch.float32),
    }


class BehaviorSettings(Protocol):
    """The ``algorithm.behavior_*`` settings :func:`behavior_correction` reads (:class:`trainer.config.AlgorithmConfig`
    is one; the math does not import the config)."""

    behavior_correction: str
    behavior_level: str
    behavior_cap: float
    behavior_band: list[float]


@dataclass(frozen=True)
class BehaviorTerm:
    """What the loss of one micro-batch takes from the behaviour policy: the PPO term's weights
    (``None`` for ``none``: the objective is today's) and the metric sums (``behavior/*``)."""

    weights: Tensor | None
    metrics: dict[str, Tensor]


def behavior_correction(prox_logp: Tensor, stored: Mapping[str, Tensor], loss_mask: Tensor,
                        alg: BehaviorSettings) -> BehaviorTerm | None:
    """The ``algorithm.behavior_correction`` term of a micro-batch, or ``None`` when ``stored`` has no
    ``behavior_logp`` (a batch that did not come from an engine). ``(B, T)`` tensors."""
    if "behavior_logp" not in stored:
        return None
    behav = stored["behavior_logp"]
    bw = behavior_weights(alg.behavior_correction, prox_logp, behav, loss_mask, level=alg.behavior_level,
                          cap=alg.behavior_cap, band=tuple(alg.behavior_band))
    mm = mismatch_stats(prox_logp, behav, loss_mask)
    metrics = {**drop_counts(bw, loss_mask),
        "behavior/tokens": mm["tokens"],
        "behavior/abs_diff_sum": mm["abs_diff_sum"],
        "behavior/abs_diff_max": mm["abs_diff_max"],
        "behavior/k3_sum": mm["k3_sum"],
        "behavior/truncated": bw.truncated.sum().to(torch.float32),
        "behavior/masked": bw.masked.sum().to(torch.float32),
        "behavior/weight_sum": bw.weights.detach().float().sum(),
    }
    return BehaviorTerm(None if alg.behavior_correction == "none" else bw.weights, metrics)


def behavior_metrics(s: Mapping[str, float]) -> dict[str, float]:
    """The logged ``mismatch/*`` and ``behavior/*`` metrics from the rank-summed ``behavior/*`` sums (empty without them)."""
    if "behavior/tokens" not in s:
        return {}
    n = max(s["behavior/tokens"], 1.0)
    return {
        "mismatch/abs_logp_diff_mean": s["behavior/abs_diff_sum"] / n,
        "mismatch/abs_logp_diff_max": s["behavior/abs_diff_max"],
        "mismatch/k3": s["behavior/k3_sum"] / n,
        "behavior/truncated_frac": s["behavior/truncated"] / n,
        "behavior/masked_frac": s["behavior/masked"] / n,
        "behavior/weight_mean": s["behavior/weight_sum"] / n,
        **({} if "behavior/sequences" not in s else {
            "behavior/masked_seq_frac": s["behavior/masked_seqs"] / max(s["behavior/sequences"], 1.0),
            "behavior/partly_masked_seq_frac": s["behavior/partly_masked_seqs"] / max(s["behavior/sequences"], 1.0),
            "behavior/truncated_seq_frac": s["behavior/truncated_seqs"] / max(s["behavior/sequences"], 1.0),
            "behavior/masked_tokens": s["behavior/masked"],
            "behavior/masked_seqs": s["behavior/masked_seqs"],
        }),
    }
