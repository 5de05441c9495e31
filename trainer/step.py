"""The update half of a training step: the micro-batch loss and the PPO update.

* :func:`compute_loss` — pure: the policy's fresh statistics of one micro-batch, the stored
  statistics, the algorithm settings and the optimizer step's :class:`~trainer.algo.grpo.LossAggregation`
  → the loss to ``backward()`` (PPO clipped policy-gradient term − entropy bonus + β · the KL
  kind's term, each normalised for the whole mini-batch) and its metrics.
* :func:`policy_pass` — the differentiable forward that produces those statistics, asking the
  model for what the :class:`~trainer.stored_stats.StatsPlan` says the loss needs (q to gather
  on, its own top-k when fused, the exact KL against the stored anchor hidden states); with
  ``model.share_prompt_training`` each distinct prompt of the micro-batch runs once.
* :func:`ppo_update` — PPO epochs over mini-batches, gradient accumulation over micro-batches
  (:func:`~trainer.batch.micro_batches`: fixed rows, or packed by a token budget), gradient clipping, and skipping an
  optimizer step whose loss or gradient is not finite on any rank.  Its metrics are named sums
  (:class:`~trainer.metrics.MetricSums`) the caller reduces across ranks once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import Tensor

from trainer import distributed as D
from trainer.batch import MicroBatch, TokenBatch
from trainer.algo.behavior import behavior_correction, kl_old_logp
from trainer.algo.distill import distill_loss, get_distill_estimator, teacher_from_stored
from trainer.config import AlgorithmConfig, TrainConfig
from trainer.algo.grpo import LossAggregation, compute_policy_loss
from trainer.algo.kl_kinds import get_kl_kind
from trainer.algo.token_stats import TokenStats
from trainer.metrics import MetricSums
from trainer.policy import Policy
from trainer.batch import micro_batches
from trainer.stored_stats import StatsPlan, fused_anchor_stats

__all__ = ["compute_loss", "policy_pass", "ppo_update", "UpdateResult", "anchor_from_stored"]


def anchor_from_stored(stored: Mapping[str, Tensor], policy: TokenStats) -> TokenStats:
    """The anchor's :class:`TokenStats` from stored tensors (the policy's own, detached, where none are stored)."""
    return TokenStats(
        logp=stored["anchor_logp"] if "anchor_logp" in stored else policy.logp.detach(),
        logsumexp=stored["anchor_logsumexp"] if "anchor_logsumexp" in stored else policy.logsumexp.detach(),
        topk_logits=stored.get("anchor_topk_logits"),
        topk_indices=stored.get("topk_indices"),
    )


def compute_loss(
    policy: TokenStats,
    micro_batch: MicroBatch,
    stored: Mapping[str, Tensor],
    alg: AlgorithmConfig,
    agg: LossAggregation,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss of one micro-batch, already normalised for the whole mini-batch (all ranks), and its metrics.

    ``policy``: the policy's differentiable statistics on ``micro_batch`` (``(B, T)``, gathered on
    q for Top-k kinds, with ``exact_kl`` for the exact kinds); ``stored``: ``advantages`` and
    what :mod:`trainer.stored_stats` stored (no ``old_logp``: on-policy, π_old = the policy
    itself, detached; ``behavior_logp``: the engine's sampling log-probs, the behaviour policy of
    :mod:`trainer.algo.behavior`, whose weights multiply the PPO term and the importance weights of the KL and
    distillation terms).
    Returns ``(loss, metrics)`` with the metrics of
    :func:`trainer.algo.grpo.compute_policy_loss` and, with a KL term, of :meth:`trainer.algo.kl_kinds.KLKind.loss`.
    """
    mask = micro_batch.loss_mask
    policy, student = _split_distill_topk(policy, stored, alg)
    old_logp = stored["old_logp"] if "old_logp" in stored else policy.logp.detach()
    behavior = behavior_correction(old_logp, stored, mask, alg)
    loss, metrics = compute_policy_loss(
        policy.logp, old_logp, stored["advantages"], mask, agg,
        clip_low=alg.clip_low, clip_high=alg.clip_high, dual_clip_c=alg.dual_clip,
        log_ratio_clamp=20.0 if alg.dual_clip is not None else None,
        entropy=policy.entropy, entropy_coef=alg.entropy_coef,
        token_weights=behavior.weights if behavior is not None else None,  # None: w = 1, today's objective
    )
    if behavior is not None:
        metrics.update(behavior.metrics)
    # The sampled terms' importance weight πθ/π_old becomes (πθ/π_old)·w: their samples came from the engine, μ.
    weighted_old = None if behavior is None or behavior.weights is None else kl_old_logp(old_logp, behavior.weights)
    teacher = teacher_from_stored(stored) if alg.distill.enabled else None
    if teacher is not None:  # trainer.algo.distill: the teacher's scores are stored beside the anchor's
        dloss, dmetrics = distill_loss(alg.distill.estimator, student, teacher, micro_batch.labels, mask, agg,
                                       old_logp=stored.get("old_logp") if weighted_old is None else weighted_old,
                                       row_weights=stored.get("distill_rows"))
        loss = alg.distill.coef * dloss + (0.0 if alg.distill.mode == "alone" else loss)
        metrics.update(dmetrics)
    kl = alg.kl
    if kl.enabled:
        kl_old = old_logp if weighted_old is None else weighted_old
        kloss, kl_metrics = get_kl_kind(kl.type).loss(
            policy, anchor_from_stored(stored, policy), micro_batch.labels, mask, agg, cfg=kl, old_logp=kl_old
        )
        loss = loss + kl.coef * kloss
        metrics.update(kl_metrics)
    return loss, metrics


