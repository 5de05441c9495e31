"""Packed encoder batches: texts share rows instead of each being padded to the batch's longest text.

Padding a batch of 32 NQ questions (about 12 tokens each) to its longest one wastes a third of the
forward pass's FLOPs. Packed rows hold several texts back to back: each token attends only to the
tokens of its own text (a block-diagonal 4D mask) and gets its position within its text, so every
text's hidden states are those of an unpadded forward. :class:`retriever.encoder.Encoder` checks
that a model honours this before it packs (RoBERTa, which offsets positions, does not).

On CPU the packed forward also runs as a TorchScript trace: the whole forward is one C++ call that
releases the GIL once, instead of re-taking it between the ~150 operators of an eager BERT forward.
Inside the server, whose event loop holds the GIL while it parses requests and writes answers, the
eager forward slows by ~4% at 32 concurrent clients and 5-10x under a thread that holds the GIL
continuously; the traced one does not.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Runs the model on packed inputs -> last hidden states (rows, width, hidden).
Forward = Callable[[dict[str, torch.Tensor]], torch.Tensor]


def _first_fit_decreasing(lengths: Sequence[int], width: int) -> list[list[int]]:
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(width - lengths[i])
    return rows


def pack_rows(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """Pack texts into rows: as few as first-fit decreasing needs for rows of ``max(row_tokens, longest)``
    tokens, then as narrow as still fits that many (a binary search over the width).

    lengths (N,) token counts -> rows, each a list of text indices (every index exactly once), longest
    texts first. Packed rows waste only their ends, and narrowing the rows spreads that slack: 16 NQ
    queries (190 tokens) take 4 x 64 = 256 token slots at full width, about 200 when balanced.
    """
    longest = max(lengths)
    rows = _first_fit_decreasing(lengths, max(row_tokens, longest))
    n_rows = len(rows)
    lo, hi = max(longest, -(-sum(lengths) // n_rows)), max(row_tokens, longest) - 1
    while lo <= hi:  # FFD's row count is not strictly monotone in the width: any width that fits will do
        mid = (lo + hi) // 2
        narrower = _first_fit_decreasing(lengths, mid)
        if len(narrower) <= n_rows:
            rows, hi = narrower, mid - 1
        else:
            lo = mid + 1
    return rows


@dataclass
class PackedBatch:
    """Model inputs for texts packed into rows, and where each text's tokens went."""

    inputs: dict[str, torch.Tensor]  # input_ids etc. (rows, width); attention_mask (rows, 1, width, width); position_ids
    text_of: torch.Tensor  # (rows, width) index of the text in each slot, -1 for padding at a row's end
    starts: torch.Tensor  # (N,) flat slot (row * width + offset) of each text's first token
    lengths: torch.Tensor  # (N,) float32 token counts


def pack_batch(feats: dict[str, list[list[int]]], row_tokens: int, pad_token_id: int, dtype: torch.dtype, device: str) -> PackedBatch:
    """Tokeniser output without padding (``input_ids`` and e.g. ``token_type_ids`` per text) -> a :class:`PackedBatch`."""
    ids = feats["input_ids"]
    lengths = [len(x) for x in ids]
    rows = pack_rows(lengths, row_tokens)
    width = max(sum(lengths[i] for i in row) for row in rows)
    text_of = np.full((len(rows), width), -1, dtype=np.int64)
    position = np.zeros((len(rows), width), dtype=np.int64)
    arrays = {key: np.full((len(rows), width), pad_token_id if key == "input_ids" else 0, dtype=np.int64) for key in feats if key != "attention_mask"}
    starts = np.empty(len(ids), dtype=np.int64)
    for r, row in enumerate(rows):
        pos = 0
        for i in row:
            n = lengths[i]
            for key, arr in arrays.items():
                arr[r, pos : pos + n] = feats[key][i]
            text_of[r, pos : pos + n] = i
            position[r, pos : pos + n] = np.arange(n)
            starts[i] = r * width + pos
            pos += n
    text = torch.from_numpy(text_of).to(device)
    # Additive mask (sdpa and eager attention both take it): 0 within a text, -inf-like across texts.
    # Padding attends to padding, so no softmax row is empty; its outputs are never read.
    same = (text[:, :, None] == text[:, None, :]).unsqueeze(1)
    mask = torch.zeros(same.shape, dtype=dtype, device=device).masked_fill_(~same, torch.finfo(dtype).min)
    inputs = {key: torch.from_numpy(arr).to(device) for key, arr in arrays.items()}
    inputs.update(attention_mask=mask, position_ids=torch.from_numpy(position).to(device))
    return PackedBatch(inputs, text, torch.from_numpy(starts).to(device), torch.tensor(lengths, dtype=torch.float32, device=device))


def pool_packed(hidden: torch.Tensor, batch: PackedBatch, pooling: str) -> torch.Tensor:
    """hidden (rows, width, H) -> (N, H) float32: each text's first token (``cls``) or the mean of its tokens."""
    flat = hidden.reshape(-1, hidden.shape[-1]).float()
    if pooling == "cls":
        return flat[batch.starts]
    text = batch.text_of.reshape(-1)
    real = text >= 0
    sums = torch.zeros(len(batch.lengths), flat.shape[1], dtype=torch.float32, device=flat.device).index_add_(0, text[real], flat[real])
    return sums / batch.lengths.unsqueeze(1)


def eager_forward(model: torch.nn.Module) -> Forward:
    return lambda inputs: model(**inputs).last_hidden_state


class _LastHidden(torch.nn.Module):
    """``model(**inputs).last_hidden_state`` with positional tensors, the form ``torch.jit.trace`` records."""

    def __init__(self, model: torch.nn.Module, keys: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.keys = keys

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.keys, tensors))).last_hidden_state


def traced_forward(model: torch.nn.Module, example: PackedBatch) -> Forward:
    """A TorchScript trace of the packed forward (shapes stay dynamic: nothing in it branches on them
    once the 4D mask is given); the caller checks it against :func:`eager_forward`."""
    keys = tuple(sorted(example.inputs))
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # TracerWarnings about Python values in the HF code, checked by the caller
        traced = torch.jit.trace(_LastHidden(model, keys), tuple(example.inputs[k] for k in keys), check_trace=False)

    def run(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.jit.optimized_execution(False):  # the plain interpreter: no per-shape re-specialisation
            return traced(*(inputs[k] for k in keys))

    return run
