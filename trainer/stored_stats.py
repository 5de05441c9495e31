"""The no-grad passes before the PPO updates: π_old's statistics and the anchor's, planned from the KL kind.

:func:`plan_stored_stats` turns what the KL kind needs (:meth:`trainer.algo.kl_kinds.KLKind.needs`) and
the shape of the update into a :class:`StatsPlan`; :func:`compute_stored_stats` runs it over a
:class:`~trainer.batch.TokenBatch` and stores per-token tensors in ``batch.stored`` (CPU, aligned
with the response columns):

====================== ========== ====================================================================
key                    shape      what
====================== ========== ====================================================================
``old_logp``           (N, T)     log π_old of the sampled token (the trainer model before the update)
``entropy``            (N, T)     π_old's entropy (reported)
``topk_indices``       (N, T, k)  q: π_old's top-k (Top-k reverse) or the anchor's (Top-k forward)
``anchor_logp``        (N, T)     the anchor's log-prob of the sampled token
``anchor_logsumexp``   (N, T)     the anchor's logsumexp over the vocabulary
``anchor_topk_logits`` (N, T, k)  the anchor's logits on q
``anchor_hidden``      (N, T, H)  the anchor's final hidden states (exact KL)
====================== ========== ====================================================================

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

from trainer.batch import MicroBatch, TokenBatch, micro_batches
from trainer.config import TrainConfig
from trainer.algo.kl_kinds import get_kl_kind
from trainer.policy import Policy
from trainer.algo.topk_kl import Direction

__all__ = ["StatsPlan", "plan_stored_stats", "compute_stored_stats", "fused_anchor_stats"]


@dataclass(frozen=True)
class StatsPlan:
    """What runs before (and, fused, during) the PPO updates of one step.

    ``old_pass``: π_old's log-probs and entropy are computed and stored; ``old_topk``: π_old's own
    top-k is taken there too (q of Top-k reverse). ``anchor``: the anchor pass stores token
    statistics (``"tokens"``) or final hidden states (``"hidden"``), or does not run.
    ``anchor_topk``: the anchor takes its own top-k (q of Top-k forward). ``gather_topk``: q's
    size, gathered by the policy in the training pass. ``fused_topk``: on-policy Top-k reverse —
    the training pass takes its own top-k of this size and the anchor gathers there. ``exact``:
    the direction of the exact KL the training pass computes from ``anchor_hidden``.
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
    anchor_logp, anchor_lse = torch.zeros(n, t), torch.zeros(n, t)
    anchor_vals = torch.zeros(n, t, k) if k else None
    for rows in micro_batches(batch, range(n), cfg.algorithm, share_prompts=cfg.model.share_prompt):
        mb = batch.micro(rows, device)
        w = mb.response_width
        gather = topk_idx[rows, :w].to(device) if plan.old_topk else None
        st = policy.anchor_stats(mb, topk=plan.anchor_topk, gather_indices=gather, temperature=cfg.rollout.temperature,
                                 chunk_size=cfg.model.chunk_size)
        anchor_logp[rows, :w] = st.logp.float().cpu()
        anchor_lse[rows, :w] = st.logsumexp.float().cpu()
        if k:
            anchor_vals[rows, :w] = st.topk_logits.float().cpu()
            if plan.anchor_topk:
                topk_idx[rows, :w] = st.topk_indices.cpu()
    batch.stored["anchor_logp"] = anchor_logp
    batch.stored["anchor_logsumexp"] = anchor_lse
    if k:
        batch.stored["anchor_topk_logits"] = anchor_vals
        batch.stored["topk_indices"] = topk_idx


def _store_anchor_hidden(batch: TokenBatch, policy: Policy, cfg: TrainConfig, device: torch.device) -> None:
    hidden: torch.Tensor | None = None
    for rows in micro_batches(batch, range(batch.size), cfg.algorithm, share_prompts=cfg.model.share_prompt):
        mb = batch.micro(rows, device)
        h = policy.anchor_hidden(mb)
        if hidden is None:  # in the dtype the forward produced (bf16 on GPU): H numbers per token
            hidden = torch.zeros(batch.size, batch.response_width, h.shape[-1], dtype=h.dtype)
        hidden[rows, : mb.response_width] = h.cpu()
    batch.stored["anchor_hidden"] = hidden


def fused_anchor_stats(mb: MicroBatch, policy: Policy, indices: torch.Tensor, cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The anchor's statistics gathered on the training pass's own top-k ``indices`` (``StatsPlan.fused_topk``)."""
    anchor = policy.anchor_stats(mb, gather_indices=indices, temperature=cfg.rollout.temperature, chunk_size=cfg.model.chunk_size)
    return {"anchor_logp": anchor.logp, "anchor_logsumexp": anchor.logsumexp, "anchor_topk_logits": anchor.topk_logits,
            "topk_indices": indices}
