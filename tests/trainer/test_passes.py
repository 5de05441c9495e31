"""The step's passes over its batch (trainer.passes): one micro-batch plan, each micro-batch built once and handed
to every pass in the declared order, then each pass's finish; its wall times and metric sums reported per pass."""

from __future__ import annotations

import torch

from trainer.batch import MicroBatch, TokenBatch, build_token_batch
from trainer.config import AlgorithmConfig
from trainer.passes import run_passes

PROMPTS = [[5, 6], [7], [8, 9, 10], [11], [12, 13]]
RESPONSES = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11]]
MASKS = [[1, 1, 1], [1], [1, 0], [1, 1, 0, 1], [1]]


class ResponseSums:
    """Sums each row's response ids on every micro-batch, recording which micro-batches it saw."""

    per_micro_batch = True

    def __init__(self, name: str, batch: TokenBatch, seen: list[tuple[str, int]]) -> None:
        self.timing, self.seen = f"time/{name}", seen
        self.sums = torch.zeros(batch.size, dtype=torch.long)
        self.finished = 0

    def micro(self, mb: MicroBatch, rows) -> None:
        self.seen.append((self.timing, id(mb)))
        self.sums[rows] = (mb.labels * mb.loss_mask).sum(-1).long()

    def finish(self, batch: TokenBatch) -> dict[str, float]:
        self.finished += 1
        batch.stored[self.timing] = self.sums
        return {f"{self.timing}_total": float(self.sums.sum())}


class Doubles:
    """Reads the first pass's result of the same micro-batch (a later pass may depend on an earlier one)."""

    timing, per_micro_batch = "time/doubles", True

    def __init__(self, first: ResponseSums) -> None:
        self.first, self.out = first, {}

    def micro(self, mb: MicroBatch, rows) -> None:
        self.out.update({int(r): 2 * int(self.first.sums[r]) for r in torch.arange(5)[rows]})

    def finish(self, batch: TokenBatch) -> dict[str, float]:
        return {}


class WholeBatch:
    """A pass that does all its work in finish (a remote teacher's shape)."""

    timing, per_micro_batch = "time/whole", False

    def micro(self, mb: MicroBatch, rows) -> None:
        raise AssertionError("a whole-batch pass is not run per micro-batch")

    def finish(self, batch: TokenBatch) -> dict[str, float]:
        return {"whole/rows": float(batch.size)}


def test_every_pass_sees_each_micro_batch_once_and_in_order():
    batch = build_token_batch(PROMPTS, RESPONSES, MASKS, pad_id=0)
    seen: list[tuple[str, int]] = []
    a, b = ResponseSums("a", batch, seen), ResponseSums("b", batch, seen)
    doubles = Doubles(a)
    out = run_passes(batch, [a, doubles, b, WholeBatch()], AlgorithmConfig(micro_batch_size=2, mini_batch_size=2), None)
    want = torch.tensor([sum(r * m for r, m in zip(resp, mask)) for resp, mask in zip(RESPONSES, MASKS)])
    assert torch.equal(batch.stored["time/a"], want) and torch.equal(batch.stored["time/b"], want)
    assert doubles.out == {i: 2 * int(want[i]) for i in range(5)}  # a's result of the same micro-batch, already there
    # 3 micro-batches of 2, 2, 1 rows, each built once: a and b saw the same object, a first
    assert [t for t, _ in seen] == ["time/a", "time/b"] * 3
    assert [m for _, m in seen[0::2]] == [m for _, m in seen[1::2]]
    assert a.finished == b.finished == 1
    assert out.sums == {"time/a_total": float(want.sum()), "time/b_total": float(want.sum()), "whole/rows": 5.0}
    assert set(out.timings) == {"time/a", "time/b", "time/doubles", "time/whole"}
    assert all(v >= 0 for v in out.timings.values())


def test_token_budget_micro_batches_cover_every_row_once():
    batch = build_token_batch(PROMPTS, RESPONSES, MASKS, pad_id=0)
    seen: list[tuple[str, int]] = []
    a = ResponseSums("a", batch, seen)
    run_passes(batch, [a], AlgorithmConfig(micro_batch_size=1, mini_batch_size=5, micro_batch_tokens=8), None)
    want = torch.tensor([sum(r * m for r, m in zip(resp, mask)) for resp, mask in zip(RESPONSES, MASKS)])
    assert torch.equal(batch.stored["time/a"], want)
    assert 1 < len(seen) < 5  # packed: fewer forwards than rows


def test_no_micro_batch_is_built_for_whole_batch_passes_only():
    batch = build_token_batch(PROMPTS, RESPONSES, MASKS, pad_id=0)
    out = run_passes(batch, [WholeBatch()], AlgorithmConfig(micro_batch_size=2, mini_batch_size=2), None)
    assert out.sums == {"whole/rows": 5.0}
