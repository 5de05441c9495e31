"""The bundled Wikipedia index: one folder per setting, reused only after its settings are checked.

``emapg eval`` (QA without ``--retriever-url`` / ``--index``) and ``emapg demo`` both serve a MiniLM
Flat index of the bundled corpus (``data/corpus/wiki_mini.jsonl.gz``, 43k passages), built on first use
into ``$EMAPG_CACHE/indexes/wiki_mini-minilm-flat[-first<N>]``. :func:`ensure_bundled_index` is the only
way to get it: it reads the folder's ``meta.json`` and reuses it only when everything the vectors
depend on matches what it would build now -- the corpus checksum, the passage limit, the encoder
(model, pooling, prefixes, max length), the index type and metric, and the encoding dtype. A folder
built otherwise (another corpus version, another dtype, another machine) is rebuilt, not served.

The vectors follow one rule for every caller, so eval and demo agree on one folder: the **shipped
vectors** (``data/corpus/wiki_mini.minilm-uint8.npz``, :mod:`retriever.vector_file`: the fp32 MiniLM
vectors of the whole corpus quantized to 8 bits, made by ``scripts/build_bundled_vectors.py``) whenever
that file was made for this corpus and the local MiniLM weights -- the index is then ready in seconds
instead of ~7.6 min of encoding on 2 cores, and identical on every machine; otherwise the passages are
encoded here, in float16 on a GPU, on a CPU in bfloat16 when it has bf16 matrix instructions
(AVX512-BF16 / AMX: about 1.8x faster encoding at unchanged recall), float32 otherwise. A killed build
resumes (the builder's chunks are atomic).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emapg.console import echo
from emapg.cpu import cpu_has_bf16
from emapg.paths import BUNDLED_CORPUS, BUNDLED_VECTORS, cache_dir

__all__ = ["BUNDLED_CORPUS", "BUNDLED_VECTORS", "BundledIndex", "bundled_index", "ensure_bundled_index", "index_mismatches",
           "shipped_vectors_usable"]

ENCODER = "minilm"
INDEX_TYPE = "Flat"
#: The encoding "dtype" of an index built from the shipped vector file (its meta.json ``build.dtype``).
SHIPPED_DTYPE = "uint8 vectors from float32"


@functools.lru_cache(maxsize=8)
def shipped_vectors_usable(limit: int | None = None) -> bool:
    """Whether ``BUNDLED_VECTORS`` exists and was made for the bundled corpus (its first ``limit``
    passages) and the local MiniLM weights."""
    if not BUNDLED_VECTORS.is_file():
        return False
    from emapg.models import resolve_model
    from retriever.corpus import file_checksum
    from retriever.encoder import make_spec
    from retriever.vector_file import encoder_weights_sha256, meta_mismatches, read_vector_meta

    try:
        meta = read_vector_meta(BUNDLED_VECTORS)
        return not meta_mismatches(meta, corpus_checksum=file_checksum(BUNDLED_CORPUS), rows=limit or meta["corpus"]["rows"],
                                   encoder=make_spec(ENCODER).to_dict(),
                                   weights_sha256=encoder_weights_sha256(resolve_model(ENCODER)))
    except (ValueError, OSError, KeyError):
        return False


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class BundledIndex:
    """Where the bundled index with these settings lives and how it is built."""

    path: Path
    limit: int | None  # passages indexed (None: the whole corpus)
    dtype: str  # the encoder dtype the vectors are computed in, or SHIPPED_DTYPE

    def build_config(self, *, overwrite: bool = False):
        from retriever.index_builder import BuildConfig

        return BuildConfig(corpus=str(BUNDLED_CORPUS), out=str(self.path), encoder=ENCODER, index_type=INDEX_TYPE,
                           limit=self.limit, fp16=self.dtype == "float16", bf16=self.dtype == "bfloat16",
                           vectors=str(BUNDLED_VECTORS) if self.dtype == SHIPPED_DTYPE else None, overwrite=overwrite)


def bundled_index(limit: int | None = None, *, dtype: str | None = None) -> BundledIndex:
    """The bundled index's settings for ``limit`` passages; ``dtype`` defaults to the module's rule
    (:data:`SHIPPED_DTYPE` when the shipped vectors are usable)."""
    if dtype is None:
        dtype = (SHIPPED_DTYPE if shipped_vectors_usable(limit) else
                 "float16" if _on_gpu() else "bfloat16" if cpu_has_bf16() else "float32")
    suffix = f"-first{limit}" if limit else ""
    return BundledIndex(cache_dir() / "indexes" / f"wiki_mini-minilm-flat{suffix}", limit, dtype)


def index_mismatches(index_dir: str | Path, build: Any, dtype: str | None) -> list[str]:
    """Settings of the finished index at ``index_dir`` that differ from ``build`` (a
    ``retriever.index_builder.BuildConfig``) and, when given, the encoding ``dtype``; [] when it matches."""
    from retriever.corpus import file_checksum
    from retriever.encoder import make_spec
    from retriever.index_files import read_meta

    meta = read_meta(index_dir)
    spec = make_spec(build.encoder, pooling=build.pooling, query_prefix=build.query_prefix,
                     passage_prefix=build.passage_prefix, max_length=build.max_length)
    wanted = {"corpus checksum": file_checksum(build.corpus), "limit": build.limit, "encoder": spec.to_dict(),
              "index type": build.index_type, "metric": build.metric}
    found = {"corpus checksum": meta["corpus"]["checksum"], "limit": meta["corpus"].get("limit"),
             "encoder": meta["encoder"], "index type": meta["index_type"], "metric": meta["metric"]}
    if dtype is not None:
        wanted["dtype"], found["dtype"] = dtype, (meta.get("build") or {}).get("dtype")
    return [k for k in wanted if wanted[k] != found[k]]


def ensure_bundled_index(limit: int | None = None, *, dtype: str | None = None,
                         log: Callable[[str], None] | None = None) -> Path:
    """The finished bundled index for these settings: reused when its ``meta.json`` matches them, else
    built (or its interrupted build resumed), or rebuilt when a finished one differs."""
    from retriever.index_builder import build_index
    from retriever.index_files import META_FILE

    say = log or echo  # our line: on the console, also while library output goes to the run's log
    want = bundled_index(limit, dtype=dtype)
    overwrite = False
    if (want.path / META_FILE).is_file():
        stale = index_mismatches(want.path, want.build_config(), want.dtype)
        if not stale:
            say(f"reusing the bundled index {want.path} (its settings match)")
            return want.path
        say(f"{want.path} was built with other settings ({', '.join(stale)}); rebuilding it")
        overwrite = True
    what = f"first {limit} passages" if limit else "43k passages"
    how = f"from the shipped vectors {BUNDLED_VECTORS.name}" if want.dtype == SHIPPED_DTYPE else f"MiniLM, {want.dtype}"
    say(f"building the bundled Wikipedia index ({what}, {how}, one time) -> {want.path}")
    try:
        build_index(want.build_config(overwrite=overwrite), log=say)
    except FileExistsError:  # an interrupted build with other settings: this cache folder is ours to redo
        say(f"{want.path} holds a partial build with other settings; starting it over")
        build_index(want.build_config(overwrite=True), log=say)
    return want.path
