"""Sampled trajectories as padded tensors (:func:`trajectory_batch`), and micro-batch slices of them.

Layout (verl's): every row is a left-padded prompt followed by a right-padded
response, ``input_ids (N, P + T)``; the response occupies the last ``T`` columns.
``loss_mask (N, T)`` is 1 on tokens the model generated and 0 on tool observations
and padding. Per-token statistics stored before the PPO updates (old log-probs,
top-k indices, anchor statistics) are ``(N, T)`` / ``(N, T, k)`` tensors aligned with
the response columns. A micro-batch trims the columns that are padding in all its
rows, so short micro-batches cost what they contain; :func:`micro_batches` plans which rows go
together (fixed counts, or length-sorted runs within a padded-token budget).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from trainer import distributed as D

if TYPE_CHECKING:
    from agent.rollout import Trajectory
    from trainer.config import AlgorithmConfig


def pad_id_of(tokenizer: Any) -> int:
    """The one padding rule: the tokenizer's pad token, else its EOS token, else 0."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


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


def trajectory_batch(trajectories: Sequence[Trajectory], *, pad_id: int) -> TokenBatch:
    """The one conversion of sampled trajectories into a token batch: ids, attention and loss masks
    (:func:`build_token_batch`) and the engine's sampling log-probs as the ``behavior_logp`` stored
    statistic (:func:`behavior_logp_rows`)."""
    batch = build_token_batch([list(t.prompt_ids) for t in trajectories], [list(t.response_ids) for t in trajectories],
                              [list(t.loss_mask) for t in trajectories], pad_id=pad_id)
    batch.stored["behavior_logp"] = behavior_logp_rows(trajectories, batch.response_width)
    return batch


def behavior_logp_rows(trajectories: Sequence[Trajectory], response_width: int) -> Tensor:
    """The engine's sampling log-probs (:attr:`agent.rollout.Trajectory.sampling_logprobs`) as the
    ``(N, T)`` ``behavior_logp`` stored statistic (:mod:`trainer.algo.behavior`), 0 past a row's end.

    A row whose log-probs do not match its response (a prompt that could not be built keeps an empty
    response) is all zeros; its loss mask is 0 there anyway.
    """
    out = torch.zeros(len(trajectories), response_width)
    for i, t in enumerate(trajectories):
        row = t.sampling_logprobs
        if 0 < len(row) == len(t.response_ids) <= response_width:
            out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


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


def plan_micro_batches(batch: TokenBatch, rows: range, micro_batch_size: int, token_budget: int = 0,
                       *, at_least: int = 1, share_prompts: bool = False) -> list[slice | torch.Tensor]:
    """Split ``rows`` of ``batch`` into micro-batches (forward/backward units).

    ``token_budget == 0``: consecutive runs of ``micro_batch_size`` rows. ``token_budget > 0``: the rows
    sorted by length (response, then prompt; longest first) and cut into consecutive runs whose padded
    tensor -- ``rows × (widest prompt + widest response)``, what :meth:`TokenBatch.micro` builds and the
    model computes -- fits the budget (a row longer than the budget goes alone): the fewest runs that
    fit, and among those the cuts that compute the fewest tokens (dynamic programming over the sorted
    rows). Those micro-batches are index tensors. Rows of similar length then share a micro-batch, so
    less padding is computed; losses normalised over the whole mini-batch do not depend on the grouping.

    ``share_prompts`` (``model.share_prompt``: each distinct prompt of a micro-batch runs once): with a
    budget, a run computes ``distinct prompts × widest prompt + rows × widest response`` tokens, and
    the cuts are searched in two orders -- by length as above, and with the rows of one prompt (a GRPO
    group) adjacent (groups by their longest response, then each group's rows by length) -- taking the
    better (fewest runs, then fewest such tokens): groups stay together where that does not cost an
    extra forward (the budget itself still bounds the padded tensor). Fixed runs of consecutive rows
    keep the group-major rollout order's groups together already.

    ``at_least``: split the largest micro-batches in two until there are that many (every rank of a
    sharded run must run the same number of forwards; at most ``len(rows)``).
    """
    if token_budget <= 0:
        return [slice(i, min(i + micro_batch_size, rows.stop)) for i in range(rows.start, rows.stop, micro_batch_size)]
    prompt, response = batch.prompt_lens.tolist(), batch.response_lens.tolist()
    by_length = sorted(rows, key=lambda i: (-response[i], -prompt[i], i))
    if share_prompts:
        group = _prompt_groups(batch, rows)
        longest: dict[int, int] = {}
        for i in rows:
            longest[group[i]] = max(longest.get(group[i], 0), response[i])
        by_group = sorted(rows, key=lambda i: (-longest[group[i]], -prompt[i], group[i], -response[i], i))
        # The better of the two orders' best cuts: never more forwards, nor more shared-prompt tokens, than by length alone.
        _, groups = min(_cut_runs(order, prompt, response, group, token_budget) for order in (by_length, by_group))
    else:
        _, groups = _cut_runs(by_length, prompt, response, {i: i for i in rows}, token_budget)
    while len(groups) < min(at_least, len(rows)):
        big = max(range(len(groups)), key=lambda g: len(groups[g]))
        half = len(groups[big]) // 2
        groups[big : big + 1] = [groups[big][:half], groups[big][half:]]
    return [torch.tensor(g, dtype=torch.long) for g in groups]


