"""Indexes larger than RAM: vectors on disk, inverted lists on disk, bounded-memory resumable builds.

Three pieces, used by ``emapg index build --ondisk`` (:func:`retriever.index_builder.build_index`), the
ladder (:mod:`retriever.ladder`) and the searcher:

* :class:`DiskVectors` -- the build's embedding chunk files (``emb/chunk_*.npy``, float32 or, with
  ``--emb-dtype float16``, half the bytes) memory-mapped: rows are read from disk (page cache) on demand.
* :class:`RerankIndex` -- a compressed first stage (e.g. IVF-PQ) whose ``depth`` best candidates are
  re-scored exactly against :class:`DiskVectors`: RAM holds only the codes, the full vectors stay on disk.
* :func:`build_ondisk` -- train on a seeded sample, then add the vectors block by block; every block is
  its own small index file written atomically (a kill loses at most the block in progress, a rerun
  skips finished blocks), and the blocks are merged into ``index.ivfdata`` (FAISS
  ``OnDiskInvertedLists``, ``faiss.contrib.ondisk.merge_ondisk``) for IVF types, or into one in-memory
  index for flat-code types (Flat, SQ, PQ). A resumed build writes the same bytes as an uninterrupted
  one (the trained index is saved before the first block; adding is deterministic). RAM in use is the
  training sample plus one block (``max_build_ram_mb`` sizes them) plus, for flat-code types, the
  final index; the peak RSS is measured and stored in ``meta.json``.

Serving: ``index.ivfdata`` is memory-mapped (``IO_FLAG_ONDISK_SAME_DIR``: found next to ``index.faiss``
wherever the directory moves), so every server process on a machine shares one copy of its pages in
the page cache; ``emapg serve --mmap`` maps the codes of other index types too (``IO_FLAG_MMAP_IFC``).
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from emapg.atomic import write_text_atomic

ONDISK_DATA = "index.ivfdata"
BLOCKS_DIR = "blocks"
TRAINED_FILE = "trained.faiss"
# bytes of build RAM per added row and dimension: the float32 block, its float16/32 source rows
# memory-mapped, and FAISS's assignment scratch (measured peak / block size on IVF-PQ, with margin)
_BLOCK_BYTES_PER_VALUE = 12


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far: ``VmHWM``, not ``ru_maxrss``, which Linux carries
    over an ``exec`` (a child spawned by a big parent would report the parent's peak)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def chunk_path(emb_dir: Path, i: int) -> Path:
    return Path(emb_dir) / f"chunk_{i:05d}.npy"


class DiskVectors:
    """The rows of ``emb/chunk_*.npy`` (``chunk_size`` rows each), memory-mapped, read as float32."""

    def __init__(self, emb_dir: str | Path, chunk_size: int, rows: int):
        self.emb_dir = Path(emb_dir)
        self.chunk_size = chunk_size
        self.rows = rows
        n_chunks = (rows + chunk_size - 1) // chunk_size
        self.chunks = [np.load(chunk_path(self.emb_dir, i), mmap_mode="r") for i in range(n_chunks)]
        held = sum(len(c) for c in self.chunks)
        if held < rows or held - len(self.chunks[-1]) >= rows:
            raise ValueError(f"{emb_dir}: chunk files hold {held} rows, expected {rows}")
        self.chunks[-1] = self.chunks[-1][: rows - (held - len(self.chunks[-1]))]  # the first ``rows`` rows only
        self.dim = int(self.chunks[0].shape[1])
        self.dtype = self.chunks[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(int(c.nbytes) for c in self.chunks)

    def block(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` as a float32 array (a copy; at most two chunk files are touched when aligned)."""
        out = np.empty((hi - lo, self.dim), dtype=np.float32)
        pos = lo
        while pos < hi:
            c, off = divmod(pos, self.chunk_size)
            take = min(hi - pos, self.chunk_size - off)
            out[pos - lo : pos - lo + take] = self.chunks[c][off : off + take]
            pos += take
        return out

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (any order, -1 allowed: zeros) as float32 ``[len(ids), dim]``."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        out = np.zeros((len(ids), self.dim), dtype=np.float32)
        valid = ids >= 0
        chunk_of, offset = np.divmod(ids[valid], self.chunk_size)
        where = np.flatnonzero(valid)
        for c in np.unique(chunk_of):
            sel = chunk_of == c
            out[where[sel]] = self.chunks[int(c)][offset[sel]]
        return out


