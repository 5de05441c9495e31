"""Dense text encoders: transformers / sentence-transformers checkpoints, mean or CLS pooling.

Departures from Search-R1's encoder, each for a measured or documented reason:

* Query/passage prefixes (e5 ``"query: "``/``"passage: "``, bge's instruction) are explicit settings,
  recorded in the index's ``meta.json`` and read back by the server. Search-R1 infers them from a
  substring of the model name, and its builder and server disagree for names like ``e5-small``.
  A small table of known checkpoints fills them in only on an *exact* name match.
* Precision (:func:`resolve_precision`): fp16 by default on GPU only: on CPU (no fp16 arithmetic) fp16
  encoding is 3.5x slower than fp32. On a CPU with native bf16 dot products (AVX512-BF16/AMX,
  :func:`emapg.cpu.cpu_has_bf16`) bf16 is the default: 1.8x faster batches of MiniLM queries here
  (2.2x on 3,125 questions) and 1.98x the server's requests/s at 32 clients (``retriever_load.json``),
  cosine to the fp32 vectors > 0.9999, the same top-3 ids for 97.8% of those questions and gold
  recall@3 0.3488 vs 0.3485 (``benchmarks/encoder_precision.py``, ``encoder_precision.json``).
  Elsewhere bf16 is emulated (~8x slower) and fp32 is the default. ``bf16=False`` forces fp32.
* Dynamic padding with sort-by-length batching instead of padding a 512-passage batch to the
  longest passage (Search-R1's builder reached 18 passages/s on 2 cores that way), and beyond that
  texts packed into shared rows (``retriever.packing``): a batch of 32 NQ queries carries ~30% fewer
  token slots than padded to its longest; on CPU the packed forward runs as a TorchScript trace that
  holds the GIL once per forward, not once per operator. Both are checked against the padded eager
  forward when a model loads, and skipped for a model they do not reproduce.
* Several GPUs: one model replica per device, batches spread over them by threads (PyTorch
  releases the GIL inside CUDA kernels).
* On CPU, ``threads`` > 1 splits every forward batch into that many interleaved parts run at once
  by as many Python threads, each on torch's intra-op pool (one thread with ``OMP_NUM_THREADS=1``).
  The traced forward releases the GIL, so the parts run on separate cores; unlike two OpenMP
  threads in one forward, which meet at a barrier after every operator and stall whenever another
  process takes one of the cores (a batch of 16 queries: 1.3 s instead of 0.11 s with one thread,
  measured while other jobs loaded the 2 cores), the parts meet once per forward.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from emapg.cpu import cpu_has_bf16

if TYPE_CHECKING:
    from retriever.packing import Forward

Pooling = Literal["mean", "cls"]

log = logging.getLogger("retriever.encoder")

# Tokens per packed row (retriever.packing). A row's attention is dense (width^2) but masked to its texts,
# so wider rows waste attention work, narrower ones leave more padding at row ends. Measured on NQ
# questions (about 12 tokens), MiniLM fp32, one CPU thread, batches of 32-64: 64 is fastest (1.3-1.6x
# the padded forward), 128 and 256 lose.
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


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.min(np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))


def default_encode_threads() -> int:
    """``--encode-threads 0``: as many concurrent CPU forwards as fit the cores at torch's intra-op thread count."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, torch.get_num_threads()))


