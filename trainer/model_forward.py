"""The policy's model forward: a Hugging Face causal LM run on prompt+response, its final hidden states
and lm_head handed to the fused token statistics (:mod:`trainer.algo.token_stats`).

:func:`causal_lm_hidden` runs the decoder body (left-padded prompts, right-padded responses; GRPO groups can
share their prompt's KV cache, ``share_prompt``); :func:`causal_lm_token_stats` applies the chunked lm_head
statistics to its output. Used by :class:`trainer.policy.Policy` and the SFT program.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from trainer.algo import DEFAULT_CHUNK_SIZE
from trainer.algo.token_stats import TokenStats, token_stats_from_hidden

__all__ = ["causal_lm_token_stats", "causal_lm_hidden", "activation_checkpointing_active"]


def causal_lm_token_stats(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    num_response_tokens: int,
    *,
    topk: int = 0,
    gather_indices: Tensor | None = None,
    entropy: bool = False,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    share_prompt: bool = False,
) -> TokenStats:
    """Run a Hugging Face causal LM and return stats for the last ``num_response_tokens`` columns.

    The decoder body runs as in :func:`causal_lm_hidden`; the lm_head is applied by
    :func:`token_stats_from_hidden` in chunks, so the (B, T, V) logits are never materialised.
    Returned tensors are ``(B, T)`` / ``(B, T, k)``; padded response positions get values too —
    mask them in the loss.
    """
    hidden, head = causal_lm_hidden(model, input_ids, attention_mask, num_response_tokens, share_prompt=share_prompt)
    return token_stats_from_hidden(
        hidden,
        head.weight,
        input_ids[:, -hidden.shape[1] :],
        bias=head.bias,
        topk=topk,
        gather_indices=gather_indices,
        entropy=entropy,
        temperature=temperature,
        chunk_size=chunk_size,
    )


def causal_lm_hidden(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, num_response_tokens: int, *, share_prompt: bool = False
) -> tuple[Tensor, nn.Linear]:
    """The final hidden states ``(B, T, H)`` that predict the last ``T`` columns, and the lm_head.

    Layout (verl's): ``input_ids`` ``(B, L)`` = left-padded prompt + right-padded response,
    the response occupying the last ``T = num_response_tokens`` columns.  Position ids are
    ``cumsum(attention_mask) − 1`` so left padding does not shift positions.  The hidden state
    at column ``L−T−1+t`` predicts response token ``t``.

    ``share_prompt=True``: rows whose prompt columns are identical -- the members of a GRPO
    group -- run the prompt once and continue from its KV cache (see :func:`_shared_prompt_hidden`),
    in no-grad passes and in the differentiable training pass alike (gradients flow back through
    the shared prompt activations). Same values and gradients up to float rounding, (n−1)/n fewer
    prompt FLOPs for groups of n. While autograd records through layers with activation
    checkpointing (``model.gradient_checkpointing`` in training mode) the one-pass forward runs
    instead: checkpointed layers drop the KV cache (its writes would be replayed in backward).

    Models with logit post-processing other than a linear lm_head (e.g. Gemma's final logit
    soft-capping) are rejected rather than silently computed wrong.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must be equal (B, L)")
    T = int(num_response_tokens)
    if not 0 < T < input_ids.shape[1]:
        raise ValueError(f"num_response_tokens must be in [1, L-1]; got {T} for L={input_ids.shape[1]}")
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None):
        raise NotImplementedError("final_logit_softcapping is not supported by the fused lm_head path")
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise NotImplementedError(f"expected an nn.Linear lm_head, got {type(head).__name__}")
    body = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, model.base_model_prefix)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = None
    if share_prompt and not (torch.is_grad_enabled() and activation_checkpointing_active(body)):
        hidden = _shared_prompt_hidden(body, input_ids, attention_mask, position_ids, T)
    if hidden is None:
        out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        hidden = (out[0] if isinstance(out, tuple) else out.last_hidden_state)[:, -T - 1 : -1]
    return hidden, head


