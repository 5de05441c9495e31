"""Rollout results as padded tensors, and micro-batch slices of them.

Layout (verl's): every row is a left-padded prompt followed by a right-padded
response, ``input_ids (N, P + T)``; the response occupies the last ``T`` columns.
``loss_mask (N, T)`` is 1 on tokens the model generated and 0 on tool observations
and padding. Per-token statistics stored before the PPO updates (old log-probs,
top-k indices, anchor statistics) are ``(N, T)`` / ``(N, T, k)`` tensors aligned with
the response columns. A micro-batch trims the columns that are padding in all its
rows, so short micro-batches cost what they contain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class TokenBatch:
    input_ids: Tensor  # (N, P + T) int64
    attention_mask: Tensor  # (N, P + T) int64
    loss_mask: Tensor  # (N, T) float32
    prompt_lens: Tensor  # (N,) int64
    response_lens: Tensor  # (N,) int64
    prompt_width: int  # P
    stored: dict[str, Tensor] = field(default_factory=dict)  # (N, T[, k]) per-token stats

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_width(self) -> int:
        return self.input_ids.shape[1] - self.prompt_width

    @property
    def labels(self) -> Tensor:
        return self.input_ids[:, self.prompt_width :]

    def micro(self, rows: Tensor | slice, device: torch.device | None = None) -> "MicroBatch":
        """Rows of the batch, trimmed to the widest prompt and response among them."""
        prompt_lens = self.prompt_lens[rows]
        response_lens = self.response_lens[rows]
        p = int(prompt_lens.max())
        t = max(1, int(response_lens.max()))
        cols = slice(self.prompt_width - p, self.prompt_width + t)
        dev = device or self.input_ids.device
        return MicroBatch(
            input_ids=self.input_ids[rows][:, cols].to(dev),
            attention_mask=self.attention_mask[rows][:, cols].to(dev),
            loss_mask=self.loss_mask[rows][:, :t].to(dev),
            response_width=t,
            stored={k: v[rows][:, :t].to(dev) for k, v in self.stored.items()},
        )


@dataclass
class MicroBatch:
    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    response_width: int
    stored: dict[str, Tensor]

    @property
    def labels(self) -> Tensor:
        return self.input_ids[:, -self.response_width :]


def build_token_batch(
    prompts: list[list[int]], responses: list[list[int]], masks: list[list[int]], *, pad_id: int
) -> TokenBatch:
    """Pad prompts on the left and responses (with their loss masks) on the right."""
    if not (len(prompts) == len(responses) == len(masks)):
        raise ValueError("prompts, responses and masks must have the same length")
    for i, (r, m) in enumerate(zip(responses, masks)):
        if len(r) != len(m):
            raise ValueError(f"trajectory {i}: {len(r)} response tokens but {len(m)} loss-mask entries")
        if not prompts[i]:
            raise ValueError(f"trajectory {i} has an empty prompt")
    n = len(prompts)
    p = max(len(x) for x in prompts)
    t = max(1, max(len(x) for x in responses))
    ids = torch.full((n, p + t), pad_id, dtype=torch.long)
    att = torch.zeros((n, p + t), dtype=torch.long)
    loss = torch.zeros((n, t), dtype=torch.float32)
    for i, (pr, rs, mk) in enumerate(zip(prompts, responses, masks)):
        ids[i, p - len(pr) : p] = torch.tensor(pr, dtype=torch.long)
        att[i, p - len(pr) : p] = 1
        if rs:
            ids[i, p : p + len(rs)] = torch.tensor(rs, dtype=torch.long)
            att[i, p : p + len(rs)] = 1
            loss[i, : len(rs)] = torch.tensor(mk, dtype=torch.float32)
    return TokenBatch(
        input_ids=ids,
        attention_mask=att,
        loss_mask=loss,
        prompt_lens=torch.tensor([len(x) for x in prompts], dtype=torch.long),
        response_lens=torch.tensor([len(x) for x in responses], dtype=torch.long),
        prompt_width=p,
    )
