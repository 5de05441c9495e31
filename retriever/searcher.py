"""Load an index directory and answer batches of queries (encoder + FAISS [+ BM25] + doc store).

Thread-safe for CPU indexes, which FAISS searches concurrently (the server runs one worker per
core). A GPU index is not thread-safe even for searches (faiss wiki, "Threads and asynchronous
calls"): :attr:`Searcher.concurrent_batches` is 1 there and the server runs one worker.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path

import numpy as np

from retriever.corpus import DocStore
from retriever.encoder import Encoder, EncoderSpec
from retriever.index_files import BM25_DIR, EMB_DIR, INDEX_FILE, read_meta
from retriever.ondisk import DiskVectors, RerankIndex, read_index

log = logging.getLogger("retriever.searcher")


class EncoderMismatchError(ValueError):
    """The encoder asked for at serve time is not the one the index was built with."""


def same_encoder(requested: str, built_with: str) -> bool:
    """True if two encoder names denote the same model (same string or same local folder)."""
    from emapg.models import resolve_model

    if requested.strip().lower() == built_with.strip().lower():
        return True
    try:
        a, b = Path(resolve_model(requested)), Path(resolve_model(built_with))
    except (ValueError, RuntimeError):
        return False
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def check_encoder(index_dir: str | Path, requested: str | None) -> dict:
    """Read ``meta.json``; raise :class:`EncoderMismatchError` if ``requested`` differs from it."""
    meta = read_meta(index_dir)
    built = meta["encoder"]["name"]
    if requested is not None and not same_encoder(requested, built):
        raise EncoderMismatchError(
            f"the index at {index_dir} was built with encoder {built!r} "
            f"(pooling {meta['encoder']['pooling']}, dim {meta['dim']}), but --encoder {requested!r} was given; "
            "queries must be encoded by the same model as the passages: drop --encoder or rebuild the index"
        )
    return meta


def rrf_fuse(rankings: list[np.ndarray], k: int, rrf_k: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Reciprocal-rank fusion of several rankings of one query (Cormack et al. 2009).

    rankings: list of int arrays of document indices, best first (-1 = no hit).
    Returns (indices (<=k,), fused scores (<=k,)), score(d) = sum_r 1 / (rrf_k + rank_r(d)), rank from 1.
    """
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, doc in enumerate(ranking.tolist(), 1):
            if doc >= 0:
                scores[doc] = scores.get(doc, 0.0) + 1.0 / (rrf_k + rank)
    best = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
    return np.array([d for d, _ in best], dtype=np.int64), np.array([s for _, s in best], dtype=np.float32)


# FAISS's exhaustive search scans the whole database once per query while ``queries x dim`` is below
# ``faiss.cvar.distance_compute_blas_threshold`` (128,000 in FAISS 1.15: up to 333 MiniLM queries),
# and switches to one matrix product per batch above it. Scanning is memory-bound on a large flat
# index: 43,159 x 384 passages, one thread, batches of 16: 85-96 ms scanning vs 18 ms by BLAS (32
# queries: 175 vs 26 ms; 1 query: 5.4 vs 13 ms), measured. So batches of more than this many
# queries take the BLAS path.
SCAN_AT_MOST_QUERIES = 2


