"""Top-k KL (paper §2.3–§2.4) and the exact full-vocabulary KL, chunked over tokens.

**Top-k KL.**  At every response position only O(k) numbers of each model are needed: the
logits at a set q of k token ids, the full-vocabulary logsumexp Z, and the log-prob of the
sampled token (all from :class:`trainer.algo.token_stats.TokenStats`).  Normalised log-probs on q are
``logit_j − Z``: true probabilities, not renormalised over q.  The per-token estimate is

* reverse, KL(πθ‖πref), q = top-k of the **sampling/old policy**::

      L1 = Σ_{j∈q} πθ(j)·(log πθ(j) − log πref(j))                       (exact head)
      L2 = 1[p∉q] · s · r·sg(log πθ(p) − log πref(p))                    (K4 tail)

* forward, KL(πref‖πθ), q = top-k of the **anchor**::

      L1 = Σ_{j∈q} πref(j)·(log πref(j) − log πθ(j))
      L2 = 1[p∉q] · s · (sg(w)·log w + log r),  log w = clamp(log πref(p) − log πθ(p), ±20)   (K5 tail)

  with the importance weight s = πθ(p)/π_old(p) (optional, tail only) and r = πθ/sg(πθ).

The value is exactly the KL in expectation for any fixed q.  The gradient *as coded in the
paper's release* (``tail_grad="paper"``, the default, for reproduction) is ∇KL + ∇πθ(q)
(reverse) or ∇KL − ∇πθ(q) (forward), where πθ(q) = Σ_{j∈q} πθ(j): the identity E[∇log π] = 0
behind K4/K5 holds over the whole vocabulary, not over the tail.  ``tail_grad="exact"``
removes the bias with the same values: the reverse tail keeps the gradient of the log-ratio
(r·ℓ instead of r·sg(ℓ)); the forward tail drops ``+ log r``.  Both identities are proven by
enumeration in ``tests/trainer/test_topk_kl.py``.

k = 0 reduces to the sampled K4 / K5 estimator; k = V to the exact KL.

**Exact KL.**  :func:`exact_kl` sums over the vocabulary at every token with a custom autograd
function that recomputes each chunk in backward, so beyond its (T, V) inputs and the (T, V)
gradient it keeps only chunk-sized temporaries.  It still needs the anchor's full logits per
token — the O(V) storage Top-k avoids.  :func:`exact_kl_from_hidden` removes that too: it
recomputes both models' logits per chunk from their final hidden states (our addition; what the
trainer's ``exact_reverse``/``exact_forward`` kinds run, given an :class:`ExactKLAnchor`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from trainer.algo import DEFAULT_CHUNK_SIZE
from trainer.algo.kl import LOG_RATIO_CLAMP, importance_weight
from trainer.algo.token_stats import TokenStats, compute_dtype, lm_head_backward, project_logits

__all__ = [
    "exact_kl",
    "exact_kl_from_hidden",
    "ExactKLAnchor",
    "not_in_topk_mask",
    "topk_reverse_kl",
    "topk_forward_kl",
    "topk_kl",
    "TailGrad",
    "Direction",
]

TailGrad = Literal["paper", "exact"]
Direction = Literal["reverse", "forward"]


def not_in_topk_mask(labels: Tensor, topk_indices: Tensor) -> Tensor:
    """``(B, T)`` bool: the sampled token ``labels`` is not among ``topk_indices`` ``(B, T, k)``."""
    if topk_indices.shape[:-1] != labels.shape:
        raise ValueError(f"topk_indices {tuple(topk_indices.shape)} must be labels {tuple(labels.shape)} + (k,)")
    return ~(topk_indices == labels[..., None].to(topk_indices.dtype)).any(-1)


def _check_tail_grad(tail_grad: str) -> None:
    if tail_grad not in ("paper", "exact"):
        raise ValueError(f"tail_grad must be 'paper' or 'exact', got {tail_grad!r}")


def topk_reverse_kl(
    *,
    logits_k: Tensor,
    logsumexp: Tensor,
    logp: Tensor,
    ref_logits_k: Tensor,
    ref_logsumexp: Tensor,
    ref_logp: Tensor,
    topk_indices: Tensor,
    labels: Tensor,
    old_logp: Tensor | None = None,
    iw_clip: tuple[float | None, float | None] | None = None,
    tail_sampling: bool = True,
    tail_grad: TailGrad = "paper",
) -> Tensor:
    """Per-token TopkReverseKL ``(B, T)``, an estimate of KL(πθ‖πref).

    Args:
        logits_k: ``(B, T, k)`` current-policy logits at ``topk_indices`` (differentiable).
        logsumexp: ``(B, T)`` current-policy full-vocabulary logsumexp (differentiable).
        logp: ``(B, T)`` current-policy log-prob of the sampled token (differentiable).
        ref_logits_k, ref_logsumexp, ref_logp: the same for the anchor (constants).
        topk_indices: ``(B, T, k)`` q, the top-k of the **old/sampling** policy.
        labels: ``(B, T)`` sampled token ids.
        old_logp: ``(B, T)`` log π_old of the sampled tokens; given → tail × s = πθ/π_old.
        iw_clip: optional ``(lo, hi)`` clip of s.
        tail_sampling: False drops the tail ("truncated KL", biased; paper README: distillation only).
        tail_grad: ``"paper"`` (release code, gradient ∇KL + ∇πθ(q)) or ``"exact"`` (unbiased).
    """
    _check_tail_grad(tail_grad)
    logp_k = logits_k - logsumexp[..., None]
    ref_logp_k = (ref_logits_k - ref_logsumexp[..., None]).detach()
    head = (torch.exp(logp_k) * (logp_k - ref_logp_k)).sum(-1)
    if not tail_sampling:
        return head
    ref_logp = ref_logp.detach()
    log_ratio = logp - ref_logp
    if tail_grad == "paper":
        log_ratio = log_ratio.detach()
    tail = torch.exp(logp - logp.detach()) * log_ratio
    if old_logp is not None:
        tail = importance_weight(logp, old_logp, iw_clip) * tail
    return head + not_in_topk_mask(labels, topk_indices).to(tail.dtype) * tail


def topk_forward_kl(
    *,
    logits_k: Tensor,
    logsumexp: Tensor,
    logp: Tensor,
    ref_logits_k: Tensor,
    ref_logsumexp: Tensor,
    ref_logp: Tensor,
    topk_indices: Tensor,
    labels: Tensor,
    old_logp: Tensor | None = None,
    iw_clip: tuple[float | None, float | None] | None = None,
    tail_sampling: bool = True,
    tail_grad: TailGrad = "paper",
) -> Tensor:
    """Per-token TopkForwardKL ``(B, T)``, an estimate of KL(πref‖πθ).

    Same arguments as :func:`topk_reverse_kl`, except that ``topk_indices`` is q = the top-k
    of the **anchor** (its logits there are ``ref_logits_k``).  ``tail_grad="paper"`` gives the
    gradient ∇KL − ∇πθ(q); ``"exact"`` drops the tail's ``+ log r`` and is unbiased.
    """
    _check_tail_grad(tail_grad)
    logp_k = logits_k - logsumexp[..., None]
    ref_logp_k = (ref_logits_k - ref_logsumexp[..., None]).detach()
    head = (torch.exp(ref_logp_k) * (ref_logp_k - logp_k)).sum(-1)
    if not tail_sampling:
        return head
    log_w = torch.clamp(ref_logp.detach() - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    tail = torch.exp(log_w).detach() * log_w
    if tail_grad == "paper":
        tail = tail + (logp - logp.detach())
    if old_logp is not None:
        tail = importance_weight(logp, old_logp, iw_clip) * tail
    return head + not_in_topk_mask(labels, topk_indices).to(tail.dtype) * tail


def topk_kl(
    direction: Direction,
    policy: TokenStats,
    anchor: TokenStats,
    labels: Tensor,
    *,
    old_logp: Tensor | None = None,
    iw_clip: tuple[float | None, float | None] | None = None,
    tail_sampling: bool = True,
    tail_grad: TailGrad = "paper",
) -> Tensor:
    """Top-k KL ``(B, T)`` from two :class:`TokenStats` gathered at the **same** indices.

    ``policy``: fresh current-policy stats with ``topk_logits`` gathered at the stored indices.
    ``anchor``: the stored anchor stats (``logp`` = log πref of the sampled token).
    ``policy.topk_indices`` must equal ``anchor.topk_indices`` (checked): q is the old policy's
    top-k for ``"reverse"`` and the anchor's for ``"forward"``.
    """
    for who, st in (("policy", policy), ("anchor", anchor)):
        if st.topk_logits is None or st.topk_indices is None:
            raise ValueError(f"{who} stats carry no top-k logits; compute them with gather_indices/topk")
    if policy.topk_indices.shape != anchor.topk_indices.shape or not torch.equal(
        policy.topk_indices.long(), anchor.topk_indices.long()
    ):
        raise ValueError("policy and anchor top-k logits were gathered at different indices")
    fn = {"reverse": topk_reverse_kl, "forward": topk_forward_kl}.get(direction)
    if fn is None:
        raise ValueError(f"direction must be 'reverse' or 'forward', got {direction!r}")
    return fn(
        logits_k=policy.topk_logits,
        logsumexp=policy.logsumexp,
        logp=policy.logp,
        ref_logits_k=anchor.topk_logits,
        ref_logsumexp=anchor.logsumexp,
        ref_logp=anchor.logp,
        topk_indices=anchor.topk_indices,
        labels=labels,
        old_logp=old_logp,
        iw_clip=iw_clip,
        tail_sampling=tail_sampling,
        tail_grad=tail_grad,
    )


# ---------------------------------------------------------------------------------------------
# Exact full-vocabulary KL.


def _exact_chunk(z: Tensor, zr: Tensor, reverse: bool) -> tuple[Tensor, Tensor, Tensor]:
    lp = torch.log_softmax(z, -1)
    lq = torch.log_softmax(zr, -1)
    if reverse:
        p = lp.exp()
        kl = (p * (lp - lq)).sum(-1)
        return kl, lp, lq
    q = lq.exp()
    kl = (q * (lq - lp)).sum(-1)
    return kl, lp, lq


def _exact_chunk_grad(z: Tensor, zr: Tensor, kl: Tensor, g: Tensor, reverse: bool) -> Tensor:
    """∂(g·KL)/∂z for one chunk (z: policy logits / τ, zr: anchor logits / τ), built in place."""
    _, lp, lq = _exact_chunk(z, zr, reverse)
    if reverse:
        # ∂/∂z_i Σ_j p_j (lp_j − lq_j) = p_i · (lp_i − lq_i − KL)
        p = lp.exp()
        gz = lp.sub_(lq).sub_(kl[:, None]).mul_(p)
        del p
    else:
        # ∂/∂z_i Σ_j q_j (lq_j − lp_j) = p_i − q_i
        gz = lp.exp_().sub_(lq.exp_())
    return gz.mul_(g[:, None])


class _ExactKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ref_logits, reverse, temperature, chunk):  # type: ignore[override]
        out = []
        for s in range(0, logits.shape[0], chunk):
            z = logits[s : s + chunk].to(compute_dtype(logits)) / temperature
            zr = ref_logits[s : s + chunk].to(compute_dtype(logits)) / temperature
            out.append(_exact_chunk(z, zr, reverse)[0])
            del z, zr
        kl = torch.cat(out) if out else logits.new_empty(0, dtype=compute_dtype(logits))
        ctx.save_for_backward(logits, ref_logits, kl)
        ctx.reverse, ctx.temperature, ctx.chunk = reverse, temperature, chunk
        return kl

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        logits, ref_logits, kl = ctx.saved_tensors
        grad = torch.empty_like(logits)
        tau, chunk = ctx.temperature, ctx.chunk
        for s in range(0, logits.shape[0], chunk):
            e = s + chunk
            z = logits[s:e].to(compute_dtype(logits)) / tau
            zr = ref_logits[s:e].to(compute_dtype(logits)) / tau
            grad[s:e] = _exact_chunk_grad(z, zr, kl[s:e], g[s:e] / tau, ctx.reverse)
            del z, zr
        return grad, None, None, None, None


class _ExactKLFromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, ref_hidden, ref_weight, ref_bias, reverse, temperature, chunk):  # type: ignore[override]
        out = []
        for s in range(0, hidden.shape[0], chunk):
            z = project_logits(hidden[s : s + chunk], weight, bias, temperature)
            zr = project_logits(ref_hidden[s : s + chunk], ref_weight, ref_bias, temperature).to(z.dtype)
            out.append(_exact_chunk(z, zr, reverse)[0])
            del z, zr
        kl = torch.cat(out) if out else hidden.new_empty(0, dtype=compute_dtype(hidden))
        ctx.save_for_backward(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, kl)
        ctx.reverse, ctx.temperature, ctx.chunk = reverse, temperature, chunk
        return kl

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        hidden, weight, bias, ref_hidden, ref_weight, ref_bias, kl = ctx.saved_tensors
        tau = ctx.temperature

        def grad_logits(s: int, e: int, z: Tensor) -> Tensor:
            zr = project_logits(ref_hidden[s:e], ref_weight, ref_bias, tau).to(z.dtype)
            return _exact_chunk_grad(z, zr, kl[s:e], g[s:e].to(z.dtype) / tau, ctx.reverse)

        grads = lm_head_backward(ctx.needs_input_grad[:3], hidden, weight, bias, tau, ctx.chunk, grad_logits)
        return (*grads, None, None, None, None, None, None)


def exact_kl(
    logits: Tensor,
    ref_logits: Tensor,
    *,
    direction: Direction = "reverse",
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Exact per-token KL over the whole vocabulary, ``(..., V), (..., V) -> (...)``.

    ``"reverse"``: Σ_j πθ(j)(log πθ(j) − log πref(j)); ``"forward"``: Σ_j πref(j)(log πref(j) − log πθ(j)).
    Differentiable with respect to ``logits`` only (the anchor is a constant).  Chunked over
    tokens in forward and backward; equal to the unchunked computation (tested).
    """
    if logits.shape != ref_logits.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and ref_logits {tuple(ref_logits.shape)} differ")
    if direction not in ("reverse", "forward"):
        raise ValueError(f"direction must be 'reverse' or 'forward', got {direction!r}")
    if chunk_size < 1 or not temperature > 0:
        raise ValueError("chunk_size must be >= 1 and temperature > 0")
    V = logits.shape[-1]
    kl = _ExactKL.apply(
        logits.reshape(-1, V), ref_logits.detach().reshape(-1, V), direction == "reverse", float(temperature), chunk_size
    )
    return kl.reshape(logits.shape[:-1])