class RerankIndex:
    """``first_stage`` proposes ``depth`` candidates per query; they are re-scored exactly on the vectors
    on disk and the best ``k`` returned. Quacks like a FAISS index for :class:`retriever.searcher.Searcher`
    (``search``, ``ntotal``, ``d``)."""

    def __init__(self, first_stage, vectors: DiskVectors, depth: int, metric: str):
        if depth < 1:
            raise ValueError(f"re-rank depth must be >= 1, got {depth}")
        if first_stage.ntotal != vectors.rows:
            raise ValueError(f"first stage holds {first_stage.ntotal} vectors, the vectors on disk {vectors.rows}")
        self.first_stage = first_stage
        self.vectors = vectors
        self.depth = depth
        self.metric = metric
        self.ntotal = first_stage.ntotal
        self.d = first_stage.d

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        q = np.ascontiguousarray(q, dtype=np.float32)
        _, cand = self.first_stage.search(q, max(k, self.depth))
        vec = self.vectors.gather(cand).reshape(cand.shape[0], cand.shape[1], -1)
        if self.metric == "ip":
            scores = np.einsum("bd,bkd->bk", q, vec)
        else:
            scores = -((vec - q[:, None, :]) ** 2).sum(-1)
        scores = np.where(cand >= 0, scores, -np.inf)
        # best first; ties by the lower row id (as FAISS orders them)
        order = np.lexsort((np.where(cand >= 0, cand, np.iinfo(np.int64).max), -scores), axis=1)[:, :k]
        ids = np.take_along_axis(cand, order, 1)
        best = np.take_along_axis(scores, order, 1).astype(np.float32)
        if self.metric == "l2":
            best = -best
        return np.where(ids >= 0, best, -1.0 if self.metric == "ip" else np.inf).astype(np.float32), ids


