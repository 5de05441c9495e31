"""Dense text encoders: transformers / sentence-transformers checkpoints, mean or CLS pooling.

Departures from Search-R1's encoder, each for a measured or documented reason:

* Query/passage prefixes (e5 ``"query: "``/``"passage: "``, bge's instruction) are explicit settings,
  recorded in the index's ``meta.json`` and read back by the server. Search-R1 infers them from a
  substring of the model name, and its builder and server disagree for names like ``e5-small``.
  A small table of known checkpoints fills them in only on an *exact* name match.
* fp16 only on GPU: on CPU (no fp16 arithmetic) fp16 encoding is 3.5x slower than fp32.
  bf16 is an opt-in for CPUs with bf16 instructions (AVX512-BF16/AMX): 1.8x faster batches of
  MiniLM queries here, cosine to the fp32 vectors > 0.9999, same recall@3 on the NQ test index.
* Dynamic padding with sort-by-length batching instead of padding a 512-passage batch to the
  longest passage (Search-R1's builder reached 18 passages/s on 2 cores that way).
* Several GPUs: one model replica per device, batches spread over them by threads (PyTorch
  releases the GIL inside CUDA kernels).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np

Pooling = Literal["mean", "cls"]

log = logging.getLogger("retriever.encoder")

# Tokens per packed row. A row's attention is dense (width^2) but masked to its texts, so wider rows waste
# attention work, narrower ones leave more padding at row ends. Measured on NQ questions (about 12 tokens),
# MiniLM fp32, one CPU thread, batches of 32-64: 64 is fastest (1.3-1.6x the padded forward), 128 and 256 lose.
ROW_TOKENS = 64
# Texts of different lengths whose packed and padded embeddings are compared when a model loads.
PACKING_PROBES = (
    "a",
    "who wrote hamlet",
    "when was the last time the eagles won the super bowl",
    '"Paris"\nParis is the capital and largest city of France, on the Seine.',
)

# Exact (lower-cased) names only; anything else gets no prefixes unless given explicitly.
KNOWN_ENCODERS: dict[str, dict] = {
    "minilm": {"pooling": "mean", "query_prefix": "", "passage_prefix": ""},
    "sentence-transformers/all-minilm-l6-v2": {"pooling": "mean", "query_prefix": "", "passage_prefix": ""},
    "intfloat/e5-base-v2": {"pooling": "mean", "query_prefix": "query: ", "passage_prefix": "passage: "},
    "intfloat/e5-small-v2": {"pooling": "mean", "query_prefix": "query: ", "passage_prefix": "passage: "},
    "intfloat/e5-large-v2": {"pooling": "mean", "query_prefix": "query: ", "passage_prefix": "passage: "},
    "baai/bge-small-en-v1.5": {
        "pooling": "cls",
        "query_prefix": "Represent this sentence for searching relevant passages: ",
        "passage_prefix": "",
    },
    "baai/bge-base-en-v1.5": {
        "pooling": "cls",
        "query_prefix": "Represent this sentence for searching relevant passages: ",
        "passage_prefix": "",
    },
    "baai/bge-large-en-v1.5": {
        "pooling": "cls",
        "query_prefix": "Represent this sentence for searching relevant passages: ",
        "passage_prefix": "",
    },
}


@dataclass(frozen=True)
class EncoderSpec:
    """Everything that must be identical at index and query time (stored in ``meta.json``)."""

    name: str
    pooling: Pooling = "mean"
    query_prefix: str = ""
    passage_prefix: str = ""
    max_length: int = 256
    normalize: bool = True

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EncoderSpec":
        return cls(**{k: d[k] for k in ("name", "pooling", "query_prefix", "passage_prefix", "max_length", "normalize")})


def _sentence_transformers_pooling(folder: Path) -> Pooling | None:
    """The pooling a sentence-transformers folder declares in ``1_Pooling/config.json``, if any."""
    cfg = folder / "1_Pooling" / "config.json"
    if not cfg.is_file():
        return None
    c = json.loads(cfg.read_text())
    if c.get("pooling_mode_cls_token"):
        return "cls"
    if c.get("pooling_mode_mean_tokens"):
        return "mean"
    return None


def make_spec(
    name: str,
    *,
    pooling: Pooling | None = None,
    query_prefix: str | None = None,
    passage_prefix: str | None = None,
    max_length: int = 256,
) -> EncoderSpec:
    """Fill unset fields from the exact-name table, then the sentence-transformers config, then defaults."""
    from emapg.models import resolve_model

    known = KNOWN_ENCODERS.get(name.lower(), {})
    if pooling is None:
        pooling = known.get("pooling")
    if pooling is None:
        path = Path(resolve_model(name))
        pooling = (_sentence_transformers_pooling(path) if path.is_dir() else None) or "mean"
    if pooling not in ("mean", "cls"):
        raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
    return EncoderSpec(
        name=name,
        pooling=pooling,
        query_prefix=known.get("query_prefix", "") if query_prefix is None else query_prefix,
        passage_prefix=known.get("passage_prefix", "") if passage_prefix is None else passage_prefix,
        max_length=max_length,
    )


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
    texts first. Padding a batch to its longest text wastes a third of a 32-query NQ batch's FLOPs;
    packed rows waste only their ends, and narrowing the rows spreads that slack: 16 NQ queries
    (190 tokens) take 4 x 64 = 256 token slots at full width, about 200 when balanced.
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


def resolve_devices(device: str) -> list[str]:
    """``auto`` -> every CUDA device or ``cpu``; ``cuda`` -> every CUDA device; ``cuda:1`` -> that one."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was requested but no CUDA device is visible")
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [device]


