"""The no-grad passes before the PPO updates: π_old's statistics and the anchor's, planned from the KL kind.

:func:`plan_stored_stats` turns what the KL kind needs (:meth:`trainer.kl_kinds.KLKind.needs`) and
the shape of the update into a :class:`StatsPlan`; :func:`compute_stored_stats` runs it over a
:class:`~trainer.batch.TokenBatch` and stores per-token tensors in ``batch.stored`` (CPU, aligned
with the response columns):

=================== ========== ====================================================================
key                 shape      what
=================== ========== ====================================================================
``old_logp``        (N, T)     log π_old of the sampled token (the trainer model before the update)
``entropy``         (N, T)     π_old's entropy (reported)
``topk_indices``    (N, T, k)  q: π_old's top-k (Top-k reverse) or the anchor's (Top-k forward)
``ref_logp``        (N, T)     the anchor's log-prob of the sampled token
``ref_logsumexp``   (N, T)     the anchor's logsumexp over the vocabulary
``ref_topk_logits`` (N, T, k)  the anchor's logits on q
``ref_hidden``      (N, T, H)  the anchor's final hidden states (exact KL)
=================== ========== ====================================================================

With one PPO epoch and one optimizer step π_old *is* the policy being differentiated: its
log-probs are the training pass's own (detached), so the π_old pass is skipped (as TRL does);
on-policy Top-k reverse KL then takes its indices in the training pass too and gathers the
anchor there per micro-batch (``fused_topk``), with no stored pass at all (unsharded only: under
FSDP2 the anchor's swap would reshard the policy mid-graph).  The rollout engine's sampling
log-probs, once trusted, would be one more source for ``old_logp`` here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch

from trainer.batch import MicroBatch, TokenBatch
from trainer import distributed as D
from trainer.config import AlgorithmConfig, TrainConfig
from trainer.kl_kinds import get_kl_kind
from trainer.policy import Policy
from trainer.topk_kl import Direction

__all__ = ["StatsPlan", "plan_stored_stats", "compute_stored_stats", "plan_micro_batches", "micro_batches", "fused_anchor_stats"]


@dataclass(frozen=True)
class StatsPlan:
    """What runs before (and, fused, during) the PPO updates of one step.

    ``old_pass``: π_old's log-probs and entropy are computed and stored; ``old_topk``: π_old's own
    top-k is taken there too (q of Top-k reverse). ``anchor``: the anchor pass stores token
    statistics (``"tokens"``) or final hidden states (``"hidden"``), or does not run.
    ``anchor_topk``: the anchor takes its own top-k (q of Top-k forward). ``gather_topk``: q's
    size, gathered by the policy in the training pass. ``fused_topk``: on-policy Top-k reverse —
    the training pass takes its own top-k of this size and the anchor gathers there. ``exact``:
    the direction of the exact KL the training pass computes from ``ref_hidden``.
    """

    old_pass: bool = False
    old_topk: int = 0
    anchor: Literal["none", "tokens", "hidden"] = "none"
    anchor_topk: int = 0
    gather_topk: int = 0
    fused_topk: int = 0
    exact: Direction | None = None

    @property
    def any_stored_pass(self) -> bool:
        return not self.fused_topk


def on_policy_single_update(cfg: TrainConfig, n: int, world_size: int) -> bool:
    """One PPO epoch and one optimizer step over this rank's ``n`` rows: π_old is the policy itself."""
    alg = cfg.algorithm
    return alg.ppo_epochs == 1 and n <= max(1, alg.mini_batch_size // world_size)


def plan_stored_stats(cfg: TrainConfig, *, on_policy: bool, fuse: bool) -> StatsPlan:
    """The plan for a step from the KL kind's needs. ``on_policy``: :func:`on_policy_single_update`;
    ``fuse``: the on-policy Top-k reverse shortcut is allowed (not under FSDP2)."""
    kl = cfg.algorithm.kl
    needs = get_kl_kind(kl.type).needs(kl) if kl.enabled else None
    old_topk = needs.topk if needs is not None and needs.topk_of == "old" else 0
    if old_topk and on_policy and fuse:
        return StatsPlan(fused_topk=old_topk)
    plan = StatsPlan(old_pass=not on_policy or bool(old_topk), old_topk=old_topk)
    if needs is None:
        return plan
    if needs.exact is not None:
        return StatsPlan(old_pass=plan.old_pass, anchor="hidden", exact=needs.exact)
    anchor_topk = needs.topk if needs.topk_of == "anchor" else 0
    return StatsPlan(old_pass=plan.old_pass, old_topk=old_topk, anchor="tokens", anchor_topk=anchor_topk, gather_topk=needs.topk)


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


@torch.no_grad()
def compute_stored_stats(batch: TokenBatch, plan: StatsPlan, policy: Policy, cfg: TrainConfig, device: torch.device) -> dict[str, float]:
    """Run ``plan``'s passes over ``batch`` and fill ``batch.stored``; returns their wall times."""
    if not plan.any_stored_pass:
        return {}  # old = current policy: indices and anchor statistics come inside the training pass
    temp, chunk = cfg.rollout.temperature, cfg.model.chunk_size
    n, t = batch.size, batch.response_width
    k = plan.old_topk or plan.anchor_topk
    topk_idx = torch.zeros(n, t, k, dtype=torch.long) if k else None
    timings = {}
    t0 = time.perf_counter()
    if plan.old_pass:
        old_logp, entropy = torch.zeros(n, t), torch.zeros(n, t)
        for rows in micro_batches(batch, range(n), cfg.algorithm, share_prompts=cfg.model.share_prompt):
            mb = batch.micro(rows, device)
            st = policy.stats(mb, topk=plan.old_topk, entropy=True, temperature=temp, chunk_size=chunk,
                              share_prompt=cfg.model.share_prompt)
            w = mb.response_width
            old_logp[rows, :w] = st.logp.float().cpu()
            entropy[rows, :w] = st.entropy.float().cpu()
            if plan.old_topk:
                topk_idx[rows, :w] = st.topk_indices.cpu()
        batch.stored["old_logp"] = old_logp
        batch.stored["entropy"] = entropy
    timings["time/old_logprobs"] = time.perf_counter() - t0
    if plan.anchor == "none":
        return timings
    t0 = time.perf_counter()
    if plan.anchor == "hidden":
        _store_anchor_hidden(batch, policy, cfg, device)
    else:
        _store_anchor_tokens(batch, plan, policy, cfg, device, topk_idx)
    timings["time/anchor"] = time.perf_counter() - t0
    return timings


def _store_anchor_tokens(batch: TokenBatch, plan: StatsPlan, policy: Policy, cfg: TrainConfig, device: torch.device,
                         topk_idx: torch.Tensor | None) -> None:
    n, t, k = batch.size, batch.response_width, plan.gather_topk
    ref_logp, ref_lse = torch.zeros(n, t), torch.zeros(n, t)
    ref_vals = torch.zeros(n, t, k) if k else None
    for rows in micro_batches(batch, range(n), cfg.algorithm, share_prompts=cfg.model.share_prompt):
        mb = batch.micro(rows, device)
        w = mb.response_width
        gather = topk_idx[rows, :w].to(device) if plan.old_topk else None
        st = policy.anchor_stats(mb, topk=plan.anchor_topk, gather_indices=gather, temperature=cfg.rollout.temperature,
                                 chunk_size=cfg.model.chunk_size)
        ref_logp[rows, :w] = st.logp.float().cpu()
        ref_lse[rows, :w] = st.logsumexp.float().cpu()
        if k:
            ref_vals[rows, :w] = st.topk_logits.float().cpu()
            if plan.anchor_topk:
                topk_idx[rows, :w] = st.topk_indices.cpu()
    batch.stored["ref_logp"] = ref_logp
    batch.stored["ref_logsumexp"] = ref_lse
    if k:
        batch.stored["ref_topk_logits"] = ref_vals
        batch.stored["topk_indices"] = topk_idx


def _store_anchor_hidden(batch: TokenBatch, policy: Policy, cfg: TrainConfig, device: torch.device) -> None:
    hidden: torch.Tensor | None = None
    for rows in micro_batches(batch, range(batch.size), cfg.algorithm, share_prompts=cfg.model.share_prompt):
        mb = batch.micro(rows, device)
        h = policy.anchor_hidden(mb)
        if hidden is None:  # in the dtype the forward produced (bf16 on GPU): H numbers per token
            hidden = torch.zeros(batch.size, batch.response_width, h.shape[-1], dtype=h.dtype)
        hidden[rows, : mb.response_width] = h.cpu()
    batch.stored["ref_hidden"] = hidden


def fused_anchor_stats(mb: MicroBatch, policy: Policy, indices: torch.Tensor, cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The anchor's statistics gathered on the training pass's own top-k ``indices`` (``StatsPlan.fused_topk``)."""
    ref = policy.anchor_stats(mb, gather_indices=indices, temperature=cfg.rollout.temperature, chunk_size=cfg.model.chunk_size)
    return {"ref_logp": ref.logp, "ref_logsumexp": ref.logsumexp, "ref_topk_logits": ref.topk_logits, "topk_indices": indices}
