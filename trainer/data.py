"""Training prompts: loading and a resumable, seeded sampler.

The sampler walks a per-epoch permutation (seeded by ``seed`` and the epoch), so
its whole state is two integers and resuming from a checkpoint replays exactly the
same prompt order. Every sampled prompt gets a group id unique over the whole run
(``"<step>-<index>"``): the paper's search trainer used the row index inside each
source dataset, which merges groups of different datasets (ALGORITHM.md §4.6).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from emapg.config import ConfigError
from tasks.datasets import DatasetError, Example, load_dataset
from trainer.distributed import shard_slice


def load_prompts(train: str, *, split: str, limit: int | None, seed: int) -> list[Example]:
    """Examples from a registered dataset name or a file (:func:`tasks.datasets.load_dataset`)."""
    path = Path(train).expanduser()
    try:
        if path.suffix in (".jsonl", ".json", ".parquet", ".gz") or path.exists():
            if not path.is_file():
                raise ConfigError(f"data.train: file not found: {path}")
            examples = load_dataset(path.stem.split(".")[0], path=path, limit=limit, seed=seed)
        else:
            examples = load_dataset(train, split=split, limit=limit, seed=seed)
    except DatasetError as e:
        raise ConfigError(f"data.train: {e}") from None
    if not examples:
        raise ConfigError(f"data.train: {train!r} holds no examples")
    return examples


@dataclass
class SampledPrompt:
    example: Example
    group_id: str


class PromptSampler:
    """Seeded epoch-permutation sampler with a two-integer state."""

    def __init__(self, examples: list[Example], *, seed: int, shuffle: bool = True) -> None:
        if not examples:
            raise ValueError("no training examples")
        self.examples = examples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.examples)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next(self, count: int, step: int) -> list[SampledPrompt]:
        out = []
        for i in range(count):
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            out.append(SampledPrompt(self.examples[int(self._order[self.position])], f"{step}-{i}"))
            self.position += 1
        return out

    def next_share(self, count: int, step: int, rank: int, world_size: int) -> list[SampledPrompt]:
        """The global batch of ``count`` prompts (every rank draws it: the position stays one global
        count, whatever the world size), then ``rank``'s contiguous share of it."""
        return self.next(count, step)[shard_slice(count, rank, world_size)]

    @property
    def consumed(self) -> int:
        """Prompts drawn so far over the whole run (all ranks together: one global order)."""
        return self.epoch * len(self.examples) + self.position

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": len(self.examples),
                "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("size", len(self.examples)) != len(self.examples):
            raise ValueError(
                f"the checkpoint's data loader saw {state['size']} examples but the config now gives {len(self.examples)}"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        if "consumed" in state and int(state["consumed"]) != self.consumed:
            raise ValueError(f"the checkpoint's data position is inconsistent: consumed={state['consumed']} but "
                             f"epoch {self.epoch} at position {self.position} of {len(self.examples)}")
        self._order = self._permutation(self.epoch)
