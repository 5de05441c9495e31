"""The span type of a trajectory's response: which tokens the model sampled and which the environment added.

Its own module so that :mod:`agent.rollout` (the loop) and :mod:`agent.external` (trajectories assembled
from an external agent's recorded calls) share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class Span:
    """A half-open span ``[start, end)`` of ``response_ids``."""

    start: int
    end: int
    role: Literal["model", "observation"]
    action: str = ""  # model spans: search | answer | invalid; observations: information | invalid | failed
