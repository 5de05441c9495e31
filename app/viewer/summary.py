"""Did training help? Two evaluations of the same questions summarised: EM of each, the difference and its paired
bootstrap interval, per dataset and pooled.

Computed by :func:`eval.learning.compare_learning` over :func:`eval.learning.evaluated_datasets`, the code and the
dataset order the demo's report uses, so the viewer's numbers and the report's are the same numbers. Only like with
like: two evaluations under different sampling protocols (:func:`eval.learning.sampling_protocol`: greedy vs
sampled mean@k) are refused with both protocols named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from emapg.errors import UserError


class NotComparable(UserError):
    """Two evaluations that do not compare like for like (another protocol, another recorded slice of questions)."""


def protocol_of(path: Path) -> str:
    """The run's sampling protocol in words (:func:`eval.learning.sampling_protocol`); ``unknown`` when no file says
    (a run that has not written its settings yet, or a damaged one): such a run is compared with none."""
    from eval.learning import sampling_protocol

    try:
        return sampling_protocol(path)
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"


def check_like_for_like(label_a: str, path_a: Path, label_b: str, path_b: Path) -> str:
    """The protocol both runs share; :class:`NotComparable` naming both protocols otherwise."""
    a, b = protocol_of(path_a), protocol_of(path_b)
    if a != b or a == "unknown":
        raise NotComparable(f"{label_a} is {a} and {label_b} is {b}: not like for like; compare greedy with greedy, "
                            "sampled with sampled, on the same questions")
    return a


def _block(b: dict[str, Any]) -> dict[str, Any]:
    """One row: the numbers, and the text the report prints for them (:func:`eval.learning.difference_text`)."""
    from eval.learning import difference_text, percent_text

    d = b["difference"]
    return {"n": b["n"], "em_a": b["base"], "em_b": b["trained"], "difference": d["mean"], "interval": [d["low"], d["high"]],
            "text": {"em_a": percent_text(b["base"]), "em_b": percent_text(b["trained"]), "difference": difference_text(d)}}


def pair_summary(label_a: str, path_a: Path, label_b: str, path_b: Path) -> dict[str, Any]:
    """EM of A and of B (percent; a sampled run's per-question mean@k), B − A (pp) and its paired bootstrap interval,
    pooled over the datasets both scored and per dataset."""
    from eval.learning import compare_learning, evaluated_datasets

    protocol = check_like_for_like(label_a, path_a, label_b, path_b)
    theirs = set(evaluated_datasets(path_b))
    datasets = [d for d in evaluated_datasets(path_a) if d in theirs]
    if not datasets:
        raise NotComparable(f"{label_a} and {label_b} scored no dataset in common")
    try:
        c = compare_learning(path_a, path_b, datasets)
    except ValueError as e:
        raise NotComparable(f"{label_a} vs {label_b}: {e}") from None
    d = c["pooled"]["difference"]
    return {**_block(c["pooled"]), "protocol": protocol, "confidence": d["confidence"], "method": d["method"],
            "resamples": d["resamples"], "datasets": {ds: _block(b) for ds, b in c["datasets"].items()}}