def _cut_runs(order: list[int], prompt: list[int], response: list[int], group: dict[int, int],
              token_budget: int) -> tuple[tuple[int, int], list[list[int]]]:
    """The best cut of ``order`` into consecutive runs within ``token_budget`` padded tokens: ((runs, computed
    tokens), the runs). A run computes ``distinct prompts × widest prompt + rows × widest response`` tokens
    (``group``: row → its prompt; every row its own prompt gives the padded size). Dynamic programming:
    best[j] is the best cut of the first j rows, cut[j] its last run's start."""
    n = len(order)
    best: list[tuple[int, int]] = [(0, 0)] + [(n + 1, 0)] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        widest_prompt = widest_response = 0
        prompts_in_run: set[int] = set()
        for i in range(j - 1, -1, -1):  # the run order[i:j]
            row = order[i]
            widest_prompt = max(widest_prompt, prompt[row])
            widest_response = max(widest_response, max(1, response[row]))
            prompts_in_run.add(group[row])
            if (j - i) * (widest_prompt + widest_response) > token_budget and j - i > 1:
                break  # longer runs only grow
            cost = len(prompts_in_run) * widest_prompt + (j - i) * widest_response
            candidate = (best[i][0] + 1, best[i][1] + cost)
            if candidate < best[j]:
                best[j], cut[j] = candidate, i
    runs: list[list[int]] = []
    j = n
    while j > 0:
        runs.insert(0, order[cut[j] : j])
        j = cut[j]
    return best[n], runs


def _prompt_groups(batch: TokenBatch, rows: range) -> dict[int, int]:
    """Row → the first row (of ``rows``) with the same prompt tokens (what prompt sharing deduplicates)."""
    first: dict[tuple[int, ...], int] = {}
    out = {}
    for i in rows:
        p = int(batch.prompt_lens[i])
        key = tuple(batch.input_ids[i, batch.prompt_width - p : batch.prompt_width].tolist())
        out[i] = first.setdefault(key, i)
    return out


def micro_batches(batch: TokenBatch, rows: range, alg: AlgorithmConfig, *, share_prompts: bool = False) -> list[slice | torch.Tensor]:
    """:func:`plan_micro_batches` by ``algorithm.micro_batch_size`` / ``micro_batch_tokens`` (``share_prompts``:
    ``model.share_prompt``), with as many micro-batches on this rank as on the rank that has the most
    (FSDP2's forwards are collective)."""
    planned = plan_micro_batches(batch, rows, alg.micro_batch_size, alg.micro_batch_tokens, share_prompts=share_prompts)
    if alg.micro_batch_tokens > 0:  # fixed row counts are the same on every rank already
        most = int(D.all_reduce_max(torch.tensor([len(planned)], dtype=torch.float64)).item())
        if most > len(planned):
            planned = plan_micro_batches(batch, rows, alg.micro_batch_size, alg.micro_batch_tokens, at_least=most,
                                         share_prompts=share_prompts)
    return planned
