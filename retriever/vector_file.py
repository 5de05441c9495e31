"""Passage vectors in one portable file, quantized to 8 bits per dimension.

An index build spends nearly all its time encoding passages (the bundled 43k-passage corpus: ~7.6 min
on 2 CPU cores). A vector file stores the result once, so a build on another machine skips the encoder
(:class:`retriever.index_builder.BuildConfig` ``vectors``) and every machine serves the same vectors.

Format: a ``.npz`` read with ``allow_pickle=False`` (never pickle) holding

* ``codes``   uint8 ``[N, D]`` -- ``round((x - vmin) / vdiff * 255)`` per dimension;
* ``vmin``, ``vdiff`` float32 ``[D]`` -- the per-dimension minimum and range of the fp32 vectors;
* ``meta``    the JSON record below, as uint8 bytes.

Decoding is ``vmin + codes / 255 * vdiff`` (each component within ``vdiff / 510`` of the original),
then each row is rescaled to unit length when the source vectors were normalised. This is uniform scalar
quantization as in FAISS's ``SQ8``; on the bundled corpus and 700 held-out questions of the seven QA
sets the decoded vectors return the same top-1 passage for 99.4% of the questions and 99.7% of the
top-3 passages (``scripts/build_bundled_vectors.py`` measures and records this).

``meta``: ``corpus`` (``checksum``, ``rows``), ``encoder`` (the :class:`retriever.encoder.EncoderSpec`
dict) and ``encoder_weights_sha256`` (content hash of the encoder's weight files: the query encoder
must be the one that encoded the passages), ``normalized``, ``source_dtype``, and free-form provenance.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from emapg.digest import update_with_file

FORMAT = "emapg-vectors-uint8/1"
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def quantize_uint8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x`` float ``[N, D]`` -> (codes uint8 ``[N, D]``, vmin float32 ``[D]``, vdiff float32 ``[D]``)."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or len(x) == 0:
        raise ValueError(f"expected a non-empty [N, D] array, got shape {x.shape}")
    vmin = x.min(axis=0)
    vdiff = x.max(axis=0) - vmin
    scale = np.where(vdiff > 0, 255.0 / np.where(vdiff > 0, vdiff, 1.0), 0.0).astype(np.float32)
    codes = np.clip(np.rint((x - vmin) * scale), 0, 255).astype(np.uint8)
    return codes, vmin.astype(np.float32), vdiff.astype(np.float32)


def dequantize_uint8(codes: np.ndarray, vmin: np.ndarray, vdiff: np.ndarray, *, normalize: bool) -> np.ndarray:
    """The float32 ``[N, D]`` vectors ``codes`` stand for (rows rescaled to unit length if ``normalize``)."""
    x = vmin + codes.astype(np.float32) * (vdiff / np.float32(255.0))
    if normalize:
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        x /= np.where(norms > 0, norms, 1.0)
    return np.ascontiguousarray(x, dtype=np.float32)


def encoder_weights_sha256(model_dir: str | Path) -> str:
    """Content hash of a model folder's weight files (top level, by name): the same on every machine
    that has the same weights, unlike :func:`retriever.fingerprint.model_files_sha256` (a stamp)."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"{model_dir}: no weight files (.safetensors/.bin) to hash")
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0")
        update_with_file(h, p)
    return "sha256:" + h.hexdigest()


@dataclass(frozen=True)
class VectorFile:
    """A read vector file: ``meta`` plus the quantized rows."""

    path: Path
    meta: dict[str, Any]
    codes: np.ndarray
    vmin: np.ndarray
    vdiff: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.codes.shape[0])

    @property
    def dim(self) -> int:
        return int(self.codes.shape[1])

    def vectors(self, lo: int, hi: int) -> np.ndarray:
        """Decoded float32 rows ``lo:hi``."""
        return dequantize_uint8(self.codes[lo:hi], self.vmin, self.vdiff, normalize=bool(self.meta.get("normalized")))

    def mismatches(self, *, corpus_checksum: str, rows: int, encoder: dict[str, Any], weights_sha256: str | None) -> list[str]:
        """:func:`meta_mismatches` of this file."""
        return meta_mismatches(self.meta, corpus_checksum=corpus_checksum, rows=rows, encoder=encoder,
                               weights_sha256=weights_sha256)


def meta_mismatches(meta: dict[str, Any], *, corpus_checksum: str, rows: int, encoder: dict[str, Any],
                    weights_sha256: str | None) -> list[str]:
    """What makes the vector file with ``meta`` unusable for an index of the first ``rows`` passages of that
    corpus, encoded by that encoder ([] when it fits). ``weights_sha256`` None skips the weights check."""
    bad = []
    if meta["corpus"]["checksum"] != corpus_checksum:
        bad.append("corpus checksum")
    if rows > meta["rows"]:
        bad.append(f"rows ({rows} passages, the file has {meta['rows']})")
    if meta["encoder"] != encoder:
        bad.append("encoder settings")
    if weights_sha256 is not None and meta["encoder_weights_sha256"] != weights_sha256:
        bad.append("encoder weights")
    return bad


def write_vector_file(path: str | Path, vectors: np.ndarray, meta: dict[str, Any]) -> Path:
    """Quantize ``vectors`` and write them with ``meta`` (atomically: a temp file, then a rename)."""
    path = Path(path)
    for key in ("corpus", "encoder", "encoder_weights_sha256", "normalized", "source_dtype"):
        if key not in meta:
            raise ValueError(f"vector file meta needs {key!r}")
    codes, vmin, vdiff = quantize_uint8(vectors)
    record = {"format": FORMAT, **meta, "rows": int(codes.shape[0]), "dim": int(codes.shape[1])}
    buf = io.BytesIO()
    np.savez_compressed(buf, codes=codes, vmin=vmin, vdiff=vdiff,
                        meta=np.frombuffer(json.dumps(record, sort_keys=True).encode(), dtype=np.uint8))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)
    return path


def _load(path: str | Path, *arrays: str) -> tuple[dict[str, Any], list[np.ndarray]]:
    """A vector file's checked ``meta`` record and the named arrays (a readable ``ValueError`` otherwise)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            loaded = [z[name] for name in arrays]
    except (OSError, KeyError, ValueError, EOFError) as e:
        raise ValueError(f"{path} is not a readable vector file ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown vector file format {meta.get('format')!r} (expected {FORMAT})")
    return meta, loaded


def read_vector_meta(path: str | Path) -> dict[str, Any]:
    """Only the ``meta`` record of a vector file (the codes are not read)."""
    return _load(path)[0]


def read_vector_file(path: str | Path) -> VectorFile:
    """Read and check a vector file (a readable ``ValueError`` for anything else)."""
    path = Path(path)
    meta, (codes, vmin, vdiff) = _load(path, "codes", "vmin", "vdiff")
    if codes.dtype != np.uint8 or codes.ndim != 2 or vmin.shape != (codes.shape[1],) or vdiff.shape != vmin.shape:
        raise ValueError(f"{path}: inconsistent arrays (codes {codes.dtype} {codes.shape}, vmin {vmin.shape}, vdiff {vdiff.shape})")
    if meta.get("rows") != codes.shape[0] or meta.get("dim") != codes.shape[1]:
        raise ValueError(f"{path}: meta says {meta.get('rows')} x {meta.get('dim')}, arrays are {codes.shape}")
    return VectorFile(path, meta, codes, vmin.astype(np.float32), vdiff.astype(np.float32))
