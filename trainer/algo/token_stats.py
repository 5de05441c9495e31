"""Memory-efficient per-token statistics of a policy: log-prob, logsumexp, top-k, entropy.

One pass over the response tokens, in chunks of ``chunk_size`` tokens, yields everything the
losses need (:class:`TokenStats`):

* ``logp``        (B, T)    log π(y_t) of the given label (the sampled token);
* ``logsumexp``   (B, T)    Z_t = logsumexp_j z_tj over the whole vocabulary;
* ``topk_logits`` (B, T, k) logits at the top-k indices of this model's own distribution
  (``topk=k``) or at caller-given indices (``gather_indices``; e.g. the old policy's top-k);
* ``topk_indices``(B, T, k) int64;
* ``entropy``     (B, T)    H_t = Z_t − Σ_j π_tj z_tj.

Two entry points, both exact and differentiable through custom ``autograd.Function``s that
recompute each chunk's logits in backward from saved per-token scalars, so no (T, V) tensor
is created beyond the inputs, neither in forward nor in backward:

* :func:`token_stats_from_hidden` fuses the lm_head matmul: per chunk z = h W^T (+ b), the
  stats, and in backward ∂/∂h and ∂/∂W.  **No (T, V) tensor at all**; peak extra memory is a
  few chunk_size × V float32 buffers.  On a CPU the (V, H) weight is streamed once per chunk,
  so larger chunks are faster (a memory/time trade-off; see ``benchmarks/kl_memory.py``).
* :func:`token_stats_from_logits` starts from materialised logits (e.g. an HF model output).
  Autograd then needs a (T, V) gradient for the logits anyway, but nothing else of that size
  (unlike ``log_softmax``, which saves a (T, V) output).

All logits are divided by ``temperature`` first (the rollout temperature, paper §2.3).
Running a model to get the hidden states is :mod:`trainer.model_forward`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.algo import DEFAULT_CHUNK_SIZE

__all__ = [
    "TokenStats",
    "token_stats_from_logits",
    "token_stats_from_hidden",
    "compute_dtype",
    "project_logits",
    "lm_head_backward",
]



@dataclass
class TokenStats:
    """Per-token statistics of one model on a batch of responses (see module docstring).

    ``topk_logits``/``topk_indices`` are ``None`` unless requested, ``entropy`` likewise.
    ``exact_kl`` ``(B, T)`` is the exact full-vocabulary KL between this model and the anchor
    whose final hidden states the pass was given (:class:`trainer.algo.topk_kl.ExactKLAnchor`), else
    ``None``.  Values are float32 for fp32/bf16/fp16 models (float64 for float64 inputs);
    gradients flow into the model through every field but the indices.
    """

    logp: Tensor
    logsumexp: Tensor
    topk_logits: Tensor | None = None
    topk_indices: Tensor | None = None
    entropy: Tensor | None = None
    exact_kl: Tensor | None = None

    def detach(self) -> "TokenStats":
        """A copy without autograd history (for old-policy / anchor statistics)."""

        def d(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach()

        return TokenStats(
            d(self.logp), d(self.logsumexp), d(self.topk_logits), d(self.topk_indices), d(self.entropy), d(self.exact_kl)
        )

    def compact(self, logits_dtype: torch.dtype = torch.float32, index_dtype: torch.dtype = torch.int64) -> "TokenStats":
        """Detached copy for storage between passes: top-k logits in ``logits_dtype`` (e.g. the
        model's bf16) and indices in ``index_dtype`` (int32 suffices for any real vocabulary).
        ``logp``/``logsumexp`` stay float32: rounding Z would shift every head log-prob.
        Stored int32 indices can be passed back as ``gather_indices`` directly."""
        if index_dtype not in (torch.int32, torch.int64):
            raise ValueError(f"index_dtype must be int32 or int64, got {index_dtype}")
        st = self.detach()
        if st.topk_logits is not None:
            st.topk_logits = st.topk_logits.to(logits_dtype)
            st.topk_indices = st.topk_indices.to(index_dtype)
        return st

    def storage_bytes(self) -> int:
        """Bytes held by the tensors (what storing these stats per token costs)."""
        return sum(
            t.numel() * t.element_size()
            for t in (self.logp, self.logsumexp, self.topk_logits, self.topk_indices, self.entropy, self.exact_kl)
            if t is not None
        )


# ---------------------------------------------------------------------------------------------
# Chunk kernels shared by the two autograd functions.  z is a (C, V) float32 chunk of logits
# already divided by the temperature.


def _chunk_forward(
    z: Tensor, labels: Tensor, gather_idx: Tensor | None, topk: int, want_entropy: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, labels[:, None]).squeeze(-1) - lse
    if topk > 0:
        vals, idx = torch.topk(z, topk, dim=-1)
    elif gather_idx is not None:
        idx = gather_idx
        vals = z.gather(-1, idx)
    else:
        idx = torch.empty(z.shape[0], 0, dtype=torch.long, device=z.device)
        vals = z.new_empty(z.shape[0], 0)
    if want_entropy:
        p = torch.softmax(z, dim=-1)
        ent = lse - p.mul_(z).sum(-1)
        del p
    else:
        ent = z.new_zeros(z.shape[0])
    return logp, lse, vals, idx, ent


def _chunk_grad_z(
    z: Tensor,
    lse: Tensor,
    ent: Tensor,
    labels: Tensor,
    idx: Tensor,
    g_logp: Tensor | None,
    g_lse: Tensor | None,
    g_vals: Tensor | None,
    g_ent: Tensor | None,
) -> Tensor:
    """∂L/∂z for one chunk, built in place in the buffer that held exp(z − Z) (one C×V tensor).

    logp = z_y − Z    → g_logp·(1[j=y] − π_j)
    Z                 → g_lse·π_j
    z at idx          → scatter-add of g_vals
    H = Z − Σ π z     → −g_ent·π_j·(z_j − E_π[z]),  E_π[z] = Z − H
    """
    coef = torch.zeros_like(lse)
    if g_lse is not None:
        coef = coef + g_lse
    if g_logp is not None:
        coef = coef - g_logp
    grad = (z - lse[:, None]).exp_()  # π, (C, V)
    if g_ent is not None:
        centred = z - (lse - ent)[:, None]
        centred.mul_(g_ent[:, None]).neg_().add_(coef[:, None])
        grad.mul_(centred)
        del centred
    else:
        grad.mul_(coef[:, None])
    if g_logp is not None:
        grad.scatter_add_(-1, labels[:, None], g_logp[:, None])
    if g_vals is not None and idx.shape[-1] > 0:
        grad.scatter_add_(-1, idx, g_vals)
    return grad


def _flatten_inputs(labels: Tensor, gather_indices: Tensor | None, topk: int, vocab: int) -> tuple[Tensor, Tensor | None]:
    if topk < 0:
        raise ValueError(f"topk must be >= 0, got {topk}")
    if topk > 0 and gather_indices is not None:
        raise ValueError("pass either topk (select this model's top-k) or gather_indices, not both")
    if topk > vocab:
        raise ValueError(f"topk={topk} exceeds the vocabulary size {vocab}")
    flat_labels = labels.reshape(-1).long()
    if flat_labels.numel() and (int(flat_labels.min()) < 0 or int(flat_labels.max()) >= vocab):
        raise ValueError(f"labels must lie in [0, {vocab}); got range [{int(flat_labels.min())}, {int(flat_labels.max())}]")
    flat_idx = None
    if gather_indices is not None:
        if gather_indices.shape[:-1] != labels.shape:
            raise ValueError(f"gather_indices shape {tuple(gather_indices.shape)} does not match labels {tuple(labels.shape)} + (k,)")
        flat_idx = gather_indices.reshape(-1, gather_indices.shape[-1]).long()
    return flat_labels, flat_idx


def _run_chunks(
    make_z, n: int, labels: Tensor, gather_idx: Tensor | None, topk: int, want_entropy: bool, chunk: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward over token chunks; ``make_z(s, e)`` returns the float32 logits of rows [s, e)."""
    outs: list[list[Tensor]] = [[], [], [], [], []]
    for s in range(0, n, chunk):
        z = make_z(s, s + chunk)
        gi = None if gather_idx is None else gather_idx[s : s + chunk]
        for acc, t in zip(outs, _chunk_forward(z, labels[s : s + chunk], gi, topk, want_entropy)):
            acc.append(t)
        del z
    if n == 0:
        k = topk or (0 if gather_idx is None else gather_idx.shape[-1])
        empty = torch.empty(0, dtype=dtype, device=labels.device)
        return empty, empty.clone(), empty.new_empty(0, k), torch.empty(0, k, dtype=torch.long, device=labels.device), empty.clone()
    return tuple(torch.cat(o) for o in outs)  # type: ignore[return-value]


class _StatsFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, gather_idx, topk, want_entropy, temperature, chunk):  # type: ignore[override]
        logp, lse, vals, idx, ent = _run_chunks(
            lambda s, e: logits[s:e].to(compute_dtype(logits)) / temperature,
            logits.shape[0], labels, gather_idx, topk, want_entropy, chunk, compute_dtype(logits),
        )
        ctx.save_for_backward(logits, labels, idx, lse, ent)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(idx)
        return logp, lse, vals, idx, ent

    @staticmethod
    def backward(ctx, g_logp, g_lse, g_vals, _g_idx, g_ent):  # type: ignore[override]
        logits, labels, idx, lse, ent = ctx.saved_tensors
        grad = torch.empty_like(logits)
        tau, chunk = ctx.temperature, ctx.chunk
        for s in range(0, logits.shape[0], chunk):
            e = s + chunk
            z = logits[s:e].to(compute_dtype(logits)) / tau
            gz = _chunk_grad_z(
                z, lse[s:e], ent[s:e], labels[s:e], idx[s:e],
                None if g_logp is None else g_logp[s:e],
                None if g_lse is None else g_lse[s:e],
                None if g_vals is None else g_vals[s:e],
                None if g_ent is None else g_ent[s:e],
            )
            del z
            grad[s:e] = gz.div_(tau)
        return grad, None, None, None, None, None, None


