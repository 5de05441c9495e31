"""The sampling transform shared by the transformers engine and the tests.

Mirrors vLLM's sampler (v1/sample/sampler.py + ops/topk_topp_sampler.py) so both
engines report the same ``logprobs`` (see agent/engines/base.py):
allowed-token mask -> temperature (skipped when greedy) -> top-k -> top-p -> log_softmax.
"""

from __future__ import annotations

import torch

from agent.engines.base import SamplingParams


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[B, V] raw logits -> [B, V] logits of the distribution actually sampled from (-inf = excluded)."""
    logits = logits.float().clone()
    if params.allowed_token_ids is not None:
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[list(params.allowed_token_ids)] = True
        logits.masked_fill_(~keep, float("-inf"))
    if params.greedy:
        return logits
    logits.div_(params.temperature)
    if params.top_k == -1 and params.top_p >= 1.0:
        return logits
    # Same rule as vLLM: sort ascending, mask below the k-th largest value (ties kept),
    # then mask the low tail whose cumulative probability is <= 1 - top_p, keep >= 1 token.
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    if params.top_k != -1 and params.top_k < logits.shape[-1]:
        kth = sorted_logits[:, logits.shape[-1] - params.top_k].unsqueeze(1)
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if params.top_p < 1.0:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - params.top_p
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter(-1, idx, sorted_logits)


def sample(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (token ids [B], their processed log-probs [B])."""
    proc = processed_logits(logits, params)
    logp = proc.log_softmax(dim=-1)
    if params.greedy:
        tokens = proc.argmax(dim=-1)
    else:
        probs = logp.exp()
        # One generator per row: a sequence's sample does not depend on its batch mates.
        tokens = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generators)])
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