def _distill_topk(stored: Mapping[str, Tensor], alg: AlgorithmConfig) -> Tensor | None:
    """The teacher's top-k indices the student gathers on (a top-k distillation estimator), else ``None``."""
    if not alg.distill.enabled or "teacher_topk_indices" not in stored:
        return None
    return stored["teacher_topk_indices"] if get_distill_estimator(alg.distill.estimator).needs_topk else None


def _split_distill_topk(policy: TokenStats, stored: Mapping[str, Tensor], alg: AlgorithmConfig) -> tuple[TokenStats, TokenStats]:
    """The training pass gathered the KL's q and then the teacher's top-k (:func:`policy_pass`): the KL's view and the student's."""
    idx = _distill_topk(stored, alg)
    if idx is None or policy.topk_logits is None:
        return policy, policy
    k = policy.topk_logits.shape[-1] - idx.shape[-1]
    kl_view = TokenStats(policy.logp, policy.logsumexp, policy.topk_logits[..., :k] if k else None,
                         policy.topk_indices[..., :k] if k and policy.topk_indices is not None else None,
                         policy.entropy, policy.exact_kl)
    student = TokenStats(policy.logp, policy.logsumexp, policy.topk_logits[..., k:], idx, policy.entropy)
    return kl_view, student


def policy_pass(policy: Policy, mb: MicroBatch, plan: StatsPlan, cfg: TrainConfig) -> tuple[TokenStats, dict[str, Tensor]]:
    """The policy's differentiable statistics on ``mb`` and the micro-batch's complete stored statistics."""
    stored: dict[str, Tensor] = dict(mb.stored)
    on_policy = "old_logp" not in stored
    kwargs = dict(entropy=cfg.algorithm.entropy_coef != 0.0 or on_policy, temperature=cfg.rollout.temperature,
                  chunk_size=cfg.model.chunk_size, share_prompt=policy.share_prompt_training)
    distill_idx = _distill_topk(stored, cfg.algorithm)
    if distill_idx is not None:  # gathered after the KL's q, if any (split again in compute_loss)
        if plan.fused_topk:
            raise ValueError("top-k distillation gathers on the teacher's top-k: plan the step without fused_topk")
        q = stored.get("topk_indices") if plan.exact is None else None
        gather = distill_idx if q is None else torch.cat([q.to(distill_idx.dtype), distill_idx], -1)
        exact = dict(exact_kl_to=policy.exact_kl_anchor(stored["anchor_hidden"], plan.exact)) if plan.exact is not None else {}
        stats = policy.stats(mb, gather_indices=gather, **exact, **kwargs)
    elif plan.fused_topk:
        stats = policy.stats(mb, topk=plan.fused_topk, **kwargs)
        stats.topk_indices = stats.topk_indices.detach()
        stored.update(fused_anchor_stats(mb, policy, stats.topk_indices, cfg))
    elif plan.exact is not None:
        stats = policy.stats(mb, exact_kl_to=policy.exact_kl_anchor(stored["anchor_hidden"], plan.exact), **kwargs)
    else:
        stats = policy.stats(mb, gather_indices=stored.get("topk_indices"), **kwargs)
    return stats, stored