class _StatsFromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, gather_idx, topk, want_entropy, temperature, chunk):  # type: ignore[override]
        logp, lse, vals, idx, ent = _run_chunks(
            lambda s, e: project_logits(hidden[s:e], weight, bias, temperature),
            hidden.shape[0], labels, gather_idx, topk, want_entropy, chunk, compute_dtype(hidden),
        )
        ctx.save_for_backward(hidden, weight, bias, labels, idx, lse, ent)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(idx)
        return logp, lse, vals, idx, ent

    @staticmethod
    def backward(ctx, g_logp, g_lse, g_vals, _g_idx, g_ent):  # type: ignore[override]
        hidden, weight, bias, labels, idx, lse, ent = ctx.saved_tensors
        tau = ctx.temperature

        def grad_logits(s: int, e: int, z: Tensor) -> Tensor:
            gz = _chunk_grad_z(
                z, lse[s:e], ent[s:e], labels[s:e], idx[s:e],
                None if g_logp is None else g_logp[s:e],
                None if g_lse is None else g_lse[s:e],
                None if g_vals is None else g_vals[s:e],
                None if g_ent is None else g_ent[s:e],
            )
            return gz.div_(tau)

        grads = lm_head_backward(ctx.needs_input_grad[:3], hidden, weight, bias, tau, ctx.chunk, grad_logits)
        return (*grads, None, None, None, None, None, None)


