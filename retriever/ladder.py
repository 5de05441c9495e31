"""``emapg index ladder``: what each compressed index costs and what it loses against Flat, measured.

From a built index's stored embeddings (``emb/``) and a question set, every *rung* -- a FAISS factory
string plus search settings -- is built on a seeded training sample, in its own process (so its peak
build RSS is its own) and with bounded memory (:func:`retriever.ondisk.build_ondisk`: blocks,
on-disk inverted lists; HNSW is added chunk by chunk in RAM), into ``<out>/<rung>/``, itself an index
directory ``emapg serve`` can serve (the document store and ``emb/`` are symlinks to the source index).
Then, per rung:

* ``recall_at_{1,3,10}``: the mean fraction of Flat's (exact fp32) top-k passages the rung returns in
  its top-k. 1.0 for Flat by definition; "recall@3 >= 0.95 of Flat" is ``recall_at_3 >= 0.95``.
* ``answer_recall_at_{1,3,10}``: the fraction of questions with a gold answer string (case-folded) in
  the text of the top-k passages -- the number a search agent feels; Flat's is the reference.
* ``bytes_per_passage`` (RAM the index needs resident: ``index.faiss`` + ``index.ivfdata``, per passage),
  ``disk_bytes`` (+ the embeddings a re-rank stage reads from disk), ``build_seconds``,
  ``peak_build_rss_bytes``, ``qps_batch1`` / ``qps_batch32`` (in-process search, ``threads`` FAISS
  threads), and, through a real ``emapg serve`` process under ``concurrency`` closed-loop clients,
  ``qps_c32`` / ``p50_ms`` / ``p99_ms`` (query encoding included: it is what a client waits for).
* ``target``: the memory extrapolated to ``target_rows`` x ``dim`` (codes scaled with the dimension,
  per-row overhead as measured, coarse centroids for ``sqrt``-scaled lists).

The recommendation is the rung with the fewest ``bytes_per_passage`` whose ``recall_at_3`` meets
``recall_floor``. A rerun skips every rung whose result is stored (``<rung>/result.json``), so an
interrupted ladder resumes; ``results.json`` holds the whole table.

Rung syntax: ``<factory>[;nprobe=N][;ef=N][;rerank=N]``, e.g. ``IVF512,PQ48;nprobe=16;rerank=100``.
"""

from __future__ import annotations

import gzip
import json
import math
import multiprocessing
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from emapg.atomic import write_text_atomic
from emapg.config import ConfigError, option
from emapg.paths import DATA_DIR

from retriever.ondisk import DiskVectors, RerankIndex, build_ondisk, current_rss_bytes, new_index, peak_rss_bytes, read_index, sample_ids

RESULTS_FILE = "results.json"
RESULT_FILE = "result.json"
KS = (1, 3, 10)


@dataclass
class LadderConfig:
    """Options of ``emapg index ladder`` (the command-line flags are generated from these fields)."""

    index: str = option(help="a built index directory (its emb/ vectors and document store are the source); with --vectors, "
                             "built here first if absent")  # fmt: skip
    out: str = option(help="ladder directory: one servable index per rung + results.json (a rerun resumes)")
    vectors: str | None = option(None, help="a passage vector file (e.g. data/corpus/wiki_mini.minilm-uint8.npz) to build --index "
                                            "from when it does not exist yet (Flat; needs --corpus)")  # fmt: skip
    corpus: str | None = option(None, help="corpus of --vectors (default: the bundled corpus, data/corpus/wiki_mini.jsonl.gz)")
    questions: str = option("nq", help="question set: a bundled QA set name (nq, hotpotqa, triviaqa, ...) or a jsonl(.gz) file "
                                       "with 'question' and 'golden_answers' (or 'answers') per line")  # fmt: skip
    n_questions: int = option(500, help="questions used (the first N)")
    rungs: list[str] = option([], help="rungs '<factory>[;nprobe=N][;ef=N][;rerank=N]' (default: the standard ladder "
                                       "for the index's size: Flat, fp16, SQ8, IVF-Flat, IVF-SQ8, IVF-PQ, OPQ+IVF-PQ, HNSW+SQ8, "
                                       "IVF-PQ re-ranked from disk)")  # fmt: skip
    recall_floor: float = option(0.95, help="recommend the cheapest rung with recall@3 (vs Flat) at least this")
    target_rows: int = option(21_000_000, help="extrapolate every rung's memory to this many passages (wiki-18: 21M)")
    dim: int | None = option(None, help="... and this vector dimension (default: the index's; e5-base: 768)")
    train_sample: int = option(100_000, help="vectors sampled (seeded) to train each rung")
    seed: int = option(0, help="seed of the training sample")
    max_build_ram_mb: int = option(2048, help="RAM for a rung's training sample and one block of added vectors, in MiB")
    threads: int = option(1, help="FAISS threads for the in-process q/s measurements and builds")
    serve: bool = option(True, help="measure each rung through a real `emapg serve` process (--no-serve: in-process only)")
    serve_only: list[str] = option([], help="serve only these rungs (default: all); Flat is always served as the reference")
    concurrency: int = option(32, help="closed-loop clients for the server measurement")
    load_seconds: float = option(5.0, help="measured window per served rung, in seconds")
    progress: bool = option(True, help="progress bars (--no-progress: none)")

    def validate(self) -> None:
        if not 0 < self.recall_floor <= 1:
            raise ConfigError("--recall-floor must be in (0, 1]")
        if self.n_questions < 1 or self.target_rows < 1 or self.threads < 1 or self.concurrency < 1:
            raise ConfigError("--n-questions, --target-rows, --threads and --concurrency must be positive")
        for r in self.rungs:
            try:
                parse_rung(r)
            except ValueError as e:
                raise ConfigError(f"--rungs: {e}") from None


