"""The retriever outage guard: a run never trains on a rollout batch whose searches failed.

A search that fails after the client's retries becomes an observation saying so (the agent loop
never crashes on it), which is right for one flaky request and wrong for a retriever that is
gone: every trajectory would then be trained on "search failed" observations. After each
rollout, :meth:`SearchOutageGuard.accept` looks at the batch's failed-search fraction (over all
ranks, so every rank decides the same; ``collective=False`` where the caller holds the global batch
alone, as the asynchronous producer on rank 0 does, :mod:`trainer.pipeline`):

* at most ``retriever.max_failure_rate``: the batch is trained on;
* above it: the batch is dropped and rolled out again; the ``retriever.failure_patience``-th
  dropped batch in a row pauses training while :meth:`~retriever.client.RetrieverClient.wait_ready`
  waits up to ``retriever.wait`` seconds for every server's ``/health`` (and a keyed search);
  servers that do not come back, or searches that still fail after they did, stop the run
  with a :class:`~trainer.errors.TrainingError` naming the servers.

The counts are in the step's metrics (``search/failure_rate`` of the trained batch,
``search/rejected_batches`` and ``search/rejected_failures`` since the previous step).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from trainer import distributed as D
from trainer.config import RetrieverConfig
from trainer.errors import TrainingError

__all__ = ["SearchOutageGuard", "search_counts"]


def search_counts(trajectories: Sequence[Any]) -> tuple[float, float]:
    """(failed searches, searches) of this rank's trajectories (``agent.rollout.Trajectory``)."""
    return float(sum(t.search_failures for t in trajectories)), float(sum(t.num_searches for t in trajectories))


class SearchOutageGuard:
    """Accepts or drops rollout batches by their failed-search fraction; pauses and stops on an outage."""

    def __init__(self, retriever: Any, cfg: RetrieverConfig, *, warn: Callable[[str], None], collective: bool = True) -> None:
        self.retriever, self.cfg, self.warn = retriever, cfg, warn
        self.collective = collective  # False: the caller holds the global batch; no rank takes part in a collective
        self.streak = 0  # consecutive dropped batches
        self._rejected, self._rejected_failures, self._accepted_rate = 0, 0.0, 0.0

    def accept(self, trajectories: Sequence[Any]) -> bool:
        """Whether to train on this batch (False: roll it out again). Raises TrainingError on an outage."""
        counts = torch.tensor(search_counts(trajectories), dtype=torch.float64)
        failures, searches = (D.all_reduce_sum(counts) if self.collective else counts).tolist()
        rate = failures / searches if searches else 0.0
        cfg = self.cfg
        if rate <= cfg.max_failure_rate:
            self.streak, self._accepted_rate = 0, rate
            return True
        self.streak += 1
        self._rejected += 1
        self._rejected_failures += failures
        urls = ", ".join(self.retriever.urls)
        what = (f"{failures:.0f} of {searches:.0f} searches failed ({rate:.0%} > retriever.max_failure_rate="
                f"{cfg.max_failure_rate:g})")
        if self.streak > cfg.failure_patience:
            raise TrainingError(f"{what} again after the retriever at {urls} answered /health; stopping instead of "
                                f"training on failed searches (see the retriever's log)")
        self.warn(f"{what}; rollout batch dropped, not trained on ({self.streak}/{cfg.failure_patience})")
        if self.streak == cfg.failure_patience:
            self._pause(what, urls)
        return False

    def _pause(self, what: str, urls: str) -> None:
        from retriever.client import RetrievalError

        self.warn(f"training paused: waiting up to retriever.wait={self.cfg.wait:g} s for the retriever at {urls}")
        error = ""
        try:
            self.retriever.wait_ready(self.cfg.wait)
        except RetrievalError as e:
            error = str(e)
        failed = torch.tensor([float(bool(error))])
        if (D.all_reduce_max(failed) if self.collective else failed).item() > 0:
            raise TrainingError(f"{what} in {self.streak} consecutive rollout batches and "
                                f"{error or 'the retriever did not come back on another rank'}; stopping instead of "
                                f"training on failed searches")
        self.warn(f"the retriever at {urls} answers again; training resumes")

    def step_metrics(self) -> dict[str, float]:
        """The counts since the previous call (one step): what the step's metrics record."""
        out = {"search/failure_rate": self._accepted_rate, "search/rejected_batches": float(self._rejected),
               "search/rejected_failures": self._rejected_failures}
        self._rejected, self._rejected_failures = 0, 0.0
        return out