@dataclass(frozen=True)
class ExactKLAnchor:
    """The anchor's side of :func:`exact_kl_from_hidden` for a batch of responses.

    ``hidden`` ``(B, T, H)``: the anchor's final hidden states at the response positions (what the
    stored-statistics pass keeps per token, H floats instead of V logits); ``weight`` ``(V, H)`` /
    ``bias``: the anchor's lm_head; ``direction``: the KL's.  A policy pass given one
    (:class:`trainer.policy.PolicyForward`) returns the per-token exact KL in
    ``TokenStats.exact_kl``, computed inside the pass where the policy's lm_head weight is
    available (under FSDP2 it is unsharded only there).
    """

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None
    direction: Direction


def exact_kl_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    ref_hidden: Tensor,
    ref_weight: Tensor,
    *,
    bias: Tensor | None = None,
    ref_bias: Tensor | None = None,
    direction: Direction = "reverse",
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Exact full-vocabulary KL ``(B, T)`` from final hidden states, never materialising (T, V).

    Both models' logits are recomputed per chunk of tokens from ``hidden`` ``(B, T, H)`` /
    ``weight`` ``(V, H)`` (the policy; differentiable, including ``bias``) and ``ref_hidden`` /
    ``ref_weight`` (the anchor; constants).  So the exact KL needs, per token, the anchor's
    final hidden state (H floats) instead of its V logits, plus one copy of the anchor's
    lm_head weight — which the EMA anchor holds anyway.  This is not in the paper; it is the
    exact counterpart of the fused Top-k pass (same O(chunk × V) temporaries, twice the
    lm_head matmuls).  Equal to :func:`exact_kl` on the materialised logits (tested).
    """
    if hidden.shape != ref_hidden.shape or hidden.dim() < 2:
        raise ValueError(f"hidden {tuple(hidden.shape)} and ref_hidden {tuple(ref_hidden.shape)} must be equal (..., H)")
    if weight.shape != ref_weight.shape or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} and ref_weight {tuple(ref_weight.shape)} must be equal (V, H)")
    if direction not in ("reverse", "forward"):
        raise ValueError(f"direction must be 'reverse' or 'forward', got {direction!r}")
    if chunk_size < 1 or not temperature > 0:
        raise ValueError("chunk_size must be >= 1 and temperature > 0")
    H = hidden.shape[-1]
    kl = _ExactKLFromHidden.apply(
        hidden.reshape(-1, H), weight, bias,
        ref_hidden.detach().reshape(-1, H), ref_weight.detach(), None if ref_bias is None else ref_bias.detach(),
        direction == "reverse", float(temperature), chunk_size,
    )
    return kl.reshape(hidden.shape[:-1])