# ----------------------------------------------------------------------------- rungs


@dataclass(frozen=True)
class Rung:
    factory: str
    nprobe: int | None = None
    ef: int | None = None
    rerank: int = 0

    @property
    def name(self) -> str:
        return self.factory + (f";nprobe={self.nprobe}" if self.nprobe else "") + (f";ef={self.ef}" if self.ef else "") \
            + (f";rerank={self.rerank}" if self.rerank else "")  # fmt: skip

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", self.name)


def parse_rung(spec: str) -> Rung:
    """``'IVF512,PQ48;nprobe=16;rerank=100'`` -> :class:`Rung` (a readable ``ValueError`` otherwise)."""
    factory, *opts = [p.strip() for p in spec.split(";")]
    kw: dict[str, int] = {}
    for o in opts:
        key, _, val = o.partition("=")
        if key not in ("nprobe", "ef", "rerank") or not val.isdigit():
            raise ValueError(f"rung {spec!r}: options are nprobe=N, ef=N, rerank=N (got {o!r})")
        kw[key] = int(val)
    if not factory:
        raise ValueError(f"rung {spec!r} has no factory string")
    return Rung(factory, **kw)


def default_rungs(rows: int, dim: int) -> list[Rung]:
    """The standard ladder for ``rows`` x ``dim``: coarse lists ~2 sqrt(rows) (a power of two), PQ with 8
    dimensions per sub-quantizer (PQ with 4 trains 6x slower on FAISS 1.15, measured)."""
    nlist = min(1 << round(math.log2(2 * math.sqrt(rows))), max(1, rows // 39))
    nlist = 1 << int(math.log2(nlist))
    nprobe = max(8, nlist // 32)
    m = dim // 8 if dim % 8 == 0 else next(m for m in range(dim // 8, 0, -1) if dim % m == 0)
    return [
        Rung("Flat"),
        Rung("SQfp16"),
        Rung("SQ8"),
        Rung(f"IVF{nlist},Flat", nprobe=nprobe),
        Rung(f"IVF{nlist},SQ8", nprobe=nprobe),
        Rung(f"IVF{nlist},PQ{m}", nprobe=nprobe),
        Rung(f"OPQ{m},IVF{nlist},PQ{m}", nprobe=nprobe),
        Rung("HNSW32,SQ8", ef=64),
        # the first stage must find the true neighbours among its candidates: it probes 4x the lists
        Rung(f"IVF{nlist},PQ{m}", nprobe=min(nlist, 4 * nprobe), rerank=100),
    ]


# ----------------------------------------------------------------------------- metrics


def recall_at_k(found: np.ndarray, truth: np.ndarray, k: int) -> float:
    """Mean over queries of |top-k found ∩ top-k truth| / k (ids; -1 never matches)."""
    found, truth = np.asarray(found)[:, :k], np.asarray(truth)[:, :k]
    hits = [len(set(f[f >= 0].tolist()) & set(t[t >= 0].tolist())) for f, t in zip(found, truth)]
    return float(np.mean(hits)) / k


def normalize_text(s: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", s.lower()).split())


def answer_recall(passages: list[list[str]], answers: list[list[str]], k: int) -> float:
    """Fraction of questions with any gold answer (normalised: lower case, punctuation as spaces) inside
    one of its first ``k`` passages (normalised likewise)."""
    found = 0
    for texts, golds in zip(passages, answers):
        hay = " " + " ".join(normalize_text(t) for t in texts[:k]) + " "
        found += any(f" {normalize_text(a)} " in hay for a in golds if normalize_text(a))
    return found / len(passages) if passages else 0.0


def exact_topk(vectors: DiskVectors, queries: np.ndarray, k: int, metric: str, block_rows: int = 65536) -> tuple[np.ndarray, np.ndarray]:
    """Exact fp32 top-k over the vectors on disk, block by block (bounded memory); ties by lower row id."""
    import faiss

    from retriever.index_files import faiss_metric

    q = np.ascontiguousarray(queries, dtype=np.float32)
    best_d = np.full((len(q), k), -np.inf if metric == "ip" else np.inf, dtype=np.float32)
    best_i = np.full((len(q), k), -1, dtype=np.int64)
    for lo in range(0, vectors.rows, block_rows):
        hi = min(vectors.rows, lo + block_rows)
        d, i = faiss.knn(q, vectors.block(lo, hi), min(k, hi - lo), metric=faiss_metric(metric))
        d = np.concatenate([best_d, d], axis=1)
        i = np.concatenate([best_i, np.where(i >= 0, i + lo, -1)], axis=1)
        key = -d if metric == "ip" else d
        order = np.lexsort((np.where(i >= 0, i, np.iinfo(np.int64).max), key), axis=1)[:, :k]
        best_d, best_i = np.take_along_axis(d, order, 1), np.take_along_axis(i, order, 1)
    return best_d, best_i


def code_layout(index) -> dict:
    """Bytes per vector of the codes, coarse lists and fixed parts of a FAISS index (for extrapolation)."""
    import faiss

    ivf = faiss.try_extract_index_ivf(index)
    inner = faiss.downcast_index(index.index if isinstance(faiss.downcast_index(index), faiss.IndexPreTransform) else index)
    opq = isinstance(faiss.downcast_index(index), faiss.IndexPreTransform)
    if ivf is not None:
        ivf = faiss.downcast_index(ivf)
        return {"code_size": int(ivf.code_size), "nlist": int(ivf.nlist), "ids": 8, "opq": opq, "pq": hasattr(ivf, "pq")}
    if hasattr(inner, "hnsw"):
        return {"code_size": int(faiss.downcast_index(inner.storage).code_size), "nlist": 0, "ids": 0, "opq": opq, "pq": False,
                "hnsw": True}  # fmt: skip
    return {"code_size": int(inner.code_size), "nlist": 0, "ids": 0, "opq": opq, "pq": hasattr(inner, "pq")}


def _fixed_bytes(layout: dict, dim: int, nlist: int) -> int:
    return nlist * dim * 4 + (dim * dim * 4 if layout["opq"] else 0) + (256 * dim * 4 if layout["pq"] else 0)


def extrapolate(layout: dict, index_bytes: int, rows: int, dim: int, target_rows: int, target_dim: int, rerank: bool,
                emb_bytes_per_value: int = 2) -> dict:  # fmt: skip
    """Memory of the same rung at ``target_rows`` x ``target_dim``: codes scale with the dimension (the
    rung's bytes per dimension), the measured per-row overhead (ids, graph links) stays, coarse lists
    grow as sqrt(rows) (a power of two)."""
    nlist_t = 0
    if layout["nlist"]:
        nlist_t = 1 << round(math.log2(layout["nlist"] * math.sqrt(target_rows / rows)))
    overhead = (index_bytes - _fixed_bytes(layout, dim, layout["nlist"])) / rows - layout["code_size"]
    per_row = layout["code_size"] * target_dim / dim + max(0.0, overhead)
    ram = target_rows * per_row + _fixed_bytes(layout, target_dim, nlist_t)
    out = {"rows": target_rows, "dim": target_dim, "nlist": nlist_t or None, "bytes_per_passage": round(ram / target_rows, 1),
           "ram_bytes": int(ram), "ram_gib": round(ram / 2**30, 2)}  # fmt: skip
    if rerank:
        out["disk_vectors_gib"] = round(target_rows * target_dim * emb_bytes_per_value / 2**30, 2)
    return out


def recommend(results: list[dict], floor: float) -> str | None:
    """The rung with the fewest bytes per passage whose recall@3 vs Flat is at least ``floor`` (ties: faster)."""
    ok = [r for r in results if r["recall_at_3"] >= floor]
    if not ok:
        return None
    return min(ok, key=lambda r: (r["bytes_per_passage"], -(r.get("qps_c32") or r.get("qps_batch32") or 0)))["name"]


# ----------------------------------------------------------------------------- building a rung


def coarse_key(factory: str) -> str | None:
    """The coarse quantizer part of an IVF factory string (``'IVF2048'`` of ``'IVF2048,PQ96'``): rungs with
    the same one can share its training. None for other types and for pre-transformed ones (OPQ, PCA)."""
    head = factory.split(",", 1)[0]
    return head if re.fullmatch(r"IVF\d+", head) and "," in factory else None


def _train_with_quantizer(vectors: DiskVectors, out: Path, factory: str, metric: str, train_sample: int, seed: int,
                          quantizer_from: Path) -> None:  # fmt: skip
    """Write ``out/blocks/trained.faiss`` for ``factory`` with the coarse centroids of the rung built in
    ``quantizer_from`` (the same ``IVFn``): only the codes (SQ, PQ) train on the sample, k-means is skipped
    (FAISS trains no coarse quantizer that already holds ``nlist`` centroids)."""
    import faiss

    from retriever.ondisk import BLOCKS_DIR, TRAINED_FILE, _write_index_atomic

    trained = out / BLOCKS_DIR / TRAINED_FILE
    if trained.is_file():
        return
    src_file = quantizer_from / BLOCKS_DIR / TRAINED_FILE
    src = faiss.read_index(str(src_file)) if src_file.is_file() else read_index(quantizer_from)
    src_ivf = faiss.extract_index_ivf(src)
    index = new_index(vectors.dim, factory, metric)
    ivf = faiss.extract_index_ivf(index)
    if src_ivf.nlist != ivf.nlist:
        raise ValueError(f"{quantizer_from} has {src_ivf.nlist} lists, {factory} {ivf.nlist}")
    ivf.quantizer.add(src_ivf.quantizer.reconstruct_n(0, src_ivf.nlist))
    if not index.is_trained:
        index.train(vectors.gather(sample_ids(vectors.rows, train_sample, seed)))
    trained.parent.mkdir(parents=True, exist_ok=True)
    _write_index_atomic(index, trained)


def _build_rung_child(rung_dir: str, emb_dir: str, chunk_size: int, rows: int, factory: str, metric: str, ef: int | None,
                      train_sample: int, seed: int, max_build_ram_mb: int, threads: int, quantizer_from: str | None = None) -> None:  # fmt: skip
    """Runs in a fresh process: build one rung into ``rung_dir`` and write its build stats."""
    import faiss

    faiss.omp_set_num_threads(threads)
    t0 = time.perf_counter()
    vectors = DiskVectors(emb_dir, chunk_size, rows)
    out = Path(rung_dir)
    probe = new_index(vectors.dim, factory, metric)
    if hasattr(faiss.downcast_index(probe), "hnsw"):  # a graph: in RAM, added chunk by chunk
        if not probe.is_trained:
            probe.train(vectors.gather(sample_ids(rows, train_sample, seed)))
        faiss.downcast_index(probe).hnsw.efSearch = ef or 64
        for lo in range(0, rows, chunk_size):
            probe.add(vectors.block(lo, min(rows, lo + chunk_size)))
        tmp = out / "index.faiss.tmp"
        faiss.write_index(probe, str(tmp))
        os.replace(tmp, out / "index.faiss")
        stats = {"build_seconds": round(time.perf_counter() - t0, 3), "peak_build_rss_bytes": peak_rss_bytes(), "blocks": None}
    else:
        del probe
        if quantizer_from is not None:
            _train_with_quantizer(vectors, out, factory, metric, train_sample, seed, Path(quantizer_from))
        s = build_ondisk(vectors, out, index_type=factory, metric=metric, train_sample=train_sample, seed=seed,
                         max_build_ram_mb=max_build_ram_mb, log=lambda m: None, progress=False)  # fmt: skip
        stats = {"build_seconds": round(time.perf_counter() - t0, 3), "peak_build_rss_bytes": s.peak_rss_bytes, "blocks": s.blocks_total,
                 "coarse_quantizer_from": quantizer_from}  # fmt: skip
    write_text_atomic(out / "build.json", json.dumps(stats))


def anon_rss_bytes(pid: int) -> int | None:
    """``RssAnon`` of a process: its resident memory that is not file-backed (memory-mapped index and
    vector files it read or wrote are page cache the kernel can drop; ``VmHWM`` counts them too)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon")), None)
    except OSError:
        return None


def build_rung(rung: Rung, rung_dir: Path, vectors: DiskVectors, metric: str, *, train_sample: int, seed: int,
               max_build_ram_mb: int, threads: int, built: dict | None = None) -> dict:  # fmt: skip
    """Build ``rung`` into ``rung_dir`` in a child process (its own peak RSS); reuse a finished build.

    ``built`` (kept by the caller across rungs) lets rungs share work: a rung whose factory was built
    already (the same index searched differently, e.g. with a re-rank stage) links that build's files;
    a rung with the same IVF coarse lists (:func:`coarse_key`) as a built one reuses its centroids. The
    child's anonymous RSS is sampled every 0.2 s (``peak_build_anon_bytes``) next to its ``VmHWM``
    (``peak_build_rss_bytes``, which includes the file pages it memory-mapped)."""
    built = {} if built is None else built
    done = rung_dir / "build.json"
    same = built.get((rung.factory, vectors.rows))
    if not done.is_file() and same is not None and same != rung_dir:  # the same index: link its files
        rung_dir.mkdir(parents=True, exist_ok=True)
        for f in ("index.faiss", "index.ivfdata", "build.json"):
            if (same / f).is_file() and not (rung_dir / f).exists():
                os.link(same / f, rung_dir / f)
    if not (done.is_file() and (rung_dir / "index.faiss").is_file()):
        rung_dir.mkdir(parents=True, exist_ok=True)
        key = coarse_key(rung.factory)
        quantizer_from = built.get(("coarse", key, vectors.rows)) if key else None
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(target=_build_rung_child, args=(str(rung_dir), str(vectors.emb_dir), vectors.chunk_size, vectors.rows,
                                                           rung.factory, metric, rung.ef, train_sample, seed, max_build_ram_mb, threads,
                                                           str(quantizer_from) if quantizer_from else None))  # fmt: skip
        proc.start()
        peak_anon = 0
        try:
            while proc.is_alive():
                peak_anon = max(peak_anon, anon_rss_bytes(proc.pid) or 0)
                proc.join(0.2)
        finally:  # interrupted: the build must not outlive the ladder
            if proc.is_alive():
                proc.terminate()
                proc.join()
        if proc.exitcode != 0 or not done.is_file():
            raise RuntimeError(f"building rung {rung.name} failed (exit code {proc.exitcode}); see the messages above")
        write_text_atomic(done, json.dumps({**json.loads(done.read_text()), "peak_build_anon_bytes": peak_anon}))
    register_build(built, rung, rung_dir, vectors.rows)
    return json.loads(done.read_text())


def register_build(built: dict, rung: Rung, rung_dir: Path, rows: int) -> None:
    """Note a finished build in :func:`build_rung`'s ``built`` (the first of a kind is the one shared)."""
    if (rung_dir / "build.json").is_file():
        built.setdefault((rung.factory, rows), rung_dir)
        if coarse_key(rung.factory):
            built.setdefault(("coarse", coarse_key(rung.factory), rows), rung_dir)


def load_rung(rung: Rung, rung_dir: Path, vectors: DiskVectors, metric: str):
    """The rung's index as the server searches it: nprobe / efSearch set, the re-rank stage wrapped."""
    import faiss

    index = read_index(rung_dir)
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None and rung.nprobe:
        ivf.nprobe = min(rung.nprobe, ivf.nlist)
    if rung.ef:
        faiss.downcast_index(index).hnsw.efSearch = rung.ef
    layout = code_layout(index)
    if rung.rerank:
        index = RerankIndex(index, vectors, rung.rerank, metric)
    return index, layout


def search_speed(index, queries: np.ndarray, k: int, batch: int, budget_s: float = 3.0) -> float:
    """Queries per second searching ``queries`` in batches of ``batch`` (stops after ``budget_s``)."""
    index.search(queries[:batch], k)  # warm-up: first-touch page faults, lazy tables, the OpenMP pool
    done, t0 = 0, time.perf_counter()
    while done < len(queries):
        index.search(queries[done : done + batch], k)
        done += len(queries[done : done + batch])
        if time.perf_counter() - t0 > budget_s:
            break
    return done / (time.perf_counter() - t0)


def index_bytes_of(rung_dir: Path) -> int:
    return sum((rung_dir / f).stat().st_size for f in ("index.faiss", "index.ivfdata") if (rung_dir / f).is_file())


def measure_rung(rung: Rung, rung_dir: Path, vectors: DiskVectors, metric: str, queries: np.ndarray, truth: np.ndarray,
                 threads: int) -> tuple[dict, np.ndarray]:  # fmt: skip
    """In-process measurements of a built rung: recall vs ``truth``, bytes, q/s. Returns (record, top-10 ids)."""
    import faiss

    faiss.omp_set_num_threads(threads)
    rss0 = current_rss_bytes()
    index, layout = load_rung(rung, rung_dir, vectors, metric)
    _, found = index.search(np.ascontiguousarray(queries, dtype=np.float32), max(KS))
    rss_growth = current_rss_bytes() - rss0
    n_bytes = index_bytes_of(rung_dir)
    rec = {
        "name": rung.name, "factory": rung.factory, "nprobe": rung.nprobe, "ef": rung.ef, "rerank": rung.rerank,
        **{f"recall_at_{k}": round(recall_at_k(found, truth, k), 4) for k in KS},
        "bytes_per_passage": round(n_bytes / vectors.rows, 1), "index_bytes": n_bytes,
        "disk_bytes": n_bytes + (vectors.nbytes if rung.rerank else 0), "rss_growth_bytes": int(rss_growth),
        "qps_batch1": round(search_speed(index, queries, 10, 1), 1), "qps_batch32": round(search_speed(index, queries, 10, 32), 1),
        "layout": layout,
    }  # fmt: skip
    del index
    return rec, found


# ----------------------------------------------------------------------------- questions and the source index


def read_questions(spec: str, n: int) -> tuple[list[str], list[list[str]]]:
    """(questions, gold answers) of a bundled QA set name or a jsonl(.gz) file."""
    path = Path(spec)
    if not path.is_file():
        path = DATA_DIR / "qa" / spec / "test.jsonl.gz"
        if not path.is_file():
            names = sorted(p.name for p in (DATA_DIR / "qa").iterdir() if (p / "test.jsonl.gz").is_file())
            raise FileNotFoundError(f"--questions {spec!r} is neither a file nor a bundled QA set ({', '.join(names)})")
    opener = gzip.open if path.suffix == ".gz" else open
    qs, answers = [], []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if len(qs) == n:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            if "question" not in row:
                raise ValueError(f"{path}: every line needs a 'question' (and 'golden_answers' or 'answers')")
            qs.append(row["question"])
            gold = row.get("golden_answers", row.get("answers", []))
            answers.append([gold] if isinstance(gold, str) else [str(a) for a in gold])
    if not qs:
        raise ValueError(f"{path} holds no questions")
    return qs, answers


def ensure_source_index(cfg: LadderConfig, log) -> dict:
    """``cfg.index``'s meta.json, building it from ``cfg.vectors`` first when asked and absent."""
    from retriever.index_builder import BuildConfig, build_index
    from retriever.index_files import META_FILE, read_meta

    if not (Path(cfg.index) / META_FILE).is_file() and cfg.vectors is not None:
        log(f"building the source index {cfg.index} from {cfg.vectors} (Flat, no encoding) ...")
        corpus = cfg.corpus if cfg.corpus is not None else str(DATA_DIR / "corpus" / "wiki_mini.jsonl.gz")
        build_index(BuildConfig(corpus=corpus, out=cfg.index, vectors=cfg.vectors, device="cpu", progress=cfg.progress), log=log)
    return read_meta(cfg.index)


def make_rung_dir(rung: Rung, rung_dir: Path, source: Path, meta: dict) -> None:
    """Make ``rung_dir`` a servable index directory: symlinks to the source's document store and
    embeddings, and a meta.json describing the rung (its fingerprint recomputed)."""
    from retriever.corpus import CONTENTS_FILE, ID_OFFSETS_FILE, IDS_FILE, OFFSETS_FILE
    from retriever.fingerprint import index_fingerprint
    from retriever.index_files import EMB_DIR, META_FILE

    rung_dir.mkdir(parents=True, exist_ok=True)
    for name in (CONTENTS_FILE, OFFSETS_FILE, IDS_FILE, ID_OFFSETS_FILE, EMB_DIR):
        link = rung_dir / name
        if not link.exists():
            link.symlink_to((source / name).resolve())
    rmeta = {**meta, "index_type": rung.factory, "nprobe": rung.nprobe or meta.get("nprobe"), "rerank_depth": rung.rerank or None,
             "ladder": {"rung": rung.name, "source": str(source.resolve())}}  # fmt: skip
    rmeta.pop("fingerprint", None)
    enc_sha = (meta.get("fingerprint") or {}).get("encoder_sha256")
    if enc_sha:
        rmeta["fingerprint"] = index_fingerprint(rmeta, encoder_sha256=enc_sha)
    write_text_atomic(rung_dir / META_FILE, json.dumps(rmeta, indent=2))


# ----------------------------------------------------------------------------- the command


def serve_measure(rung_dir: Path, questions: list[str], concurrency: int, seconds: float) -> dict:
    """q/s and latency of ``rung_dir`` through a real ``emapg serve`` process (query cache off), and the
    server's resident memory after the run (encoder and libraries included)."""
    from retriever.launch import RetrieverServer
    from retriever.loadgen import closed_loop

    with RetrieverServer(rung_dir, extra_args=["--query-cache-size", "0"], omp_num_threads=1) as server:
        res = closed_loop(server.url, questions, concurrency=concurrency, seconds=seconds)
        res["server_rss_bytes"] = rss_of(server.proc.pid)
    return res


def rss_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS")), None)
    except OSError:
        return None


def run_ladder(cfg: LadderConfig, log=print) -> dict:
    """Build, measure and rank every rung; write ``<out>/results.json``; return it."""
    import faiss
    from tqdm import tqdm

    from retriever.encoder import Encoder, EncoderSpec
    from retriever.index_files import EMB_DIR

    cfg.validate()
    meta = ensure_source_index(cfg, log)
    source, out = Path(cfg.index), Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    vectors = DiskVectors(source / EMB_DIR, meta["chunk_size"], meta["rows"])
    rows, dim, metric = vectors.rows, vectors.dim, meta["metric"]
    rungs = [parse_rung(r) for r in cfg.rungs] if cfg.rungs else default_rungs(rows, dim)
    if rungs[0].factory != "Flat" or rungs[0].rerank or rungs[0].nprobe:
        rungs = [Rung("Flat"), *[r for r in rungs if r != Rung("Flat")]]

    questions, answers = read_questions(cfg.questions, cfg.n_questions)
    qcache = out / f"queries-{len(questions)}.npy"
    if qcache.is_file():
        qvec = np.load(qcache)
    else:
        log(f"encoding {len(questions)} questions with {meta['encoder']['name']} ...")
        enc = Encoder(EncoderSpec.from_dict(meta["encoder"]), device="cpu")
        qvec = enc.encode_queries(questions, batch_size=64).astype(np.float32)
        enc.close()
        np.save(qcache, qvec)
    faiss.omp_set_num_threads(cfg.threads)
    _, truth = exact_topk(vectors, qvec, max(KS), metric)

    from retriever.corpus import DocStore

    store = DocStore(source)
    results: list[dict] = []
    built: dict = {}  # rungs share builds (the same factory) and coarse quantizers (the same IVF lists)
    bar = tqdm(rungs, desc="ladder", unit="rung", disable=not cfg.progress)
    for rung in bar:
        bar.set_postfix_str(rung.name)
        rdir = out / rung.slug
        stored = rdir / RESULT_FILE
        if stored.is_file():
            rec = json.loads(stored.read_text())
            if rec.get("name") == rung.name and rec.get("questions") == [cfg.questions, len(questions)]:
                results.append({**rec, "resumed": True})  # measured by an earlier run
                register_build(built, rung, rdir, rows)
                continue
        make_rung_dir(rung, rdir, source, meta)
        build = build_rung(rung, rdir, vectors, metric, train_sample=cfg.train_sample, seed=cfg.seed,
                           max_build_ram_mb=cfg.max_build_ram_mb, threads=cfg.threads, built=built)  # fmt: skip
        rec, found = measure_rung(rung, rdir, vectors, metric, qvec, truth, cfg.threads)
        texts = [store.contents(row[row >= 0]) for row in found]
        rec.update(build_seconds=build["build_seconds"], peak_build_rss_bytes=build["peak_build_rss_bytes"],
                   peak_build_anon_bytes=build.get("peak_build_anon_bytes"), coarse_quantizer_from=build.get("coarse_quantizer_from"),
                   **{f"answer_recall_at_{k}": round(answer_recall(texts, answers, k), 4) for k in KS},
                   questions=[cfg.questions, len(questions)])  # fmt: skip
        if cfg.serve and (not cfg.serve_only or rung.name in cfg.serve_only or rung.factory == "Flat" and not rung.rerank):
            served = serve_measure(rdir, questions, cfg.concurrency, cfg.load_seconds)
            rec.update(qps_c32=served["qps"], p50_ms=served["p50_ms"], p99_ms=served["p99_ms"], server=served)
        else:
            rec.update(qps_c32=None, p50_ms=None, p99_ms=None)
        write_text_atomic(stored, json.dumps(rec, indent=1))
        results.append(rec)
    bar.close()

    target_dim = cfg.dim or dim
    flat = results[0]
    for rec in results:
        rec["target"] = extrapolate(rec["layout"], rec["index_bytes"], rows, dim, cfg.target_rows, target_dim, bool(rec["rerank"]))
        rec["answer_recall_vs_flat"] = round(rec["answer_recall_at_3"] / flat["answer_recall_at_3"], 4) if flat["answer_recall_at_3"] else None
        rec["qps_c32_vs_flat"] = round(rec["qps_c32"] / flat["qps_c32"], 3) if rec.get("qps_c32") and flat.get("qps_c32") else None
    best = recommend(results, cfg.recall_floor)
    report = {
        "source": {"index": str(source.resolve()), "rows": rows, "dim": dim, "metric": metric, "emb_dtype": str(vectors.dtype),
                   "encoder": meta["encoder"]["name"]},
        "questions": {"set": cfg.questions, "n": len(questions)},
        "settings": {"recall_floor": cfg.recall_floor, "train_sample": cfg.train_sample, "seed": cfg.seed, "threads": cfg.threads,
                     "concurrency": cfg.concurrency, "load_seconds": cfg.load_seconds, "max_build_ram_mb": cfg.max_build_ram_mb},
        "target": {"rows": cfg.target_rows, "dim": target_dim},
        "rungs": results,
        "recommended": best,
        "recommended_target": next((r["target"] for r in results if r["name"] == best), None),
    }  # fmt: skip
    write_text_atomic(out / RESULTS_FILE, json.dumps(report, indent=1))
    return report


def format_table(report: dict) -> str:
    """The ladder as a fixed-width table (what ``emapg index ladder`` prints to stderr)."""
    cols = ("name", "recall@1", "recall@3", "recall@10", "ans@3", "B/psg", "build s", "peak MB", "q/s b1", "q/s b32", "q/s c32",
            "p99 ms", "target GiB")  # fmt: skip
    lines = []
    for r in report["rungs"]:
        lines.append((r["name"], f"{r['recall_at_1']:.3f}", f"{r['recall_at_3']:.3f}", f"{r['recall_at_10']:.3f}",
                      f"{r['answer_recall_at_3']:.3f}", f"{r['bytes_per_passage']:.0f}", f"{r['build_seconds']:.1f}",
                      f"{r['peak_build_rss_bytes'] / 2**20:.0f}", f"{r['qps_batch1']:.0f}", f"{r['qps_batch32']:.0f}",
                      "-" if r.get("qps_c32") is None else f"{r['qps_c32']:.0f}", "-" if r.get("p99_ms") is None else f"{r['p99_ms']:.0f}",
                      f"{r['target']['ram_gib']:.1f}"))  # fmt: skip
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    t = report["target"]
    body = [fmt.format(*cols), *(fmt.format(*line) for line in lines)]
    best = report["recommended"]
    body.append(f"target: {t['rows']:,} x {t['dim']}; recommended (recall@3 >= {report['settings']['recall_floor']} of Flat, "
                f"fewest bytes/passage): {best or 'none meets the floor'}"
                + (f" -> {report['recommended_target']['ram_gib']} GiB RAM" if best else ""))  # fmt: skip
    return "\n".join(body)


if __name__ == "__main__":  # pragma: no cover - `emapg index ladder` is the entry point
    sys.exit("use `emapg index ladder`")
