"""A training step's no-grad forward passes over its batch, declared as data and run together.

Before the update, a step needs some models' statistics on every response token of its batch: π_old's
log-probs (:mod:`trainer.stored_stats`), the anchor's statistics or hidden states (the same module), the
distillation teacher's scores (:mod:`trainer.teacher`), the start policy's KL (:mod:`trainer.start_kl`).
Each is a :class:`BatchPass`: what it does on one micro-batch, and what it leaves in ``batch.stored`` or in
the step's metric sums once every micro-batch has run. The step's plan is the list of its passes;
:func:`run_passes` cuts the batch into micro-batches once (:func:`trainer.batch.micro_batches`), builds each
micro-batch's tensors once, and runs every pass on it before going on to the next, so a new concern adds a
pass here, not another walk over the batch.

A pass that reads another's output of the same micro-batch (the anchor gathering on π_old's top-k) comes after
it in the list. A pass with ``per_micro_batch = False`` (a remote teacher, which batches its own requests) does
all its work in :meth:`BatchPass.finish`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from trainer.batch import MicroBatch, TokenBatch, micro_batches

__all__ = ["BatchPass", "StepConcern", "PassResults", "run_passes"]


class BatchPass(Protocol):
    """One model's no-grad statistics over a step's batch."""

    timing: str  # the metric its wall time is reported as ("time/...")
    per_micro_batch: bool  # False: all its work is in finish()

    def micro(self, mb: MicroBatch, rows: slice | torch.Tensor) -> None:
        """Its statistics on micro-batch ``mb`` (the batch's ``rows``), kept until :meth:`finish`."""

    def finish(self, batch: TokenBatch) -> dict[str, float]:
        """Store what it computed in ``batch.stored``; return this rank's metric sums (may be empty)."""


class StepConcern(Protocol):
    """A concern of the training step with passes over its batch (the teacher, ``kl/to_start``): the Trainer asks each
    for its passes and runs them with the stored statistics' in one :func:`run_passes`."""

    def passes(self, batch: TokenBatch, sampled: Any, rows: Any) -> list[BatchPass]:
        """Its passes over ``batch``: the :class:`~trainer.sampled_batch.TrainingRows` ``rows`` of the
        :class:`~trainer.sampled_batch.SampledBatch` ``sampled``."""


@dataclass
class PassResults:
    """What :func:`run_passes` did: each pass's wall time (``time/...``) and their metric sums."""

    timings: dict[str, float] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)


@torch.no_grad()
def run_passes(batch: TokenBatch, passes: Sequence[BatchPass], alg: Any, device: torch.device | None, *,
               share_prompts: bool = False) -> PassResults:
    """Run ``passes`` over ``batch``: one micro-batch plan (``alg``: the :class:`trainer.config.AlgorithmConfig`'s
    ``micro_batch_size`` / ``micro_batch_tokens``; ``share_prompts``: ``model.share_prompt``), each micro-batch built
    once on ``device`` and handed to every pass in order, then each pass's :meth:`~BatchPass.finish`."""
    out = PassResults({p.timing: 0.0 for p in passes})
    if any(p.per_micro_batch for p in passes):
        for rows in micro_batches(batch, range(batch.size), alg, share_prompts=share_prompts):
            t0 = time.perf_counter()  # building the micro-batch's tensors counts to the first pass
            mb = batch.micro(rows, device)
            for p in passes:
                if p.per_micro_batch:
                    p.micro(mb, rows)
                    t1 = time.perf_counter()
                    out.timings[p.timing] += t1 - t0
                    t0 = t1
    for p in passes:
        t0 = time.perf_counter()
        out.sums.update(p.finish(batch))
        out.timings[p.timing] += time.perf_counter() - t0
    return out