class Encoder:
    """Encode texts to L2-normalised float32 vectors (numpy) with one replica per device."""

    def __init__(self, spec: EncoderSpec, *, device: str = "auto", fp16: bool | None = None, bf16: bool = False, pack: bool = True, row_tokens: int = ROW_TOKENS):
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from emapg.models import resolve_model

        self.spec = spec
        self.devices = resolve_devices(device)
        on_gpu = self.devices[0].startswith("cuda")
        if bf16 and fp16:
            raise ValueError("choose fp16 or bf16, not both")
        self.fp16 = (on_gpu and not bf16) if fp16 is None else bool(fp16)
        if self.fp16 and not on_gpu:
            raise ValueError("fp16 encoding is only supported on GPU (it is ~3.5x slower than fp32 on CPU; bf16 is the CPU option)")
        self.bf16 = bool(bf16)
        hf_logging.disable_progress_bar()  # a weight-loading bar per replica clutters build/serve logs
        path = resolve_model(spec.name)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        dtype = torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32
        self.dtype = str(dtype).removeprefix("torch.")
        base = AutoModel.from_pretrained(path, dtype=dtype).eval()
        self.models = []
        for i, dev in enumerate(self.devices):
            m = base if i == 0 else AutoModel.from_pretrained(path, dtype=dtype).eval()
            self.models.append(m.to(dev))
        self.dim = int(base.config.hidden_size)
        self._pool = ThreadPoolExecutor(len(self.devices)) if len(self.devices) > 1 else None
        self.row_tokens = row_tokens
        # Packing texts into rows needs a model that honours 4D masks and position ids (BERT-family
        # encoders do; RoBERTa offsets its positions): checked, not assumed.
        self.packed = pack and self._packing_is_exact()

    def encode_queries(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        return self.encode([self.spec.query_prefix + t for t in texts], batch_size=batch_size)

    def encode_passages(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        return self.encode([self.spec.passage_prefix + t for t in texts], batch_size=batch_size)

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """``texts`` (N,) -> float32 array (N, dim), rows in input order; ``batch_size`` texts per forward pass."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        enc = self.tokenizer(texts, truncation=True, max_length=self.spec.max_length, padding=False)
        ids = enc["input_ids"]
        order = np.argsort([-len(x) for x in ids], kind="stable")  # longest first: OOM shows early
        batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        forward = self._forward_packed if self.packed else self._forward_padded

        def run(job: tuple[int, np.ndarray]) -> None:
            k, rows = job
            feats = {key: [enc[key][r] for r in rows] for key in enc.keys()}
            out[rows] = forward(self.models[k % len(self.models)], self.devices[k % len(self.devices)], feats)

        jobs = list(enumerate(batches))
        if self._pool is None:
            for job in jobs:
                run(job)
        else:
            list(self._pool.map(run, jobs))
        return out

    def _forward_padded(self, model, device: str, feats: dict) -> np.ndarray:
        """One forward over the texts padded to the longest (the reference the packed forward must equal)."""
        import torch

        batch = self.tokenizer.pad(feats, return_tensors="pt")
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state
            if self.spec.pooling == "cls":
                emb = hidden[:, 0].float()
            else:
                mask = batch["attention_mask"].unsqueeze(-1).to(torch.float32)
                emb = (hidden.float() * mask).sum(1) / mask.sum(1).clamp(min=1)
            if self.spec.normalize:
                emb = torch.nn.functional.normalize(emb, dim=-1)
        return emb.cpu().numpy()

    def _forward_packed(self, model, device: str, feats: dict) -> np.ndarray:
        """One forward over the texts packed into rows (no padding inside a row), see :func:`pack_rows`.

        Each token attends only to the tokens of its own text (a block-diagonal 4D mask) and gets its
        position within its text, so every text's hidden states are those of an unpadded forward.
        """
        import torch

        ids = feats["input_ids"]
        lengths = [len(x) for x in ids]
        rows = pack_rows(lengths, self.row_tokens)
        width = max(sum(lengths[i] for i in row) for row in rows)
        text_of = np.full((len(rows), width), -1, dtype=np.int64)  # -1: padding at the end of a row
        position = np.zeros((len(rows), width), dtype=np.int64)
        inputs = {key: np.full((len(rows), width), self.tokenizer.pad_token_id if key == "input_ids" else 0, dtype=np.int64) for key in feats if key != "attention_mask"}
        starts = np.empty(len(ids), dtype=np.int64)
        for r, row in enumerate(rows):
            pos = 0
            for i in row:
                n = lengths[i]
                for key, arr in inputs.items():
                    arr[r, pos : pos + n] = feats[key][i]
                text_of[r, pos : pos + n] = i
                position[r, pos : pos + n] = np.arange(n)
                starts[i] = r * width + pos
                pos += n
        text = torch.from_numpy(text_of).to(device)
        dtype = model.dtype
        # Additive mask (works with sdpa and eager attention): 0 within a text, -inf-like across texts.
        # Padding attends to padding, so no softmax row is empty; its outputs are never read.
        same = (text[:, :, None] == text[:, None, :]).unsqueeze(1)  # (rows, 1, width, width)
        mask = torch.zeros(same.shape, dtype=dtype, device=device).masked_fill_(~same, torch.finfo(dtype).min)
        batch = {key: torch.from_numpy(arr).to(device) for key, arr in inputs.items()}
        with torch.inference_mode():
            hidden = model(**batch, attention_mask=mask, position_ids=torch.from_numpy(position).to(device)).last_hidden_state
            flat = hidden.reshape(-1, hidden.shape[-1]).float()  # (rows * width, H)
            if self.spec.pooling == "cls":
                emb = flat[torch.from_numpy(starts).to(device)]
            else:
                text_flat = text.reshape(-1)
                real = text_flat >= 0
                emb = torch.zeros(len(ids), flat.shape[1], dtype=torch.float32, device=device).index_add_(0, text_flat[real], flat[real])
                emb = emb / torch.tensor(lengths, dtype=torch.float32, device=device).unsqueeze(1)
            if self.spec.normalize:
                emb = torch.nn.functional.normalize(emb, dim=-1)
        return emb.cpu().numpy()

    def _packing_is_exact(self) -> bool:
        """Whether this model honours packing (4D masks and position ids): packed vs padded on probe texts."""
        feats = self.tokenizer(PACKING_PROBES, truncation=True, max_length=self.spec.max_length, padding=False)
        feats = {key: list(v) for key, v in feats.items()}
        try:
            packed = self._forward_packed(self.models[0], self.devices[0], feats)
        except (TypeError, ValueError, RuntimeError) as e:  # e.g. a model without position_ids
            log.info("encoder %s: packed forward failed (%s); padding instead", self.spec.name, e)
            return False
        padded = self._forward_padded(self.models[0], self.devices[0], feats)
        worst = float(np.min(np.sum(packed * padded, axis=1) / (np.linalg.norm(packed, axis=1) * np.linalg.norm(padded, axis=1))))
        ok = worst >= (1 - 1e-5 if self.dtype == "float32" else 0.999)
        if not ok:
            log.warning("encoder %s: packed forward differs from padded (cosine %.6f); padding instead", self.spec.name, worst)
        return ok

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