def _shared_prompt_hidden(
    body: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, num_response_tokens: int
) -> Tensor | None:
    """Hidden states ``(B, T, H)`` that predict the last ``T`` columns, each distinct prompt run once.

    The prompt block (the first ``L − T`` columns, left-padded) is deduplicated; the unique
    prompts run with ``use_cache=True``, their KV cache is gathered back to one entry per row
    (``Cache.reorder_cache``, an ``index_select``), and the response block runs on top of it with
    the full 2-D attention mask, so padding and positions are exactly those of the one-pass
    forward. The first response token is predicted by the prompt's last hidden state. Returns
    ``None`` when no two rows share a prompt (nothing to save) or the model does not return a cache.

    Differentiable: every op on the way (the gather of the cache and of the last prompt state,
    the concatenation the cache does per layer) is out of place, so the response block's gradient
    reaches the prompt activations and is summed over the group members -- the one-pass
    gradient up to float rounding (``tests/trainer/test_shared_prompt_grad.py``, float64).

    Under FSDP2 every body call is a round of all-gathers per layer, so all ranks must make the
    same number of calls: the ranks agree (one all-reduce) to share only if each of them has a
    repeated prompt and ``T > 1``; otherwise all run the one-pass forward.

    Memory: the micro-batch's KV cache is held for the whole pass (layers × rows × columns ×
    2 × kv-heads × head-dim; for Qwen2.5-3B in bf16 about 36 KiB per token, so 8 rows × 6k
    columns ≈ 1.8 GiB), which a no-grad one-pass forward frees layer by layer. In the training
    pass the cache is held with the graph until backward -- attention saves those keys and values
    for its backward anyway, while the prompt's other activations are kept once per distinct
    prompt instead of once per row, so a group's pass holds less than the one-pass forward.
    """
    T = num_response_tokens
    P = input_ids.shape[1] - T
    prompt = input_ids[:, :P].masked_fill(attention_mask[:, :P] == 0, -1)  # padding is not prompt content
    unique, inverse = torch.unique(prompt, dim=0, return_inverse=True)
    share = unique.shape[0] < input_ids.shape[0]
    if _is_sharded(body):
        from trainer.distributed import all_reduce_max

        share = share and T > 1
        # On the inputs' device: an NCCL group reduces CUDA tensors only.
        share = not bool(all_reduce_max(torch.tensor([0.0 if share else 1.0], device=input_ids.device)).item())
    if not share:
        return None
    first = torch.zeros(unique.shape[0], dtype=torch.long, device=input_ids.device)
    first.scatter_reduce_(0, inverse, torch.arange(input_ids.shape[0], device=input_ids.device), "amin", include_self=False)
    with _no_activation_checkpointing(body):
        out = body(input_ids=input_ids[first, :P], attention_mask=attention_mask[first, :P],
                   position_ids=position_ids[first, :P], use_cache=True)
        cache = out.past_key_values
        if cache is None or cache.get_seq_length() != P:
            return None
        last_prompt = out.last_hidden_state[:, -1:]
        if T > 1 and torch.is_grad_enabled() and last_prompt.requires_grad:
            # cut before the gather: the gradients the cut holds until the prompt pass's backward are one per distinct
            # prompt, as the prompt pass's own nodes would hold them; the gather's backward sums the rows' at once
            last_prompt = _cut_at_the_prompt(body, cache, last_prompt)
        cache.reorder_cache(inverse)
        last_prompt = last_prompt[inverse]
        if T == 1:
            return last_prompt
        # The last column predicts nothing, so the response block stops one short of it.
        rest = body(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1], position_ids=position_ids[:, P:-1],
                    past_key_values=cache, use_cache=True).last_hidden_state
    return torch.cat([last_prompt, rest], dim=1)


