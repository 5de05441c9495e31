"""The span type of a trajectory's response: which tokens the model sampled and which the environment added;
and :class:`TrainingSegment`, the extra context of a recorded session that split.

Their own module so that :mod:`agent.rollout` (the loop) and :mod:`agent.external` (trajectories assembled
from an external agent's recorded calls) share them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Span:
    """A half-open span ``[start, end)`` of ``response_ids``."""

    start: int
    end: int
    role: Literal["model", "observation"]
    action: str = ""  # model spans: search | answer | invalid; observations: information | invalid | failed


@dataclass
class TrainingSegment:
    """One more context of an episode that did not assemble into one (a recorded session that split,
    agent/external.py; :attr:`agent.rollout.Trajectory.extra_segments`): ``prompt_ids``, then ``response_ids`` with
    ``loss_mask`` (1: sampled, 0: context between calls) and ``sampling_logprobs`` (0.0 at context) -- the fields a
    training row needs, like a trajectory's. ``num_turns``: the model turns in it; ``num_observations``: the context
    spans between them."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    num_turns: int = 0
    num_observations: int = 0