def resolve_precision(on_gpu: bool, fp16: bool | None = None, bf16: bool | None = None, *,
                      native_cpu_bf16: bool | None = None) -> Literal["float16", "bfloat16", "float32"]:
    """The encoder's dtype from the ``fp16``/``bf16`` choices, ``None`` meaning automatic.

    Automatic: float16 on GPU; on CPU bfloat16 where it has native bf16 dot products
    (:func:`emapg.cpu.cpu_has_bf16`, or ``native_cpu_bf16`` when given), float32 elsewhere. ``True`` is
    honoured (fp16 on GPU only); ``bf16=False`` on CPU and ``fp16=False`` on GPU force float32.
    """
    if bf16 and fp16:
        raise ValueError("choose fp16 or bf16, not both")
    if fp16 and not on_gpu:
        raise ValueError("fp16 encoding is only supported on GPU (it is ~3.5x slower than fp32 on CPU; bf16 is the CPU option)")
    if fp16 or (fp16 is None and on_gpu and not bf16):
        return "float16"
    if bf16 is None and not on_gpu:
        bf16 = cpu_has_bf16() if native_cpu_bf16 is None else native_cpu_bf16
    return "bfloat16" if bf16 else "float32"


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
    """Encode texts to L2-normalised float32 vectors (numpy) with one replica per device.

    ``batch_invariant``: every text gets its own forward pass (a row of its own length: no padding, no other text in it), so
    its vector depends on the text alone, never on which texts were encoded with it. Batched and packed forwards
    round differently with their shapes: served over the bundled index, 420 QA questions asked alone and in one
    request changed 18 top-3 lists (9 as sets) with bf16 queries and none with fp32 (scores within 4e-7)
    (``benchmarks/retriever_batch_invariance.py``).
    """

    def __init__(
        self,
        spec: EncoderSpec,
        *,
        device: str = "auto",
        fp16: bool | None = None,
        bf16: bool | None = None,
        pack: bool = True,
        row_tokens: int = ROW_TOKENS,
        threads: int = 1,
        batch_invariant: bool = False,
    ):
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from emapg.cpu import aten_kernels_below_avx512
        from emapg.models import resolve_model
        from retriever.packing import eager_forward

        self.spec = spec
        self.devices = resolve_devices(device)
        on_gpu = self.devices[0].startswith("cuda")
        self.dtype = resolve_precision(on_gpu, fp16, bf16)
        self.fp16, self.bf16 = self.dtype == "float16", self.dtype == "bfloat16"
        hf_logging.disable_progress_bar()  # a weight-loading bar per replica clutters build/serve logs
        path = resolve_model(spec.name)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        dtype = getattr(torch, self.dtype)
        # bf16 on a CPU whose kernels are capped below AVX-512: the fused attention kernel can still take an AVX-512
        # path and stop ("pack_vnni2 ..."); the plain attention (matmul, softmax) runs there.
        load = {"attn_implementation": "eager"} if self.bf16 and not on_gpu and aten_kernels_below_avx512() else {}
        base = AutoModel.from_pretrained(path, dtype=dtype, **load).eval()
        self.models = []
        for i, dev in enumerate(self.devices):
            m = base if i == 0 else AutoModel.from_pretrained(path, dtype=dtype, **load).eval()
            self.models.append(m.to(dev))
        self.dim = int(base.config.hidden_size)
        if threads < 1:
            raise ValueError(f"encoder threads must be at least 1, got {threads}")
        # forward passes in flight at once: one per GPU replica, or ``threads`` on the one CPU model
        self.parallel = len(self.devices) if len(self.devices) > 1 else (1 if on_gpu else threads)
        self._pool = ThreadPoolExecutor(self.parallel, thread_name_prefix="encoder") if self.parallel > 1 else None
        self._tokenizer_lock = threading.Lock()
        self.batch_invariant = batch_invariant
        self.row_tokens = row_tokens
        self._packed_forwards: list[Forward] = [eager_forward(m) for m in self.models]
        # Packing texts into rows needs a model that honours 4D masks and position ids (BERT-family
        # encoders do; RoBERTa offsets its positions): checked, not assumed. Likewise the trace.
        self.traced = False
        self._untrace_lock = threading.Lock()
        self.packed = pack and self._packing_is_exact()
        self.traced = self.packed and not on_gpu and self._trace()

    def encode_queries(self, texts: list[str], batch_size: int = 64, parts: int | None = None) -> np.ndarray:
        return self.encode([self.spec.query_prefix + t for t in texts], batch_size=batch_size, parts=parts)

    def encode_passages(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        return self.encode([self.spec.passage_prefix + t for t in texts], batch_size=batch_size)

    def encode(self, texts: list[str], batch_size: int = 64, parts: int | None = None) -> np.ndarray:
        """``texts`` (N,) -> float32 array (N, dim), rows in input order; ``batch_size`` texts per forward pass.

        On CPU with ``threads`` > 1 every forward batch is split into ``parts`` (default: ``threads``)
        run at once; thread-safe: concurrent calls share the ``threads`` forwards in flight. With
        ``batch_invariant`` every text is its own forward pass (``batch_size`` and ``parts`` do not apply).
        """
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._tokenizer_lock:  # a fast tokenizer is not reentrant (it resets its truncation per call)
            enc = self.tokenizer(texts, truncation=True, max_length=self.spec.max_length, padding=False)
        ids = enc["input_ids"]
        order = np.argsort([-len(x) for x in ids], kind="stable")  # longest first: OOM shows early
        if self.batch_invariant:  # one text per forward: its vector cannot depend on the others
            batches = [order[i : i + 1] for i in range(len(order))]
        else:
            batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        split = self.parallel if parts is None else max(1, min(parts, self.parallel))  # a batch of one text stays whole
        if len(self.models) < self.parallel and split > 1:  # CPU threads: every forward batch in parts, interleaved so their lengths match
            batches = [part for b in batches for part in (b[j :: split] for j in range(split)) if len(part)]
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        forward = self._forward_packed if self.packed else self._forward_padded  # a lone text's row is its own length

        def run(job: tuple[int, np.ndarray]) -> None:
            k, rows = job
            feats = {key: [enc[key][r] for r in rows] for key in enc.keys()}
            out[rows] = forward(k % len(self.models), feats)

        jobs = list(enumerate(batches))
        if self._pool is None:
            for job in jobs:
                run(job)
        else:
            list(self._pool.map(run, jobs))
        return out

    def _forward_padded(self, replica: int, feats: dict) -> np.ndarray:
        """One forward over the texts padded to the longest (the reference the packed forward must equal)."""
        import torch

        batch = self.tokenizer.pad(feats, return_tensors="pt")
        batch = {k: v.to(self.devices[replica]) for k, v in batch.items()}
        with torch.inference_mode():
            hidden = self.models[replica](**batch).last_hidden_state
            if self.spec.pooling == "cls":
                emb = hidden[:, 0].float()
            else:
                mask = batch["attention_mask"].unsqueeze(-1).to(torch.float32)
                emb = (hidden.float() * mask).sum(1) / mask.sum(1).clamp(min=1)
            if self.spec.normalize:
                emb = torch.nn.functional.normalize(emb, dim=-1)
        return emb.cpu().numpy()

    def _forward_packed(self, replica: int, feats: dict) -> np.ndarray:
        """One forward over the texts packed into rows (:mod:`retriever.packing`)."""
        import torch

        from retriever.packing import pack_batch, pool_packed

        batch = pack_batch(feats, self.row_tokens, self.tokenizer.pad_token_id, self.models[replica].dtype, self.devices[replica])
        with torch.inference_mode():
            try:
                hidden = self._packed_forwards[replica](batch.inputs)
            except RuntimeError as e:
                if not self.traced:
                    raise
                # The trace was checked on probe texts, but the TorchScript interpreter can pick a kernel on a later
                # batch that the eager forward does not (seen: bf16 under ATEN_CPU_CAPABILITY=avx2 on an AVX-512
                # CPU stops with "pack_vnni2 is only supported when avx512 is supported"): the eager forward is exact.
                self._untrace(f"{type(e).__name__}: {str(e)[:300]}")
                hidden = self._packed_forwards[replica](batch.inputs)
            emb = pool_packed(hidden, batch, self.spec.pooling)
            if self.spec.normalize:
                emb = torch.nn.functional.normalize(emb, dim=-1)
        return emb.cpu().numpy()

    def _probe_features(self, texts: tuple[str, ...] = PACKING_PROBES) -> dict:
        feats = self.tokenizer(list(texts), truncation=True, max_length=self.spec.max_length, padding=False)
        return {key: list(v) for key, v in feats.items()}

    def _packing_is_exact(self) -> bool:
        """Whether this model honours packing (4D masks and position ids): packed vs padded on probe texts."""
        feats = self._probe_features()
        try:
            packed = self._forward_packed(0, feats)
        except (TypeError, ValueError, RuntimeError) as e:  # e.g. a model without position_ids
            log.info("encoder %s: packed forward failed (%s); padding instead", self.spec.name, e)
            return False
        worst = _min_cosine(packed, self._forward_padded(0, feats))
        ok = worst >= (1 - 1e-5 if self.dtype == "float32" else 0.999)
        if not ok:
            log.warning("encoder %s: packed forward differs from padded (cosine %.6f); padding instead", self.spec.name, worst)
        return ok

    def _trace(self) -> bool:
        """Replace each CPU replica's eager packed forward by a trace, if the trace reproduces it on a
        batch of another shape than the one traced."""
        from retriever.packing import eager_forward, pack_batch, traced_forward

        eager = self._forward_packed(0, self._probe_features())
        example = pack_batch(self._probe_features(PACKING_PROBES[:2]), self.row_tokens, self.tokenizer.pad_token_id, self.models[0].dtype, self.devices[0])
        try:
            self._packed_forwards = [traced_forward(m, example) for m in self.models]
            worst = _min_cosine(self._forward_packed(0, self._probe_features()), eager)
        except Exception as e:  # noqa: BLE001 - any tracing failure: the eager forward is the safe fallback
            worst, reason = -1.0, f"{type(e).__name__}: {str(e)[:300]}"
        else:
            reason = f"cosine {worst:.6f} to the eager forward"
        if worst < 1 - 1e-6:
            log.warning("encoder %s: the traced forward is not exact (%s); running it eagerly", self.spec.name, reason)
            self._packed_forwards = [eager_forward(m) for m in self.models]
            return False
        return True

    def _untrace(self, reason: str) -> None:
        """Run every replica eagerly from now on (a traced forward failed on a real batch)."""
        from retriever.packing import eager_forward

        with self._untrace_lock:  # replicas' threads may fail at once: switch once
            if not self.traced:
                return
            log.warning("encoder %s: the traced forward failed (%s); running it eagerly from now on", self.spec.name, reason)
            self._packed_forwards = [eager_forward(m) for m in self.models]
            self.traced = False

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
