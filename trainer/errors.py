"""The trainer's own error: a run that cannot continue (its CLI prints the message and exits 1)."""

from __future__ import annotations

__all__ = ["TrainingError"]


class TrainingError(RuntimeError):
    """Training cannot continue (repeated NaN/inf, a rollout that keeps failing, a retriever that is gone)."""
