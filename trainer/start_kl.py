"""``kl/to_start``: the exact KL from the policy to the policy the run started with (``logging.kl_to_start``).

``kl/mean`` measures the distance to the anchor, which for EMA-PG moves with the policy; to compare how far
GRPO and EMA-PG runs drift (issue #42) both need the distance to the same place, the start. Per step, on
the step's own sampled responses and before the update (so of π_old, the policy that sampled them):

    kl/to_start = Σ_tokens KL(π_old(·|ctx) || π_start(·|ctx)) / #response tokens

exact over the vocabulary at every model-generated token (:func:`trainer.algo.topk_kl.exact_kl_from_hidden`,
never a (T, V) tensor), at the rollout temperature. Where the starting policy comes from, cheapest first:

* ``anchor``: a frozen anchor (``algorithm.ema.decay=1`` with a KL term: GRPO's reference) *is* the start;
* ``adapters_off``: LoRA: the base with the adapters disabled (B = 0 at initialisation), no tensors;
* ``copy``: full fine-tuning with a moving anchor (EMA-PG): a frozen copy of the weights taken at set-up,
  one more model's worth of memory (not under FSDP). After a resume this copy is of the resumed weights.

Costs two no-grad forward passes over the batch (start and policy); off by default.
"""

from __future__ import annotations

from typing import Any

import torch

from emapg.config import ConfigError
from trainer.algo.topk_kl import ExactKLAnchor
from trainer.batch import TokenBatch
from trainer.lora import AdaptersOffReference
from trainer.passes import run_passes
from trainer.policy import Policy

__all__ = ["StartPolicy", "KLToStart"]


class StartPolicy:
    """The run's starting policy, for ``kl/to_start`` (the step's concern: its pass :class:`KLToStart` over each batch);
    ``kind`` says where it comes from (module docstring)."""

    def __init__(self, policy: Policy, cfg: Any) -> None:
        self.policy, self.cfg = policy, cfg
        frozen_anchor = cfg.algorithm.ema.decay == 1.0
        self.tensors: dict[str, torch.Tensor] = {}
        self.head: tuple[torch.Tensor, torch.Tensor | None] | None = None
        if policy.anchor is not None and frozen_anchor:
            self.kind = "anchor"
        elif policy.lora is not None:
            self.kind = "adapters_off"
        elif policy.fsdp:
            raise ConfigError("logging.kl_to_start under FSDP needs a frozen reference (algorithm.kl with "
                              "algorithm.ema.decay=1) or LoRA: a full copy of the starting weights is not kept when sharded")
        else:
            self.kind = "copy"
            own = dict(policy.forward.named_parameters())
            self.tensors = {name: p.detach().clone() for name, p in own.items()}
            head = policy.model.get_output_embeddings()
            by_id = {id(p): name for name, p in own.items()}
            self.head = (self.tensors[by_id[id(head.weight)]],
                         None if head.bias is None else self.tensors[by_id[id(head.bias)]])

    @torch.no_grad()
    def _reference(self, mb: Any) -> ExactKLAnchor:
        """The start's side of the exact KL on micro-batch ``mb``: its hidden states and lm_head."""
        policy, args = self.policy, (mb.input_ids, mb.attention_mask, mb.response_width)
        if self.kind == "anchor":
            return policy.exact_kl_anchor(policy.anchor_hidden(mb), "reverse")
        if self.kind == "adapters_off":  # the head is frozen and shared: exact_kl_anchor hands it back
            with AdaptersOffReference().swap_into(policy.model), policy.autocast():
                hidden = policy.forward(*args, hidden_only=True)[0]
            return policy.exact_kl_anchor(hidden, "reverse")
        with policy.autocast():
            hidden = torch.func.functional_call(policy.forward, self.tensors, args, {"hidden_only": True})[0]
        weight, bias = self.head  # type: ignore[misc]
        to = dict(dtype=hidden.dtype, device=hidden.device)
        return ExactKLAnchor(hidden, weight.to(**to), None if bias is None else bias.to(**to), "reverse")

    def passes(self, batch: TokenBatch, sampled: Any = None, rows: Any = None) -> list["KLToStart"]:
        """The step's pass over ``batch`` (:mod:`trainer.passes`), run before the update: of π_old."""
        return [KLToStart(self, self.cfg)]

    def kl_sums(self, batch: TokenBatch, cfg: Any, device: torch.device) -> dict[str, float]:
        """This rank's ``health/kl_to_start_sum`` (the per-token KLs over response tokens) and
        ``health/kl_to_start_tokens`` for ``batch``, with the current weights."""
        return run_passes(batch, [KLToStart(self, cfg)], cfg.algorithm, device, share_prompts=cfg.model.share_prompt).sums


class KLToStart:
    """The pass of ``kl/to_start``: the policy's exact KL to its start on each micro-batch, summed over response tokens."""

    timing = "time/kl_to_start"
    per_micro_batch = True

    def __init__(self, start: StartPolicy, cfg: Any) -> None:
        self.start, self.cfg = start, cfg
        self.total, self.tokens = 0.0, 0.0

    def micro(self, mb: Any, rows: Any) -> None:
        st = self.start.policy.stats(mb, exact_kl_to=self.start._reference(mb), temperature=self.cfg.rollout.temperature,
                                     chunk_size=self.cfg.model.chunk_size)
        mask = mb.loss_mask.to(st.exact_kl.dtype)
        self.total += float((st.exact_kl * mask).sum())
        self.tokens += float(mask.sum())

    def finish(self, batch: TokenBatch) -> dict[str, float]:
        return {"health/kl_to_start_sum": self.total, "health/kl_to_start_tokens": self.tokens}