@dataclass
class OndiskStats:
    blocks_total: int
    blocks_reused: int
    block_rows: int
    train_rows: int
    build_seconds: float
    peak_rss_bytes: int
    index_bytes: int  # index.faiss (+ index.ivfdata)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def block_rows_for(max_build_ram_mb: int, dim: int) -> int:
    """Rows added per block so one block's working memory fits in half of ``max_build_ram_mb``."""
    return max(256, (max_build_ram_mb << 19) // (_BLOCK_BYTES_PER_VALUE * dim))


def sample_ids(rows: int, n: int, seed: int) -> np.ndarray:
    """The seeded training sample's row ids, sorted (the same as :mod:`retriever.index_builder`'s)."""
    n = min(rows, n)
    return np.sort(np.random.default_rng(seed).choice(rows, size=n, replace=False))


def new_index(dim: int, index_type: str, metric: str):
    """``faiss.index_factory`` without polysemous training: it re-orders PQ centroids for Hamming
    filtering, which nothing here uses, and was 90% of an IVF-PQ training (22 of 26 s, measured)."""
    import faiss

    from retriever.index_files import faiss_metric

    index = faiss.index_factory(dim, index_type, faiss_metric(metric))
    for sub in (index, faiss.try_extract_index_ivf(index)):
        sub = faiss.downcast_index(sub) if sub is not None else None
        if sub is not None and hasattr(sub, "do_polysemous_training"):
            sub.do_polysemous_training = False
    return index


def _write_index_atomic(index, path: Path) -> None:
    import faiss

    tmp = path.with_name(path.name + ".tmp")
    faiss.write_index(index, str(tmp))
    os.replace(tmp, path)


def build_ondisk(vectors: DiskVectors, out_dir: str | Path, *, index_type: str, metric: str, train_sample: int, seed: int,
                 max_build_ram_mb: int, log=print, progress: bool = True) -> OndiskStats:  # fmt: skip
    """Build ``out_dir/index.faiss`` (and ``index.ivfdata`` for IVF types) from ``vectors`` in blocks; resumable.

    Raises ``ValueError`` when the type cannot be built in blocks (HNSW: its graph must be in RAM) or the
    training sample does not fit ``max_build_ram_mb``.
    """
    import faiss
    from faiss.contrib.ondisk import merge_ondisk

    from retriever.index_files import progress_bar

    t0 = time.perf_counter()
    out = Path(out_dir)
    blocks = out / BLOCKS_DIR
    blocks.mkdir(parents=True, exist_ok=True)
    dim, rows = vectors.dim, vectors.rows
    probe = new_index(dim, index_type, metric)
    ivf = faiss.try_extract_index_ivf(probe)
    if ivf is None and not isinstance(faiss.downcast_index(probe), faiss.IndexFlatCodes):
        raise ValueError(f"--ondisk builds IVF types (inverted lists on disk) and flat-code types (Flat, SQ8, PQ); "
                         f"{index_type!r} is neither (HNSW keeps its graph in RAM: build it without --ondisk)")  # fmt: skip
    n_train = min(rows, train_sample)
    sample_bytes = n_train * dim * 4
    if not probe.is_trained and sample_bytes > (max_build_ram_mb << 19):
        raise ValueError(f"the training sample ({n_train} x {dim} float32 = {sample_bytes >> 20} MiB) exceeds half of "
                         f"--max-build-ram-mb {max_build_ram_mb}: lower --train-sample or raise --max-build-ram-mb")  # fmt: skip

    # 1. Train once; the trained (empty) index is the resume point every block starts from.
    trained_path = blocks / TRAINED_FILE
    if not trained_path.is_file():
        if not probe.is_trained:
            log(f"training {index_type} on {n_train} sampled vectors (seed {seed}) ...")
            sample = vectors.gather(sample_ids(rows, n_train, seed))
            probe.train(sample)
            del sample
        _write_index_atomic(probe, trained_path)
    del probe

    # 2. Add block by block; a block file is written whole or not at all.
    block_rows = block_rows_for(max_build_ram_mb, dim)
    n_blocks = (rows + block_rows - 1) // block_rows
    paths = [blocks / f"block_{i:05d}.faiss" for i in range(n_blocks)]
    reused = sum(p.is_file() for p in paths)
    if reused:
        log(f"resuming: {reused}/{n_blocks} blocks already added")
    bar = progress_bar(total=rows, initial=min(rows, reused * block_rows), enabled=progress, desc="adding")
    try:
        for i, path in enumerate(paths):
            if path.is_file():
                continue
            lo, hi = i * block_rows, min(rows, (i + 1) * block_rows)
            block = faiss.read_index(str(trained_path))
            x = vectors.block(lo, hi)
            if ivf is not None:
                block.add_with_ids(x, np.arange(lo, hi, dtype=np.int64))
            else:
                block.add(x)
            del x
            _write_index_atomic(block, path)
            del block
            bar.update(hi - lo)
    finally:
        bar.close()

    # 3. Merge the blocks: inverted lists into index.ivfdata, or codes into one index.
    log(f"merging {n_blocks} blocks ...")
    final = faiss.read_index(str(trained_path))
    if ivf is not None:
        data = out / ONDISK_DATA
        data.unlink(missing_ok=True)  # a merge killed half-way starts over
        merge_ondisk(final, [str(p) for p in paths], str(data))
        # store the bare file name: readers pass IO_FLAG_ONDISK_SAME_DIR, so the directory can move
        # and two builds of the same data write the same bytes
        invlists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(final).invlists)
        invlists.filename = ONDISK_DATA
    else:
        for p in paths:
            final.merge_from(faiss.read_index(str(p)))
    _write_index_atomic(final, out / "index.faiss")
    del final
    for p in paths:  # merged: the blocks are dead weight (as large as the index)
        p.unlink()
    index_bytes = (out / "index.faiss").stat().st_size + ((out / ONDISK_DATA).stat().st_size if ivf is not None else 0)
    stats = OndiskStats(n_blocks, reused, block_rows, n_train, round(time.perf_counter() - t0, 3), peak_rss_bytes(), index_bytes)
    write_text_atomic(blocks / "done.json", json.dumps(stats.to_dict(), indent=1))
    return stats


def read_index(index_dir: str | Path, index_file: str = "index.faiss", *, mmap: bool = False):
    """Read an index directory's FAISS file: on-disk inverted lists found next to it, memory-mapped codes
    with ``mmap`` (pages shared between processes, read from disk on first touch)."""
    import faiss

    d = Path(index_dir)
    if (d / ONDISK_DATA).is_file():  # the inverted lists are memory-mapped already; the rest is small
        return faiss.read_index(str(d / index_file), faiss.IO_FLAG_ONDISK_SAME_DIR)
    return faiss.read_index(str(d / index_file), faiss.IO_FLAG_MMAP_IFC if mmap else 0)
