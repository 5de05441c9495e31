"""Recorded retrievals: every search an evaluation makes is written down, and can be answered again.

``emapg eval`` (qa) searches through a :class:`RecordedRetriever`: each batch's distinct
``(query, top-k)`` and the passages returned are appended to ``<out>/retrievals.jsonl`` (before the
batch's items, so an item never exists without its searches). ``emapg eval --replay RUN`` answers
searches from ``RUN/retrievals.jsonl`` instead of a server, so a rerun of the same model with the
same protocol reproduces RUN exactly, and a new model evaluated against RUN's retrievals shows
what a policy change does with the retriever held fixed. A query RUN never made is an error (the
batch is not written), unless a live retriever is also given (``--retriever-url`` / ``--index``),
which then answers it -- after its fingerprint was checked against RUN's.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from emapg.errors import UserError
from emapg.jsonl import read_jsonl_repairing

__all__ = ["RETRIEVALS_FILE", "ReplayMissError", "RecordedRetriever", "load_retrievals"]

RETRIEVALS_FILE = "retrievals.jsonl"
Key = tuple[str, int | None]


class ReplayMissError(LookupError):
    """A query that the replayed run did not record (and no live retriever to ask)."""


def load_retrievals(run_dir: str | Path) -> dict[Key, list[dict]]:
    """``(query, topk) -> hits`` recorded in ``run_dir/retrievals.jsonl``."""
    path = Path(run_dir) / RETRIEVALS_FILE
    if not path.is_file():
        raise UserError(f"--replay {run_dir}: no {RETRIEVALS_FILE} (only qa runs written by this version record their searches)")
    return {(r["query"], r["topk"]): r["hits"] for r in read_jsonl_repairing(path)}


class RecordedRetriever:
    """A retriever (``retrieve(queries, topk=...)``) that answers from ``recorded`` first, then from
    ``live``, and keeps every answer of the current batch for :meth:`finish_batch`. Thread-safe (the
    async rollout driver searches from a thread pool)."""

    def __init__(self, live: Any = None, recorded: dict[Key, list[dict]] | None = None) -> None:
        if live is None and recorded is None:
            raise ValueError("a RecordedRetriever needs a live retriever or recorded retrievals")
        self.live, self.recorded = live, recorded or {}
        self._batch: dict[Key, list[dict]] = {}
        self._misses: list[str] = []
        self._lock = threading.Lock()

    def retrieve(self, queries: list[str], topk: int | None = None) -> list[list[dict]]:
        found = {q: self.recorded[(q, topk)] for q in queries if (q, topk) in self.recorded}
        missing = list(dict.fromkeys(q for q in queries if q not in found))
        if missing and self.live is None:
            with self._lock:
                self._misses += missing
            raise ReplayMissError(f"query not recorded in the replayed run: {missing[0]!r}")
        if missing:
            found.update(zip(missing, self.live.retrieve(missing, topk=topk)))
        with self._lock:
            for q in queries:
                self._batch[(q, topk)] = found[q]
        return [found[q] for q in queries]

    def finish_batch(self) -> list[dict[str, Any]]:
        """The batch's retrievals as ``retrievals.jsonl`` rows; a :class:`UserError` when a query was
        not recorded (the batch's items must not be written with searches that failed for that)."""
        with self._lock:
            misses, self._misses = self._misses, []
            rows = [{"query": q, "topk": k, "hits": hits} for (q, k), hits in self._batch.items()]
            self._batch = {}
        if misses:
            raise UserError(f"--replay: {len(set(misses))} quer{'y was' if len(set(misses)) == 1 else 'ies were'} not recorded in the "
                            f"replayed run (first: {misses[0]!r}); give --retriever-url or --index to answer them live")
        return rows
