"""Build a dense FAISS index (and optionally BM25) over a passage corpus, resumably.

Layout of an index directory::

    meta.json            written last: its presence means the index is complete
    docs.bin, *.npy      memory-mapped document store (retriever.corpus)
    emb/chunk_00000.npy  passage embeddings, one file per ``chunk_size`` rows
    emb/progress.json    build settings + finished chunks (the resume point)
    index.faiss          the FAISS index (any ``index_factory`` string)
    (meta.json also holds the index fingerprint, :mod:`retriever.fingerprint`; names and readers: :mod:`retriever.index_files`)
    bm25/                bm25s index (with ``--bm25``; built in memory from all passages)

Corpus problems (see :mod:`retriever.corpus`): a line that is not UTF-8 / JSON / a passage, a truncated
``.gz``, or a **duplicate id** stops the build with an error naming the file and line, before the
document store is complete (so nothing half-checked is reused; a rerun after fixing the corpus starts
over by itself while no chunk is encoded yet). **Empty passages** are skipped; their count is in
``meta.json`` (``corpus.empty_skipped``), the build log and the command's summary.

Resuming: a rerun with the same corpus and encoder settings skips the document store if complete
and every chunk listed in ``progress.json`` whose file is present, so a build killed at 80% only
encodes the last 20%. Chunk files are written to a temporary name and renamed (atomic on POSIX),
and ``progress.json`` is updated after the rename, so a kill at any instant leaves either a whole
chunk or none. A rerun with different settings refuses to mix embeddings and asks for ``--overwrite``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from emapg.atomic import save_npy_atomic, write_text_atomic
from emapg.config import option

from retriever.corpus import CorpusReader, DocStore, docstore_complete, file_checksum, write_docstore
from retriever.encoder import Encoder, EncoderSpec, make_spec, resolve_devices, resolve_precision
from retriever.fingerprint import model_files_sha256, index_fingerprint
from retriever.index_files import (
    BM25_DIR, EMB_DIR, FORMAT_VERSION, INDEX_FILE, META_FILE, PROGRESS_FILE, faiss_metric, progress_bar, read_meta,
)
from retriever.vector_file import VectorFile, encoder_weights_sha256, read_vector_file



@dataclass
class BuildConfig:
    """Options of ``emapg index build`` (the command-line flags are generated from these fields)."""

    corpus: str = option(help="corpus file: jsonl or jsonl.gz with {'id', 'contents': '\"Title\"\\ntext'} rows (or 'title' + 'text')")
    out: str = option(help="index directory to create (or to resume)")
    encoder: str = option("minilm", help="encoder model: alias (minilm), local folder or hub name")
    pooling: Literal["mean", "cls"] | None = option(None, help="pooling over token states (default: from the known-model table or "
                                                                "the sentence-transformers config, else mean)")  # fmt: skip
    query_prefix: str | None = option(None, help="text prepended to every query, e.g. 'query: ' for e5 (default: exact-name table, "
                                                 "else none); stored in meta.json")  # fmt: skip
    passage_prefix: str | None = option(None, help="text prepended to every passage, e.g. 'passage: ' for e5 (default: exact-name "
                                                   "table, else none); stored in meta.json")  # fmt: skip
    max_length: int = option(256, help="max tokens per passage/query")
    index_type: str = option("Flat", help="any faiss index_factory string: Flat, HNSW32, IVF256,SQ8, IVF256,PQ16, ...")
    metric: Literal["ip", "l2"] = option("ip", help="inner product (cosine on normalised vectors) or L2")
    bm25: bool = option(False, help="also build a BM25 index (bm25s) for --hybrid-bm25 serving")
    chunk_size: int = option(8192, help="passages per embedding chunk file = resume granularity")
    batch_size: int = option(64, help="passages per encoder forward pass")
    device: str = option("auto", help="auto, cpu, cuda (all GPUs) or cuda:N")
    fp16: bool | None = option(None, help="fp16 encoding (default: on for GPU, off for CPU, where it is 3.5x slower)")
    bf16: bool | None = option(None, help="bf16 encoding (default: on for a CPU with bf16 instructions, AVX512-BF16/AMX: about "
                                          "1.8x faster; fp32 on other CPUs, where bf16 is emulated; --no-bf16: fp32); "
                                          "meta.json's build.dtype says which ran")  # fmt: skip
    train_sample: int = option(100_000, help="vectors sampled (seeded) to train IVF/PQ index types")
    nprobe: int = option(16, help="IVF lists probed per query at serve time, stored in meta.json")
    seed: int = option(0, help="seed of the training sample")
    limit: int | None = option(None, help="index only the first N passages (for quick tries)")
    vectors: str | None = option(None, help="a passage vector file (retriever.vector_file, e.g. the bundled corpus's "
                                            "data/corpus/wiki_mini.minilm-uint8.npz) used instead of encoding; its corpus "
                                            "checksum, encoder settings and encoder weights must match")  # fmt: skip
    emb_dtype: Literal["float32", "float16"] = option("float32", help="dtype of the embedding chunk files kept on disk (emb/): "
                                                                      "float16 halves their size and the exact re-rank's reads")  # fmt: skip
    ondisk: bool = option(False, help="build in blocks within --max-build-ram-mb (resumable block by block) and, for IVF types, "
                                      "keep the inverted lists on disk (index.ivfdata, memory-mapped and shared by every server "
                                      "process); see retriever.ondisk")  # fmt: skip
    max_build_ram_mb: int = option(2048, help="--ondisk: RAM for the training sample and one block of added vectors, in MiB "
                                              "(flat-code types also hold the final index); the peak is stored in meta.json")  # fmt: skip
    rerank_depth: int = option(0, help="re-rank this many first-stage candidates exactly against the embeddings on disk "
                                       "(emb/, memory-mapped) at serve time, stored in meta.json; 0 disables")  # fmt: skip
    overwrite: bool = option(False, help="delete an existing (finished or partial) index at --out first")
    progress: bool = option(True, help="show a progress bar (--no-progress: none)")


@dataclass
class BuildResult:
    out: Path
    rows: int
    chunks_total: int
    chunks_encoded: int
    chunks_reused: int
    encode_seconds: float
    passages_per_s: float
    total_seconds: float
    empty_skipped: int | None = None  # empty passages left out (None: a resumed build from before this was counted)


def _faiss_message(e: Exception) -> str:
    """The useful last part of a FAISS C++ exception ("Error in <signature> at file:line: <what>")."""
    lines = str(e).strip().splitlines()
    last = lines[-1] if lines else str(e)
    m = re.search(r" at \S+:\d+: (.*)$", last)
    return m.group(1) if m else last


def _validate_factory(index_type: str, dim: int, metric: str) -> None:
    import faiss

    try:
        faiss.index_factory(dim, index_type, faiss_metric(metric))
    except RuntimeError as e:
        raise ValueError(f"--index-type {index_type!r} is not a valid faiss index_factory string ({_faiss_message(e)})") from None


def _encoder_dim(spec: EncoderSpec) -> int:
    from transformers import AutoConfig

    from emapg.models import resolve_model

    return int(AutoConfig.from_pretrained(resolve_model(spec.name)).hidden_size)


def _check_ivf_size(cfg: BuildConfig, dim: int, rows: int) -> None:
    """Reject an IVF with more lists than training vectors before hours of encoding, not after."""
    import faiss

    ivf = faiss.try_extract_index_ivf(faiss.index_factory(dim, cfg.index_type, faiss_metric(cfg.metric)))
    n_train = min(rows, cfg.train_sample)
    if ivf is not None and ivf.nlist > n_train:
        raise ValueError(
            f"training {cfg.index_type} failed: {ivf.nlist} IVF lists need at least {ivf.nlist} training vectors, "
            f"but only {n_train} are available (use fewer IVF lists, a larger corpus or a larger --train-sample)"
        )


def _chunk_path(emb_dir: Path, i: int) -> Path:
    return emb_dir / f"chunk_{i:05d}.npy"


def _settings_fingerprint(cfg: BuildConfig, spec: EncoderSpec, checksum: str, vectors_sha256: str | None) -> dict:
    """What the saved embeddings depend on; a resume is allowed only if this is unchanged."""
    fp = {
        "corpus_checksum": checksum,
        "limit": cfg.limit,
        "encoder": spec.to_dict(),
        "chunk_size": cfg.chunk_size,
        "fp16": cfg.fp16,
        # automatic bf16 as resolved on this machine: a build resumed elsewhere does not mix bf16 and fp32 chunks
        "bf16": cfg.bf16 if cfg.bf16 is not None else resolve_precision(resolve_devices(cfg.device)[0].startswith("cuda"), cfg.fp16) == "bfloat16",
    }
    if vectors_sha256 is not None:  # chunks decoded from a vector file never mix with encoded ones
        fp["vectors"] = vectors_sha256
    if cfg.emb_dtype != "float32":  # absent for float32: partial builds from before the option still resume
        fp["emb_dtype"] = cfg.emb_dtype
    return fp


def _open_vectors(cfg: BuildConfig, spec: EncoderSpec, checksum: str) -> VectorFile | None:
    """``cfg.vectors`` read and checked against the corpus file and the encoder (rows are checked once the
    document store is written)."""
    if cfg.vectors is None:
        return None
    from emapg.models import resolve_model

    vf = read_vector_file(cfg.vectors)
    bad = vf.mismatches(corpus_checksum=checksum, rows=0, encoder=spec.to_dict(),
                        weights_sha256=encoder_weights_sha256(resolve_model(spec.name)))
    if bad:
        raise ValueError(f"--vectors {cfg.vectors} was not made for this corpus and encoder ({', '.join(bad)} differ)")
    return vf


def _load_progress(emb_dir: Path) -> dict | None:
    path = emb_dir / PROGRESS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def build_index(cfg: BuildConfig, log=print) -> BuildResult:
    """Build (or resume building) the index described by ``cfg``."""
    t_start = time.perf_counter()
    out = Path(cfg.out)
    corpus = Path(cfg.corpus)
    if not corpus.is_file():
        raise FileNotFoundError(f"corpus file not found: {corpus}")
    if cfg.chunk_size < 1 or cfg.batch_size < 1:
        raise ValueError("--chunk-size and --batch-size must be positive")
    if cfg.rerank_depth < 0 or cfg.max_build_ram_mb < 64:
        raise ValueError("--rerank-depth must be >= 0 and --max-build-ram-mb at least 64")
    spec = make_spec(
        cfg.encoder, pooling=cfg.pooling, query_prefix=cfg.query_prefix, passage_prefix=cfg.passage_prefix, max_length=cfg.max_length
    )
    model_dim = _encoder_dim(spec)
    _validate_factory(cfg.index_type, model_dim, cfg.metric)  # fail before touching --out
    checksum = file_checksum(corpus)
    vectors = _open_vectors(cfg, spec, checksum)
    vectors_sha256 = file_checksum(vectors.path) if vectors is not None else None
    if out.exists() and cfg.overwrite:
        shutil.rmtree(out)
    if (out / META_FILE).is_file():
        raise FileExistsError(f"{out} already holds a finished index; pass --overwrite to rebuild it")
    out.mkdir(parents=True, exist_ok=True)
    emb_dir = out / EMB_DIR
    emb_dir.mkdir(exist_ok=True)

    fingerprint = _settings_fingerprint(cfg, spec, checksum, vectors_sha256)
    progress = _load_progress(emb_dir)
    if progress is not None and progress["settings"] != fingerprint and not progress["done"] and not docstore_complete(out):
        progress = None  # nothing encoded yet (e.g. the corpus was rejected, then fixed): nothing to lose by starting over
    if progress is not None and progress["settings"] != fingerprint:
        raise FileExistsError(
            f"{out} holds a partial build with different settings or another corpus; "
            "pass --overwrite to start over (or use the original options to resume)"
        )
    if progress is None:
        progress = {"settings": fingerprint, "done": []}
        write_text_atomic(emb_dir / PROGRESS_FILE, json.dumps(progress, indent=1))

    # 1. Document store (streamed; skipped when a previous run completed it).
    if not docstore_complete(out):
        log(f"writing document store from {corpus} ...")
        reader = CorpusReader(corpus, limit=cfg.limit)
        # A CorpusError (bad line, duplicate id at the end) escapes before the store is marked complete.
        rows = write_docstore(iter(reader), out)
        progress["corpus"] = {"empty_skipped": reader.empty_skipped, "empty_examples": reader.empty_examples}
        write_text_atomic(emb_dir / PROGRESS_FILE, json.dumps(progress, indent=1))
        if reader.empty_skipped:
            log(f"skipped {reader.empty_skipped} empty passages (first: {', '.join(reader.empty_examples)})")
    else:
        rows = len(DocStore(out))
    empty_skipped = progress.get("corpus", {}).get("empty_skipped")
    if rows == 0:
        raise ValueError(f"corpus {corpus} has no passages" + (f" ({empty_skipped} empty ones skipped)" if empty_skipped else ""))
    store = DocStore(out)
    _check_ivf_size(cfg, model_dim, rows)
    if vectors is not None and rows > vectors.rows:
        raise ValueError(f"--vectors {cfg.vectors} holds {vectors.rows} rows, the corpus has {rows} passages")

    # 2. Encode chunk by chunk; every finished chunk is a resume point.
    n_chunks = (rows + cfg.chunk_size - 1) // cfg.chunk_size
    done = {i for i in progress["done"] if _chunk_path(emb_dir, i).is_file()}
    todo = [i for i in range(n_chunks) if i not in done]
    if done:
        log(f"resuming: {len(done)}/{n_chunks} chunks already encoded, {len(todo)} to go")
    encoder = None
    t_enc = time.perf_counter()
    encoded_rows = 0
    if todo:
        # the chunk's vectors: decoded from the vector file, or encoded here
        if vectors is not None:
            log(f"decoding {rows} passage vectors from {vectors.path} (no encoding)")
            progress["dtype"] = f"uint8 vectors from {vectors.meta['source_dtype']}"
            embed = vectors.vectors
        else:
            encoder = Encoder(spec, device=cfg.device, fp16=cfg.fp16, bf16=cfg.bf16)
            progress["dtype"] = encoder.dtype  # the fingerprint's dtype when a later rerun encodes nothing

            def embed(lo: int, hi: int) -> np.ndarray:
                return encoder.encode_passages(store.contents(np.arange(lo, hi)), batch_size=cfg.batch_size)

        bar = progress_bar(total=rows, initial=sum(min(cfg.chunk_size, rows - i * cfg.chunk_size) for i in done), enabled=cfg.progress,
                            desc="encoding" if encoder is not None else "decoding")
        try:
            for i in todo:
                lo, hi = i * cfg.chunk_size, min(rows, (i + 1) * cfg.chunk_size)
                save_npy_atomic(_chunk_path(emb_dir, i), embed(lo, hi).astype(cfg.emb_dtype))
                progress["done"] = sorted(done | {i})
                done.add(i)
                write_text_atomic(emb_dir / PROGRESS_FILE, json.dumps(progress, indent=1))
                if encoder is not None:
                    encoded_rows += hi - lo
                bar.update(hi - lo)
        finally:
            bar.close()
            if encoder is not None:
                encoder.close()
    enc_seconds = time.perf_counter() - t_enc
    dim = int(np.load(_chunk_path(emb_dir, 0), mmap_mode="r").shape[1])

    # 3. FAISS index: train IVF/PQ types on a seeded sample, then add chunk by chunk.
    import faiss

    ondisk_stats = None
    if cfg.ondisk:  # in blocks, bounded RAM, resumable; writes index.faiss (+ index.ivfdata) itself
        from retriever.ondisk import DiskVectors, build_ondisk

        _validate_factory(cfg.index_type, dim, cfg.metric)
        ondisk_stats = build_ondisk(DiskVectors(emb_dir, cfg.chunk_size, rows), out, index_type=cfg.index_type, metric=cfg.metric,
                                    train_sample=cfg.train_sample, seed=cfg.seed, max_build_ram_mb=cfg.max_build_ram_mb,
                                    log=log, progress=cfg.progress).to_dict()  # fmt: skip
    else:
        index = _build_faiss(cfg, emb_dir, n_chunks, rows, dim, log)
        tmp_index = out / (INDEX_FILE + ".tmp")
        faiss.write_index(index, str(tmp_index))
        os.replace(tmp_index, out / INDEX_FILE)
        del index

    # 4. Optional BM25.
    if cfg.bm25:
        _build_bm25(store, out / BM25_DIR, log)

    total = time.perf_counter() - t_start
    pps = encoded_rows / enc_seconds if encoded_rows else 0.0
    trained = not faiss.index_factory(dim, cfg.index_type, faiss_metric(cfg.metric)).is_trained
    meta = {
        "format_version": FORMAT_VERSION,
        "encoder": spec.to_dict(),
        "dim": dim,
        "metric": cfg.metric,
        "index_type": cfg.index_type,
        "nprobe": cfg.nprobe,
        "rows": rows,
        "corpus": {"path": str(corpus.resolve()), "checksum": checksum, "rows": rows, "limit": cfg.limit,
                   "empty_skipped": empty_skipped},
        "bm25": bool(cfg.bm25),
        "vectors": {"file": str(vectors.path.resolve()), "checksum": vectors_sha256, "source_dtype": vectors.meta["source_dtype"]}
        if vectors is not None else None,
        "chunk_size": cfg.chunk_size,
        "emb_dtype": cfg.emb_dtype,
        "rerank_depth": cfg.rerank_depth or None,
        "ondisk": ondisk_stats,
        "train": {"sample": cfg.train_sample, "seed": cfg.seed} if trained else None,
        "build": {
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "encode_seconds": round(enc_seconds, 3),
            "passages_per_s": round(pps, 2),
            "total_seconds": round(total, 3),
            "dtype": encoder.dtype if encoder is not None else progress.get("dtype"),
        },
    }
    from emapg.models import resolve_model

    meta["fingerprint"] = index_fingerprint(meta, encoder_sha256=model_files_sha256(resolve_model(spec.name)))
    write_text_atomic(out / META_FILE, json.dumps(meta, indent=2))
    log(f"index ready: {out} ({rows} passages, dim {dim}, {cfg.index_type}, {cfg.metric})")
    return BuildResult(out, rows, n_chunks, len(todo), n_chunks - len(todo), enc_seconds, pps, total, empty_skipped)


def ensure_index(cfg: BuildConfig, log=print) -> Path:
    """The finished index at ``cfg.out`` if it matches ``cfg`` (corpus, encoder, index type); else build
    or resume it. A finished index built differently is an error, never silently replaced."""
    out = Path(cfg.out)
    if (out / META_FILE).is_file() and not cfg.overwrite:
        meta = read_meta(out)
        spec = make_spec(cfg.encoder, pooling=cfg.pooling, query_prefix=cfg.query_prefix, passage_prefix=cfg.passage_prefix, max_length=cfg.max_length)
        wanted = {"checksum": file_checksum(cfg.corpus), "limit": cfg.limit, "encoder": spec.to_dict(), "index_type": cfg.index_type, "metric": cfg.metric}
        found = {"checksum": meta["corpus"]["checksum"], "limit": meta["corpus"].get("limit"), "encoder": meta["encoder"], "index_type": meta["index_type"], "metric": meta["metric"]}
        if wanted != found:
            diff = sorted(k for k in wanted if wanted[k] != found[k])
            raise FileExistsError(f"{out} holds an index built with other settings ({', '.join(diff)}); choose another directory or overwrite it")
        if cfg.bm25 and not meta.get("bm25"):
            raise FileExistsError(f"{out} holds an index without BM25; rebuild it with --bm25")
        return out
    build_index(cfg, log=log)
    return out


def _iter_chunks(emb_dir: Path, n_chunks: int):
    for i in range(n_chunks):
        yield np.load(_chunk_path(emb_dir, i), mmap_mode="r")


def _build_faiss(cfg: BuildConfig, emb_dir: Path, n_chunks: int, rows: int, dim: int, log):
    import faiss

    _validate_factory(cfg.index_type, dim, cfg.metric)
    index = faiss.index_factory(dim, cfg.index_type, faiss_metric(cfg.metric))
    if not index.is_trained:
        n_train = min(rows, cfg.train_sample)
        rng = np.random.default_rng(cfg.seed)
        pick = np.sort(rng.choice(rows, size=n_train, replace=False))
        sample = np.empty((n_train, dim), dtype=np.float32)
        for i, chunk in enumerate(_iter_chunks(emb_dir, n_chunks)):
            lo = i * cfg.chunk_size
            sel = pick[(pick >= lo) & (pick < lo + len(chunk))]
            sample[np.searchsorted(pick, sel)] = chunk[sel - lo]
        log(f"training {cfg.index_type} on {n_train} sampled vectors (seed {cfg.seed}) ...")
        try:
            index.train(sample)
        except RuntimeError as e:
            raise ValueError(
                f"training {cfg.index_type} failed on {n_train} vectors: {_faiss_message(e)} "
                "(use fewer IVF lists or a larger corpus / --train-sample)"
            ) from None
    for chunk in _iter_chunks(emb_dir, n_chunks):
        index.add(np.ascontiguousarray(chunk, dtype=np.float32))
    return index


def _build_bm25(store: DocStore, out_dir: Path, log) -> None:
    import bm25s

    log("building BM25 (bm25s) ...")
    texts = store.contents(np.arange(len(store)))
    tokens = bm25s.tokenize(texts, stopwords="en", show_progress=False)
    retriever = bm25s.BM25()
    retriever.index(tokens, show_progress=False)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    retriever.save(str(tmp))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def index_info(index_dir: str | Path) -> dict:
    """``meta.json`` plus the sizes of the files (bytes), for ``emapg index info``."""
    d = Path(index_dir)
    meta = read_meta(d)
    sizes = {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file()}
    emb = d / EMB_DIR
    if emb.is_dir():
        sizes[EMB_DIR + "/"] = sum(p.stat().st_size for p in emb.iterdir() if p.is_file())
    bm = d / BM25_DIR
    if bm.is_dir():
        sizes[BM25_DIR + "/"] = sum(p.stat().st_size for p in bm.iterdir() if p.is_file())
    return {**meta, "files": sizes, "path": str(d.resolve())}
