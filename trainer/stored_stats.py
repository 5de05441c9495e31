"""The no-grad passes before the PPO updates: π_old's statistics and the anchor's, planned from the KL kind.

:func:`plan_stored_stats` turns what the KL kind needs (:meth:`trainer.algo.kl_kinds.KLKind.needs`) and
the shape of the update into a :class:`StatsPlan`; :func:`stored_stat_passes` makes it the step's passes
(:mod:`trainer.passes`: :class:`OldStats`, :class:`AnchorTokens` or :class:`AnchorHidden`), which
:func:`compute_stored_stats` (alone) or the training step (with the other concerns' passes) runs over a
:class:`~trainer.batch.TokenBatch`, storing per-token tensors in ``batch.stored`` (CPU, aligned
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

from dataclasses import dataclass
from typing import Literal

import torch

from trainer.batch import MicroBatch, TokenBatch
from trainer.config import TrainConfig
from trainer.algo.kl_kinds import get_kl_kind
from trainer.passes import BatchPass, run_passes
from trainer.policy import Policy
from trainer.teacher import distill_gathers_topk
from trainer.algo.topk_kl import Direction

__all__ = ["StatsPlan", "step_stats_plan", "plan_stored_stats", "stored_stat_passes", "compute_stored_stats", "fused_anchor_stats"]


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


def step_stats_plan(cfg: TrainConfig, n: int, world_size: int, *, fuse: bool) -> StatsPlan:
    """The plan of a step over this rank's ``n`` rows: :func:`plan_stored_stats` with π_old the policy itself when the
    step is one update (:func:`on_policy_single_update`); ``fuse``: the trainer allows the on-policy Top-k reverse
    shortcut (not under FSDP2), which a top-k distillation estimator also turns off."""
    return plan_stored_stats(cfg, on_policy=on_policy_single_update(cfg, n, world_size),
                             fuse=fuse and not distill_gathers_topk(cfg))


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


def stored_stat_passes(batch: TokenBatch, plan: StatsPlan, policy: Policy, cfg: TrainConfig) -> list[BatchPass]:
    """``plan``'s passes over ``batch`` (:mod:`trainer.passes`): π_old's, then the anchor's (which may gather on π_old's top-k)."""
    if not plan.any_stored_pass:
        return []  # old = current policy: indices and anchor statistics come inside the training pass
    k = plan.old_topk or plan.anchor_topk
    topk_idx = torch.zeros(batch.size, batch.response_width, k, dtype=torch.long) if k else None
    passes: list[BatchPass] = [OldStats(batch, plan, policy, cfg, topk_idx)]
    if plan.anchor == "hidden":
        passes.append(AnchorHidden(batch, policy))
    elif plan.anchor == "tokens":
        passes.append(AnchorTokens(batch, plan, policy, cfg, topk_idx))
    return passes


def compute_stored_stats(batch: TokenBatch, plan: StatsPlan, policy: Policy, cfg: TrainConfig, device: torch.device) -> dict[str, float]:
    """Run ``plan``'s passes over ``batch`` and fill ``batch.stored``; returns their wall times."""
    return run_passes(batch, stored_stat_passes(batch, plan, policy, cfg), cfg.algorithm, device,
                      share_prompts=cfg.model.share_prompt).timings


class OldStats:
    """π_old's log-probs and entropy (and its own top-k: q of Top-k reverse) when ``plan.old_pass``; its wall time
    is reported (``time/old_logprobs``) whenever the plan stores statistics."""

    timing = "time/old_logprobs"

    def __init__(self, batch: TokenBatch, plan: StatsPlan, policy: Policy, cfg: TrainConfig, topk_idx: torch.Tensor | None) -> None:
        self.plan, self.policy, self.cfg, self.topk_idx = plan, policy, cfg, topk_idx
        self.per_micro_batch = plan.old_pass
        shape = (batch.size, batch.response_width) if plan.old_pass else (0, 0)
        self.old_logp, self.entropy = torch.zeros(shape), torch.zeros(shape)

    def micro(self, mb: MicroBatch, rows: slice | torch.Tensor) -> None:
        cfg = self.cfg
        st = self.policy.stats(mb, topk=self.plan.old_topk, entropy=True, temperature=cfg.rollout.temperature,
                               chunk_size=cfg.model.chunk_size, share_prompt=cfg.model.share_prompt)
        w = mb.response_width
        self.old_logp[rows, :w] = st.logp.float().cpu()
        self.entropy[rows, :w] = st.entropy.float().cpu()
        if self.plan.old_topk:
            self.topk_idx[rows, :w] = st.topk_indices.cpu()

    def finish(self, batch: TokenBatch) -> dict[str, float]:
        if self.plan.old_pass:
            batch.stored["old_logp"] = self.old_logp
            batch.stored["entropy"] = self.entropy
        return {}


