"""``emapg index shard``: split a built index into contiguous shards, each a servable index directory.

Shard ``s`` of ``n`` holds rows ``[s*N/n, (s+1)*N/n)`` of the source: their passages (document store),
their embeddings (``emb/``, same chunk size and dtype) and a FAISS index of the same type over them
(trained types reuse the source's trained quantizer: the source index emptied, then the shard's rows
added, so an IVF or PQ code is the same as in the unsharded index). ``meta.json`` gains ``shard``
(``index``, ``of``, ``row_offset``, ``rows_total``, ``source_fingerprint``), which the router
(:mod:`retriever.router`) checks: one shard of every index, one source.

Flat shards are exact: the router's merge of their top-k equals the unsharded Flat top-k (ids, order,
scores). IVF shards too when every shard probes the same lists (same quantizer, same nprobe); HNSW
shards get their own graphs (results close to, not equal to, the unsharded graph's).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from emapg.atomic import save_npy_atomic, write_text_atomic
from emapg.config import ConfigError, option

from retriever.corpus import DocStore, Passage, write_docstore
from retriever.fingerprint import index_fingerprint
from retriever.index_files import EMB_DIR, INDEX_FILE, META_FILE, read_meta
from retriever.ondisk import DiskVectors, chunk_path, read_index


@dataclass
class ShardConfig:
    """Options of ``emapg index shard`` (the command-line flags are generated from these fields)."""

    index: str = option(help="a built index directory to split")
    out: str = option(help="directory for the shards: <out>/shard_0 ... <out>/shard_<n-1>")
    shards: int = option(2, help="number of shards (contiguous, near-equal row ranges)")
    align: int = option(1024, help="shard boundaries at multiples of this many rows: FAISS's BLAS search scores the database "
                                   "in blocks of 1024 rows, so aligned Flat shards give bit-identical scores (unaligned: the "
                                   "same ids and order, scores within float32 rounding)")  # fmt: skip
    overwrite: bool = option(False, help="replace existing shard directories")

    def validate(self) -> None:
        if self.shards < 1 or self.align < 1:
            raise ConfigError("--shards and --align must be at least 1")


def shard_ranges(rows: int, shards: int, align: int = 1) -> list[tuple[int, int]]:
    """Contiguous near-equal row ranges; inner boundaries rounded to multiples of ``align`` while that leaves no shard empty."""
    bounds = [rows * s // shards for s in range(shards + 1)]
    aligned = [0, *(round(b / align) * align for b in bounds[1:-1]), rows]
    if align > 1 and all(a < b for a, b in zip(aligned[:-1], aligned[1:])):
        bounds = aligned
    return list(zip(bounds[:-1], bounds[1:]))


def shard_index(cfg: ShardConfig, log=print) -> list[Path]:
    """Write the shards of ``cfg.index`` under ``cfg.out``; returns their directories."""
    import faiss

    cfg.validate()
    src = Path(cfg.index)
    meta = read_meta(src)
    rows = meta["rows"]
    if cfg.shards > rows:
        raise ValueError(f"--shards {cfg.shards} exceeds the index's {rows} passages")
    if meta.get("rerank_depth") or (src / "index.ivfdata").exists():
        raise ValueError("sharding an on-disk or re-ranked index is not supported: shard a Flat/IVF/SQ/PQ index built in RAM")
    store = DocStore(src)
    vectors = DiskVectors(src / EMB_DIR, meta["chunk_size"], rows)
    empty = read_index(src)
    empty.reset()  # trained, no rows
    enc_sha = (meta.get("fingerprint") or {}).get("encoder_sha256")
    out_dirs = []
    for s, (lo, hi) in enumerate(shard_ranges(rows, cfg.shards, cfg.align)):
        d = Path(cfg.out) / f"shard_{s}"
        if d.exists():
            if not cfg.overwrite:
                raise FileExistsError(f"{d} exists; pass --overwrite to replace it")
            shutil.rmtree(d)
        tmp = d.with_name(d.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / EMB_DIR).mkdir(parents=True)
        log(f"shard {s}: rows {lo}..{hi - 1} ({hi - lo} passages)")
        step = 65536
        write_docstore((Passage(i, c) for a in range(lo, hi, step) for i, c in
                        zip(store.ids(np.arange(a, min(hi, a + step))), store.contents(np.arange(a, min(hi, a + step))))), tmp)  # fmt: skip
        index = faiss.clone_index(empty)
        cs = meta["chunk_size"]
        for j, a in enumerate(range(lo, hi, cs)):
            block = vectors.block(a, min(hi, a + cs))
            save_npy_atomic(chunk_path(tmp / EMB_DIR, j), block.astype(vectors.dtype))
            index.add(block)
        faiss.write_index(index, str(tmp / INDEX_FILE))
        smeta = {**meta, "rows": hi - lo, "corpus": {**meta["corpus"], "rows": hi - lo},
                 "shard": {"index": s, "of": cfg.shards, "row_offset": lo, "rows_total": rows,
                           "source_fingerprint": (meta.get("fingerprint") or {}).get("id"), "source": str(src.resolve())}}  # fmt: skip
        smeta.pop("fingerprint", None)
        if enc_sha:
            smeta["fingerprint"] = index_fingerprint(smeta, encoder_sha256=enc_sha)
        write_text_atomic(tmp / META_FILE, json.dumps(smeta, indent=2))
        os.replace(tmp, d)
        out_dirs.append(d)
    return out_dirs
