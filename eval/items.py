"""The per-item files of an evaluation run: ``<out>/items/<dataset>.jsonl``, one line per question.

A batch's records are appended in one write once the batch is finished (:func:`emapg.jsonl.append_jsonl`);
a torn last line (killed mid-write) is dropped when the file is read back, and its question redone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from emapg.jsonl import append_jsonl, read_jsonl_repairing
from tasks.datasets import Example

ITEMS_DIR = "items"


def items_file(out_dir: Path, dataset: str) -> Path:
    return out_dir / ITEMS_DIR / f"{dataset}.jsonl"


def read_items(out_dir: Path, dataset: str) -> list[dict[str, Any]]:
    """The records written so far (a torn tail cut off the file)."""
    return read_jsonl_repairing(items_file(out_dir, dataset))


def append_items(out_dir: Path, dataset: str, records: list[dict[str, Any]]) -> None:
    append_jsonl(items_file(out_dir, dataset), records)


def ordered(records: list[dict[str, Any]], examples: Sequence[Example]) -> list[dict[str, Any]]:
    """Records of this run's questions, in dataset order (an items file may hold more if
    an earlier run used a larger --limit with another fingerprint; never mixed in)."""
    by_id = {r["id"]: r for r in records}
    missing = [ex.id for ex in examples if ex.id not in by_id]
    if missing:
        raise RuntimeError(f"{len(missing)} questions have no result (first: {missing[0]})")
    return [by_id[ex.id] for ex in examples]
