"""The files of a built index directory and what reads them, below the builder, the searcher and the fingerprint.

Layout of an index directory (written by :mod:`retriever.index_builder`)::

    meta.json            written last: its presence means the index is complete
    docs.bin, *.npy      memory-mapped document store (retriever.corpus)
    emb/chunk_00000.npy  passage embeddings, one file per ``chunk_size`` rows
    emb/progress.json    build settings + finished chunks (the resume point)
    index.faiss          the FAISS index (any ``index_factory`` string)
    bm25/                bm25s index (with ``--bm25``)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

META_FILE = "meta.json"
INDEX_FILE = "index.faiss"
EMB_DIR = "emb"
PROGRESS_FILE = "progress.json"
BM25_DIR = "bm25"
FORMAT_VERSION = 1


def read_meta(index_dir: str | Path) -> dict:
    """``meta.json`` of a finished index, or a readable error."""
    path = Path(index_dir) / META_FILE
    if not path.is_file():
        if (Path(index_dir) / EMB_DIR / PROGRESS_FILE).is_file():
            raise FileNotFoundError(f"{index_dir} holds an unfinished build; rerun `emapg index build` to resume it")
        raise FileNotFoundError(f"{index_dir} is not an index directory (no {META_FILE}); build one with `emapg index build`")
    return json.loads(path.read_text())


def faiss_metric(metric: str) -> int:
    import faiss

    return {"ip": faiss.METRIC_INNER_PRODUCT, "l2": faiss.METRIC_L2}[metric]


def progress_bar(total: int, initial: int, enabled: bool, desc: str = "encoding"):
    from tqdm import tqdm

    # In a log file (docker logs, CI) a bar redrawn ten times a second is noise: redraw every 30 s.
    interval = 0.1 if sys.stderr.isatty() else 30.0
    return tqdm(total=total, initial=initial, unit="passages", unit_scale=True, desc=desc, disable=not enabled, smoothing=0.1, mininterval=interval)