class Searcher:
    """Everything needed to turn query strings into ranked passages."""

    def __init__(
        self,
        index_dir: str | Path,
        *,
        device: str = "auto",
        fp16: bool | None = None,
        bf16: bool | None = None,
        gpu_shards: int = -1,
        gpu_replicate: bool = False,
        hybrid_bm25: bool = False,
        rrf_k: int = 60,
        nprobe: int | None = None,
        encode_batch_size: int = 64,
        query_cache_size: int = 0,
        encode_threads: int = 1,
        mmap: bool = False,
        batch_invariant: bool = False,
    ):
        import faiss

        self.index_dir = Path(index_dir)
        self.meta = read_meta(self.index_dir)
        self.store = DocStore(self.index_dir)
        if len(self.store) != self.meta["rows"]:
            raise ValueError(f"{index_dir}: document store has {len(self.store)} rows, meta.json says {self.meta['rows']}")
        try:  # the index before the encoder: a broken file fails in milliseconds, not after a model load
            index = read_index(self.index_dir, INDEX_FILE, mmap=mmap)
        except RuntimeError as e:
            raise ValueError(f"{self.index_dir / INDEX_FILE} is not a readable FAISS index ({str(e).strip().splitlines()[-1]}); rebuild it") from None
        if index.ntotal != self.meta["rows"]:
            raise ValueError(f"{index_dir}: FAISS index has {index.ntotal} vectors, meta.json says {self.meta['rows']}")
        self.encoder = Encoder(EncoderSpec.from_dict(self.meta["encoder"]), device=device, fp16=fp16, bf16=bf16, threads=encode_threads,
                               batch_invariant=batch_invariant)
        from retriever.fingerprint import fingerprint_of

        # Served in /health: which index (and search settings) produced a number.
        self.fingerprint = fingerprint_of(self.index_dir, self.meta, nprobe=nprobe, hybrid_bm25=hybrid_bm25,
                                          query_dtype=self.encoder.dtype)
        if self.encoder.dim != self.meta["dim"]:
            raise EncoderMismatchError(f"encoder produces {self.encoder.dim}-d vectors, the index holds {self.meta['dim']}-d")
        self.encode_batch_size = encode_batch_size
        # GRPO samples several rollouts per prompt and their first queries often coincide:
        # an LRU of query embeddings skips re-encoding them (encoding dominates the cost).
        self.query_cache_size = query_cache_size
        self._query_cache: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self.cache_hits = 0
        # seconds spent per stage of :meth:`retrieve` ("encode", "search", "lookup"), served in /metrics
        self.stage_seconds: collections.Counter[str] = collections.Counter(encode=0.0, search=0.0, lookup=0.0)
        self._lock = threading.Lock()  # guards the query cache, cache_hits, stage_seconds and BM25
        self._gpu_lock = threading.Lock()  # search_vectors on a GPU index
        self._set_search_params(index, nprobe if nprobe is not None else self.meta.get("nprobe", 16))
        if self.meta.get("rerank_depth"):  # exact re-rank from the embeddings on disk: the index stays on the CPU
            index = RerankIndex(index, DiskVectors(self.index_dir / EMB_DIR, self.meta["chunk_size"], self.meta["rows"]),
                                self.meta["rerank_depth"], self.meta["metric"])  # fmt: skip
            gpu_shards = 0
        faiss.cvar.distance_compute_blas_threshold = (SCAN_AT_MOST_QUERIES + 1) * index.d  # process-wide; a server holds one index
        self.index_device = "cpu"
        self._gpu_resources = None
        on_gpu = self.encoder.devices[0].startswith("cuda")
        if on_gpu and gpu_shards != 0 and hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
            try:
                index = self._to_gpu(index, gpu_shards, gpu_replicate, bool(self.encoder.fp16 if fp16 is None else fp16))
            except RuntimeError as e:  # e.g. HNSW has no GPU implementation: search it on the CPU
                log.warning("FAISS index %s stays on the CPU: %s", self.meta["index_type"], str(e).strip().splitlines()[-1])
                self.index_device = "cpu"
        self.index = index
        # batches that may run at once: one per CPU forward thread; a GPU index takes one caller at a time
        self.concurrent_batches = self.encoder.parallel if self.index_device == "cpu" and not on_gpu else 1
        self.rrf_k = rrf_k
        self.bm25 = None
        if hybrid_bm25:
            if not self.meta.get("bm25"):
                raise ValueError(f"--hybrid-bm25 needs a BM25 index: rebuild {index_dir} with `emapg index build --bm25`")
            import bm25s

            self.bm25 = bm25s.BM25.load(str(self.index_dir / BM25_DIR))

    @staticmethod
    def _set_search_params(index, nprobe: int) -> None:
        import faiss

        ivf = faiss.try_extract_index_ivf(index)
        if ivf is not None:
            ivf.nprobe = min(nprobe, ivf.nlist)
        hnsw = getattr(faiss.downcast_index(index), "hnsw", None)
        if hnsw is not None:
            hnsw.efSearch = max(hnsw.efSearch, 64)

    def _to_gpu(self, index, shards: int, replicate: bool, fp16: bool):
        """One GPU, or shard (default) / replicate over ``shards`` GPUs (-1: all)."""
        import faiss

        ngpu = faiss.get_num_gpus()
        n = ngpu if shards < 0 else min(shards, ngpu)
        if n == 1:
            self._gpu_resources = faiss.StandardGpuResources()
            co = faiss.GpuClonerOptions()
            co.useFloat16 = fp16
            self.index_device = "cuda:0"
            return faiss.index_cpu_to_gpu(self._gpu_resources, 0, index, co)
        co = faiss.GpuMultipleClonerOptions()
        co.useFloat16 = fp16
        co.shard = not replicate
        self.index_device = f"{n} GPUs ({'replicated' if replicate else 'sharded'})"
        return faiss.index_cpu_to_all_gpus(index, co=co, ngpu=n)

    def search(self, queries: list[str], topk: int, parts: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """queries (B,) -> (indices (B, k), scores (B, k)); -1 marks a missing hit. ``parts``: see :meth:`Encoder.encode`."""
        k = min(topk, len(self.store))
        t0 = time.perf_counter()
        q = self._encode(queries, parts)
        t1 = time.perf_counter()
        if self.bm25 is None:
            scores, idx = self._index_search(q, k)
            idx = idx.astype(np.int64)
        else:
            with self._lock:
                idx, scores = self._hybrid(queries, q, k)
        t2 = time.perf_counter()
        with self._lock:
            self.stage_seconds["encode"] += t1 - t0
            self.stage_seconds["search"] += t2 - t1
        return idx, scores

    def _encode(self, queries: list[str], parts: int | None = None) -> np.ndarray:
        """queries (B,) -> (B, dim), encoding each distinct uncached query once."""
        if not self.query_cache_size:
            return self.encoder.encode_queries(queries, batch_size=self.encode_batch_size, parts=parts)
        cache = self._query_cache
        with self._lock:
            found = {q: cache[q] for q in dict.fromkeys(queries) if q in cache}
            todo = [q for q in dict.fromkeys(queries) if q not in found]
            self.cache_hits += len(queries) - len(todo)  # repeats inside the batch are encoded once, too
        if todo:
            found.update(zip(todo, self.encoder.encode_queries(todo, batch_size=self.encode_batch_size, parts=parts)))
        with self._lock:
            for text in queries:
                cache[text] = found[text]
                cache.move_to_end(text)
            while len(cache) > self.query_cache_size:
                cache.popitem(last=False)
        return np.stack([found[q] for q in queries])

    def _index_search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """FAISS search of ``q`` [B, dim] float32 -> (scores [B, k], ids [B, k]). With ``batch_invariant`` each query
        is searched alone: FAISS scans for a few queries and multiplies matrices for more (``SCAN_AT_MOST_QUERIES``),
        and the two round scores differently (~1e-7), which can reorder near-tied passages."""
        if self.encoder.batch_invariant and len(q) > 1:
            parts = [self._index_search(q[i : i + 1], k) for i in range(len(q))]
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        if self.index_device == "cpu":
            return self.index.search(q, k)
        with self._gpu_lock:  # a GPU index takes one caller at a time
            return self.index.search(q, k)

    def _hybrid(self, queries: list[str], q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import bm25s

        depth = min(len(self.store), max(4 * k, 20))  # fuse deeper lists than we return
        _, dense = self._index_search(q, depth)
        sparse, sparse_scores = self.bm25.retrieve(bm25s.tokenize(queries, stopwords="en", show_progress=False), k=depth, show_progress=False)
        sparse = np.where(np.asarray(sparse_scores) > 0, np.asarray(sparse, dtype=np.int64), -1)  # no shared term: no vote
        idx = np.full((len(queries), k), -1, dtype=np.int64)
        scores = np.zeros((len(queries), k), dtype=np.float32)
        for b in range(len(queries)):
            i, s = rrf_fuse([dense[b], sparse[b]], k, self.rrf_k)
            idx[b, : len(i)], scores[b, : len(s)] = i, s
        return idx, scores

    def retrieve(self, queries: list[str], topk: int, encoder_share: float = 1.0) -> list[list[dict]]:
        """queries (B,) -> per query a list of ``{"id", "contents", "score"}``, best first.

        ``encoder_share``: the fraction of the CPU encoder's threads this batch's forward is split
        over (at least one; concurrent callers share the threads).
        """
        parts = max(1, round(encoder_share * self.encoder.parallel))
        idx, scores = self.search(queries, topk, parts)
        return self._hits(idx, scores)

    def search_vectors(self, q: np.ndarray, topk: int) -> list[list[dict]]:
        """Encoded queries ``[B, dim]`` (e.g. from :mod:`retriever.router`) -> hits as :meth:`retrieve` returns them.
        No encoder, no BM25: the dense index only."""
        idx, scores = self.search_rows(q, topk)
        return self._hits(idx, scores)

    def search_rows(self, q: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
        """Encoded queries ``[B, dim]`` -> (rows int64 [B, k], scores float32 [B, k]) of the dense index, no passages
        looked up (the router's ``--docs`` reads them itself); -1 marks a missing hit."""
        k = min(topk, len(self.store))
        t0 = time.perf_counter()
        scores, idx = self._index_search(np.ascontiguousarray(q, dtype=np.float32), k)
        with self._lock:
            self.stage_seconds["search"] += time.perf_counter() - t0
        return idx.astype(np.int64), scores

    def _hits(self, idx: np.ndarray, scores: np.ndarray) -> list[list[dict]]:
        t0 = time.perf_counter()
        valid = idx >= 0
        docs = iter(self.store.lookup(idx[valid]))  # one vectorised gather for the whole batch
        out = []
        for b in range(idx.shape[0]):
            hits = []
            for j in range(idx.shape[1]):
                if valid[b, j]:
                    d = next(docs)
                    d["score"] = float(scores[b, j])
                    hits.append(d)
            out.append(hits)
        t1 = time.perf_counter()
        with self._lock:
            self.stage_seconds["lookup"] += t1 - t0
        return out

    def info(self) -> dict:
        m = self.meta
        return {
            "rows": m["rows"],
            "dim": m["dim"],
            "index_type": m["index_type"],
            "metric": m["metric"],
            "encoder": m["encoder"]["name"],
            "pooling": m["encoder"]["pooling"],
            "corpus_checksum": m["corpus"]["checksum"],
            "encoder_device": self.encoder.devices[0] if len(self.encoder.devices) == 1 else ",".join(self.encoder.devices),
            "index_device": self.index_device,
            "dtype": self.encoder.dtype,
            "encoder_packed_rows": self.encoder.packed,
            "encoder_traced": self.encoder.traced,
            "encoder_parallel_forwards": self.encoder.parallel,
            "batch_invariant": self.encoder.batch_invariant,
            "concurrent_batches": self.concurrent_batches,
            "hybrid_bm25": self.bm25 is not None,
            "query_cache_size": self.query_cache_size,
            "shard": m.get("shard"),  # emapg index shard: which rows of which index (the router checks)
            "rerank_depth": m.get("rerank_depth"),
        }