class _PromptCut(torch.autograd.Function):
    """The graph cut between a shared prompt's pass and the response block that reads it.

    ``forward(anchor, prompt_outputs)`` returns aliases of the prompt pass's outputs (the last prompt hidden state,
    every layer's keys and values) that the autograd graph does not link to the prompt pass: its only tracked input is
    ``anchor``, an empty leaf. ``backward`` receives their gradients once the response block's backward is done and
    runs the prompt pass's backward from them (a nested ``torch.autograd.backward``, as reentrant checkpointing does).

    Why: every decoder weight is used by both passes, so in one backward the engine would hold each weight's
    response-block gradient until the prompt pass's backward (last, by sequence number) added its own -- every layer's
    gradient beside ``.grad`` at once under gradient accumulation (SmolLM2-135M, micro-batches of 2: +405 MiB at the
    second micro-batch's peak, measured). Cut, each weight has one use per graph and its gradient is added into
    ``.grad`` as soon as it is built. The sum is the same up to float rounding (response part, then prompt part)."""

    @staticmethod
    def forward(ctx, anchor: Tensor, prompt_outputs: list[Tensor], trainable: Tensor | None) -> tuple[Tensor, ...]:
        ctx.prompt_outputs, ctx.trainable = prompt_outputs, trainable  # a list: not tracked as inputs
        return tuple(t.detach() for t in prompt_outputs)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[None, None, None]:
        outputs, ctx.prompt_outputs = ctx.prompt_outputs, None
        if ctx.trainable is not None:
            from torch.autograd.graph import get_gradient_edge

            try:
                into_grad = torch._C._will_engine_execute_node(get_gradient_edge(ctx.trainable).node)
            except RuntimeError:  # torch refuses the question for a leaf's accumulator under autograd.grad
                into_grad = False
            if not into_grad:
                raise RuntimeError("a shared-prompt training pass reaches the weights through .backward() only (its "
                                   "prompt part is a nested backward into .grad): run torch.autograd.grad, or "
                                   "backward(inputs=...) without the weights, with share_prompt=False")
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return None, None, None


def _cut_at_the_prompt(body: nn.Module, cache, last_prompt: Tensor) -> Tensor:
    """Cut the graph between the prompt pass and the response block (:class:`_PromptCut`): ``cache``'s layers get the
    cut keys and values in place; returns the cut ``last_prompt``. A cache without per-layer ``keys``/``values`` is
    left as it is (one backward through both passes, as before)."""
    layers = list(getattr(cache, "layers", []))
    if not layers or not all(isinstance(getattr(layer, "keys", None), Tensor) and
                             isinstance(getattr(layer, "values", None), Tensor) for layer in layers):
        return last_prompt
    outputs = [last_prompt] + [t for layer in layers for t in (layer.keys, layer.values)]
    # the autograd.grad guard reads one weight's accumulator; FSDP2 trains unsharded copies of its weights, not these
    trainable = None if _is_sharded(body) else next((p for p in body.parameters() if p.requires_grad), None)
    cut = _PromptCut.apply(torch.empty(0, device=last_prompt.device, requires_grad=True), outputs, trainable)
    for i, layer in enumerate(layers):
        layer.keys, layer.values = cut[1 + 2 * i], cut[2 + 2 * i]
    return cut[0]


def _is_sharded(body: nn.Module) -> bool:
    """Whether ``body`` has FSDP2 units (whose forwards are collectives)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in body.modules())


def activation_checkpointing_active(model: nn.Module) -> bool:
    """Whether a layer of ``model`` would checkpoint its activations now (and so drop the KV cache)."""
    return any(getattr(m, "gradient_checkpointing", False) is True and m.training for m in model.modules())


@contextlib.contextmanager
def _no_activation_checkpointing(model: nn.Module):
    """Switch transformers' per-layer activation checkpointing off for a shared-prompt pass.

    Checkpointed layers in training mode drop ``use_cache``/``past_key_values`` (they would
    be written twice on the backward replay), which would silently cut the response block
    off its prompt. Without autograd there is nothing to recompute, so turning it off costs
    nothing; while autograd records, :func:`causal_lm_hidden` does not share the prompt
    through checkpointed layers at all, so the flags seen here are those of eval-mode layers
    (which do not checkpoint).
    """
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in layers:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in layers:
            m.gradient_checkpointing = True