def compute_dtype(t: Tensor) -> torch.dtype:
    """float32 for half/bf16/fp32 inputs, float64 for float64 inputs (exact tests)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def lm_head_backward(
    needs: tuple[bool, ...],
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    temperature: float,
    chunk: int,
    grad_logits,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The chunked backward of every loss computed from the logits z = h W^T + b of one lm_head.

    ``hidden`` ``(N, H)``, ``weight`` ``(V, H)``, ``bias`` ``(V,)`` or ``None``; ``needs`` =
    ``ctx.needs_input_grad`` for (hidden, weight, bias).  Per chunk of ``chunk`` rows the logits
    are recomputed (:func:`project_logits`, divided by ``temperature``) and
    ``grad_logits(start, end, z)`` returns ∂L/∂(h W^T + b) for those rows ``(C, V)`` (it may
    reuse ``z``'s memory); the chunk's contributions to ∂L/∂h, ∂L/∂W, ∂L/∂b are accumulated
    here, so no (N, V) tensor ever exists.  Weight/bias gradients accumulate in float32 so bf16
    models do not lose small chunks.  Used by the fused token statistics and by the exact KL
    from hidden states.
    """
    need_h, need_w, need_b = needs
    acc = compute_dtype(weight)
    grad_h = torch.empty_like(hidden) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
    grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if (need_b and bias is not None) else None
    for s in range(0, hidden.shape[0], chunk):
        e = s + chunk
        h = hidden[s:e]
        gz = grad_logits(s, e, project_logits(h, weight, bias, temperature))
        if grad_b is not None:
            grad_b += gz.sum(0)
        if grad_w is not None:
            grad_w.addmm_(gz.t().to(acc), h.to(acc))
        if grad_h is not None:
            grad_h[s:e] = gz.to(weight.dtype) @ weight
        del gz
    return (
        grad_h,
        None if grad_w is None else grad_w.to(weight.dtype),
        None if grad_b is None else grad_b.to(bias.dtype),
    )