class AnchorTokens:
    """The anchor's log-prob of the sampled token and logsumexp, and its logits on q (Top-k kinds: π_old's top-k,
    already taken on this micro-batch, or the anchor's own)."""

    timing = "time/anchor"
    per_micro_batch = True

    def __init__(self, batch: TokenBatch, plan: StatsPlan, policy: Policy, cfg: TrainConfig, topk_idx: torch.Tensor | None) -> None:
        self.plan, self.policy, self.cfg, self.topk_idx = plan, policy, cfg, topk_idx
        n, t, k = batch.size, batch.response_width, plan.gather_topk
        self.logp, self.lse = torch.zeros(n, t), torch.zeros(n, t)
        self.vals = torch.zeros(n, t, k) if k else None

    def micro(self, mb: MicroBatch, rows: slice | torch.Tensor) -> None:
        plan, w = self.plan, mb.response_width
        gather = self.topk_idx[rows, :w].to(mb.input_ids.device) if plan.old_topk else None
        st = self.policy.anchor_stats(mb, topk=plan.anchor_topk, gather_indices=gather, temperature=self.cfg.rollout.temperature,
                                      chunk_size=self.cfg.model.chunk_size)
        self.logp[rows, :w] = st.logp.float().cpu()
        self.lse[rows, :w] = st.logsumexp.float().cpu()
        if self.vals is not None:
            self.vals[rows, :w] = st.topk_logits.float().cpu()
            if plan.anchor_topk:
                self.topk_idx[rows, :w] = st.topk_indices.cpu()

    def finish(self, batch: TokenBatch) -> dict[str, float]:
        batch.stored["anchor_logp"] = self.logp
        batch.stored["anchor_logsumexp"] = self.lse
        if self.vals is not None:
            batch.stored["anchor_topk_logits"] = self.vals
            batch.stored["topk_indices"] = self.topk_idx
        return {}


class AnchorHidden:
    """The anchor's final hidden states (the exact KL's), in the dtype the forward produced (bf16 on GPU)."""

    timing = "time/anchor"
    per_micro_batch = True

    def __init__(self, batch: TokenBatch, policy: Policy) -> None:
        self.policy, self.size, self.width = policy, batch.size, batch.response_width
        self.hidden: torch.Tensor | None = None

    def micro(self, mb: MicroBatch, rows: slice | torch.Tensor) -> None:
        h = self.policy.anchor_hidden(mb)
        if self.hidden is None:  # H numbers per token
            self.hidden = torch.zeros(self.size, self.width, h.shape[-1], dtype=h.dtype)
        self.hidden[rows, : mb.response_width] = h.cpu()

    def finish(self, batch: TokenBatch) -> dict[str, float]:
        batch.stored["anchor_hidden"] = self.hidden
        return {}


def fused_anchor_stats(mb: MicroBatch, policy: Policy, indices: torch.Tensor, cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The anchor's statistics gathered on the training pass's own top-k ``indices`` (``StatsPlan.fused_topk``)."""
    anchor = policy.anchor_stats(mb, gather_indices=indices, temperature=cfg.rollout.temperature, chunk_size=cfg.model.chunk_size)
    return {"anchor_logp": anchor.logp, "anchor_logsumexp": anchor.logsumexp, "anchor_topk_logits": anchor.topk_logits,
            "topk_indices": indices}
