"""The index fingerprint: everything a retrieval result depends on, so a score can name its index.

Two numbers from two runs are only comparable when they searched the same passages, encoded by
the same weights in the same way and ranked by the same index. :func:`index_fingerprint` collects
exactly those settings from an index's ``meta.json`` (corpus checksum and passage limit, row count,
encoder name, a hash of its weight and tokenizer files, pooling, prefixes, max length,
normalisation, encoding dtype (and the query encoder's, when served below float32), vector dim,
FAISS index type, metric, nprobe, the IVF/PQ training sample and seed when the index type is trained,
whether BM25 is fused in at serve time) and an ``id``: the sha256 of them, so two fingerprints are equal
exactly when every setting is. What does not change a vector or a ranking (chunk size, device, progress
bars, build timings, the corpus's path) is left out. Batching is left out too, although it can move a
reduced-precision query vector in its last bits (``emapg serve --batch-invariant`` removes that).

``emapg index build`` stores the fingerprint in ``meta.json``; an index built before fingerprints
existed gets it computed when it is loaded (:func:`fingerprint_of`: ``meta.json`` already holds
the corpus checksum, so only the encoder's files are hashed; nothing is re-encoded or rewritten).
The retriever server serves it in ``GET /health`` (``fingerprint``).
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from emapg.digest import file_digest

__all__ = ["FINGERPRINT_VERSION", "index_fingerprint", "fingerprint_of", "model_files_sha256"]

FINGERPRINT_VERSION = 1
# Files of a model folder that change what it computes: weights and tokenizer (configs included).
_MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".json", ".txt", ".model")
_SKIP = {"README.md", ".gitattributes"}


@lru_cache(maxsize=16)
def _folder_digest(folder: str, stamp: tuple[tuple[str, int, int], ...]) -> str:
    """sha256 over (name, sha256) of the listed files; ``stamp`` (names, sizes, mtimes) keys the cache."""
    h = hashlib.sha256()
    for name, _, _ in stamp:
        h.update(f"{name}\0{file_digest(Path(folder) / name)}\n".encode())
    return "sha256:" + h.hexdigest()


def model_files_sha256(model_dir: str | Path) -> str:
    """One digest of a model folder's weight, config and tokenizer files (top level, sorted by name)."""
    folder = Path(model_dir)
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in _MODEL_FILE_SUFFIXES and p.name not in _SKIP)
    if not files:
        raise FileNotFoundError(f"{folder}: no model files to fingerprint")
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _folder_digest(str(folder.resolve()), stamp)


def index_fingerprint(meta: dict[str, Any], *, encoder_sha256: str, nprobe: int | None = None,
                      hybrid_bm25: bool = False, query_dtype: str | None = None) -> dict[str, Any]:
    """The fingerprint of the index described by ``meta`` (its ``meta.json``) whose encoder files hash
    to ``encoder_sha256``, searched with ``nprobe`` (default: the stored one) and optionally fused with
    BM25, its queries encoded in ``query_dtype`` (None: float32): the settings, then ``id`` = sha256 of their
    canonical JSON. A reduced-precision query encoder changes rankings (bf16: top-3 ids as fp32's for 97.8% of
    3,125 QA questions), so it is a setting; float32 queries add nothing, and fingerprints from before keep their ids."""
    enc, corpus = meta["encoder"], meta["corpus"]
    settings = {
        "version": FINGERPRINT_VERSION,
        "corpus_checksum": corpus["checksum"],
        "corpus_limit": corpus.get("limit"),
        "rows": meta["rows"],
        "encoder": enc["name"],
        "encoder_sha256": encoder_sha256,
        "pooling": enc["pooling"],
        "query_prefix": enc["query_prefix"],
        "passage_prefix": enc["passage_prefix"],
        "max_length": enc["max_length"],
        "normalize": enc["normalize"],
        "dtype": (meta.get("build") or {}).get("dtype"),
        "dim": meta["dim"],
        "index_type": meta["index_type"],
        "metric": meta["metric"],
        "nprobe": meta.get("nprobe") if nprobe is None else nprobe,
        "train": meta.get("train"),  # {"sample", "seed"} for trained (IVF/PQ) index types, else None
        "hybrid_bm25": bool(hybrid_bm25),
    }
    if meta.get("rerank_depth"):  # only when set: fingerprints of indexes without a re-rank stage keep their ids
        settings["rerank_depth"] = meta["rerank_depth"]
    if query_dtype not in (None, "float32"):  # likewise: only reduced-precision queries
        settings["query_dtype"] = query_dtype
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return {"id": digest[:16], **settings}


def fingerprint_of(index_dir: str | Path, meta: dict[str, Any] | None = None, *, nprobe: int | None = None,
                   hybrid_bm25: bool = False, query_dtype: str | None = None) -> dict[str, Any]:
    """The fingerprint of ``index_dir`` as served with ``nprobe`` / ``hybrid_bm25`` / ``query_dtype``: the one stored
    in its ``meta.json`` when those are the build's defaults (float32 queries), else (an older index, or serve-time
    overrides) computed from ``meta.json`` (the encoder's files are hashed; the corpus checksum is already there)."""
    from emapg.models import resolve_model
    from retriever.index_files import read_meta

    meta = meta if meta is not None else read_meta(index_dir)
    stored = meta.get("fingerprint")
    if isinstance(stored, dict) and not hybrid_bm25 and nprobe in (None, stored.get("nprobe")) and query_dtype in (None, "float32"):
        return stored
    encoder_sha256 = stored["encoder_sha256"] if isinstance(stored, dict) else model_files_sha256(resolve_model(meta["encoder"]["name"]))
    return index_fingerprint(meta, encoder_sha256=encoder_sha256, nprobe=nprobe, hybrid_bm25=hybrid_bm25, query_dtype=query_dtype)