def project_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """Logits of one chunk in float32: (h W^T + b) / temperature (matmul in the model dtype)."""
    z = h @ weight.t()
    if bias is not None:
        z = z + bias
    return z.to(compute_dtype(z)).div_(temperature)


def _unflatten(out: tuple[Tensor, ...], shape: torch.Size, topk: int, gather: bool, entropy: bool) -> TokenStats:
    logp, lse, vals, idx, ent = out
    want_k = topk > 0 or gather
    return TokenStats(
        logp=logp.reshape(shape),
        logsumexp=lse.reshape(shape),
        topk_logits=vals.reshape(*shape, vals.shape[-1]) if want_k else None,
        topk_indices=idx.reshape(*shape, idx.shape[-1]) if want_k else None,
        entropy=ent.reshape(shape) if entropy else None,
    )


def token_stats_from_logits(
    logits: Tensor,
    labels: Tensor,
    *,
    topk: int = 0,
    gather_indices: Tensor | None = None,
    entropy: bool = False,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> TokenStats:
    """Stats from materialised logits.

    Args:
        logits: ``(B, T, V)`` (any float dtype; the math is done in float32 per chunk).
        labels: ``(B, T)`` token ids whose log-prob is wanted (the sampled response tokens).
        topk: if > 0, also return this model's own top-k logits and indices ``(B, T, k)``.
        gather_indices: ``(B, T, k)`` indices to gather logits at instead (mutually exclusive).
        entropy: also return the entropy ``(B, T)``.
        temperature: logits are divided by it first.
        chunk_size: tokens per chunk (bounds the temporaries to chunk_size × V).
    """
    if logits.dim() < 2:
        raise ValueError(f"logits must be (..., V); got shape {tuple(logits.shape)}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    _check_common(temperature, chunk_size)
    vocab = logits.shape[-1]
    flat_labels, flat_idx = _flatten_inputs(labels, gather_indices, topk, vocab)
    out = _StatsFromLogits.apply(logits.reshape(-1, vocab), flat_labels, flat_idx, topk, entropy, float(temperature), chunk_size)
    return _unflatten(out, labels.shape, topk, gather_indices is not None, entropy)


def token_stats_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    topk: int = 0,
    gather_indices: Tensor | None = None,
    entropy: bool = False,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> TokenStats:
    """Stats from final hidden states, fusing the lm_head matmul into the chunked pass.

    Args:
        hidden: ``(B, T, H)`` hidden states that predict ``labels`` (already shifted).
        weight: ``(V, H)`` lm_head weight (tied embeddings work: gradients go to the same tensor).
        labels: ``(B, T)``.
        bias: optional ``(V,)`` lm_head bias.
        Other arguments as in :func:`token_stats_from_logits`.

    Gradients to ``hidden``, ``weight`` and ``bias`` equal those of the naive computation
    (float64 test to 1e-10); the weight gradient is accumulated in float32.
    """
    if hidden.dim() < 2 or hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be labels {tuple(labels.shape)} + (H,)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (V, H={hidden.shape[-1]}); got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be (V,); got {tuple(bias.shape)}")
    _check_common(temperature, chunk_size)
    flat_labels, flat_idx = _flatten_inputs(labels, gather_indices, topk, weight.shape[0])
    out = _StatsFromHidden.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, flat_labels, flat_idx, topk, entropy, float(temperature), chunk_size
    )
    return _unflatten(out, labels.shape, topk, gather_indices is not None, entropy)


def _check_common(temperature: float, chunk_size: int) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