@dataclass
class UpdateResult:
    """What one :func:`ppo_update` did: per-rank metric sums (reduce them), gradient norms, update counts."""

    sums: MetricSums = field(default_factory=MetricSums)
    grad_norms: list[float] = field(default_factory=list)
    updates: int = 0
    skipped: int = 0


def _accumulate(sums: MetricSums, m: Mapping[str, Tensor], stats: TokenStats, mb: MicroBatch, on_policy: bool) -> None:
    tokens = float(m["tokens"])
    sums.add("update/tokens", tokens)
    sums.add("update/computed_tokens", float(mb.attention_mask.numel()))  # what the forward ran on, padding included
    sums.add("update/real_tokens", float(mb.attention_mask.sum()))
    sums.add("update/clipfrac_sum", float(m["pg_clipfrac"]) * tokens)
    sums.add("update/ppo_kl_sum", float(m["ppo_kl"]) * tokens)
    sums.add("update/ratio_sum", float(m["ratio_mean"]) * tokens)
    sums.add("update/pg_loss", float(m["pg_loss"]))
    if "kl" in m:
        sums.add("update/kl_token_sum", float(m["kl_token_mean"]) * tokens)
        sums.add("update/kl_loss", float(m["kl"]))
    for name, value in m.items():  # trainer.algo.behavior: mismatch and correction sums (and one maximum)
        if name.startswith("behavior/") and name.endswith("_max"):
            sums.maximum(name, float(value))
        elif name.startswith(("behavior/", "distill/")):  # trainer.algo.distill's sums too
            sums.add(name, float(value))
    if on_policy:  # π_old's entropy is the training pass's (no π_old pass ran)
        sums.add("rollout/entropy_sum", float((stats.entropy.detach() * mb.loss_mask).sum()))


def ppo_update(
    batch: TokenBatch,
    policy: Policy,
    plan: StatsPlan,
    cfg: TrainConfig,
    dist: D.DistInfo,
    *,
    warn: Callable[[str], None] = print,
) -> UpdateResult:
    """PPO epochs over this rank's rows of ``batch`` (``batch.stored`` holds ``advantages`` and the
    stored statistics): ``algorithm.mini_batch_size`` rows (over all ranks) per optimizer step, the
    gradients of its micro-batches (``micro_batch_size`` rows, or ``micro_batch_tokens`` padded tokens) accumulated, clipped to ``optim.grad_clip``.
    A step whose loss or gradient is NaN/inf on any rank is skipped (``warn`` says so)."""
    alg = cfg.algorithm
    n = batch.size
    mini = max(1, alg.mini_batch_size // dist.world_size)
    optimizer = policy.optimizer
    result = UpdateResult()
    # Each mini-batch's micro-batches, planned once for every epoch.
    minis = [micro_batches(batch, range(start, min(start + mini, n)), alg, share_prompts=cfg.model.share_prompt)
             for start in range(0, n, mini)]
    for _ in range(alg.ppo_epochs):
        for micro in minis:
            agg = LossAggregation.for_batch(
                alg.loss_agg, [batch.loss_mask[r] for r in micro], num_micro_batches=len(micro),
                all_reduce=D.all_reduce_sum if dist.distributed else None, norm_length=float(cfg.rollout.max_response_tokens),
            )
            optimizer.zero_grad(set_to_none=True)
            finite = True
            for rows in micro:
                mb = batch.micro(rows, dist.device)
                stats, stored = policy_pass(policy, mb, plan, cfg)
                loss, metrics = compute_loss(stats, mb, stored, alg, agg)
                _accumulate(result.sums, metrics, stats, mb, on_policy="old_logp" not in stored)
                if not torch.isfinite(loss.detach()).all():
                    finite = False
                loss.backward()
            gn = _grad_norm(policy, cfg.optim.grad_clip)
            flag = torch.tensor([0.0 if (finite and math.isfinite(gn)) else 1.0])
            if D.all_reduce_max(flag).item() > 0:
                result.skipped += 1
                optimizer.zero_grad(set_to_none=True)
                warn(f"non-finite loss or gradient (norm {gn}); update skipped")
                continue
            result.grad_norms.append(gn)
            optimizer.step()
            result.updates += 1
    optimizer.zero_grad(set_to_none=True)
    return result


def _grad_norm(policy: Policy, clip: float) -> float:
    """The global gradient norm (clipped to ``clip`` when > 0), the same number on every rank."""
    params = list(policy.parameters())
    if clip > 0:
        gn = torch.nn.utils.clip_grad_norm_(params, clip)
    else:
        gn = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
