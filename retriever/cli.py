"""``emapg index build|info`` and ``emapg serve``: argument parsing only; the work is elsewhere."""

from __future__ import annotations

import argparse
import json
import os
import sys

from emapg.errors import UserError


def _index_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="emapg index", description="Build or inspect a dense (FAISS) + optional BM25 index of a passage corpus.")
    sub = p.add_subparsers(dest="action", metavar="<build|info>")
    b = sub.add_parser(
        "build",
        help="encode a corpus and build the index (resumable)",
        description="Encode a Search-R1 style corpus ({'id','contents'} jsonl or jsonl.gz) and build a FAISS index. "
        "Encoding is chunked to disk: rerunning the same command after an interruption resumes from the last finished chunk.",
    )
    b.add_argument("--corpus", required=True, help="corpus file: jsonl or jsonl.gz with {'id', 'contents': '\"Title\"\\ntext'} rows (or 'title' + 'text')")
    b.add_argument("--out", required=True, help="index directory to create (or to resume)")
    b.add_argument("--encoder", default="minilm", help="encoder model: alias (minilm), local folder or hub name (default: minilm)")
    b.add_argument("--pooling", choices=["mean", "cls"], default=None, help="pooling over token states (default: from the known-model table or the sentence-transformers config, else mean)")
    b.add_argument("--query-prefix", default=None, help="text prepended to every query, e.g. 'query: ' for e5 (default: exact-name table, else none); stored in meta.json")
    b.add_argument("--passage-prefix", default=None, help="text prepended to every passage, e.g. 'passage: ' for e5 (default: exact-name table, else none); stored in meta.json")
    b.add_argument("--max-length", type=int, default=256, help="max tokens per passage/query (default 256)")
    b.add_argument("--index-type", default="Flat", help="any faiss index_factory string: Flat, HNSW32, IVF256,SQ8, IVF256,PQ16, ... (default Flat)")
    b.add_argument("--metric", choices=["ip", "l2"], default="ip", help="inner product (cosine on normalised vectors) or L2 (default ip)")
    b.add_argument("--bm25", action="store_true", help="also build a BM25 index (bm25s) for --hybrid-bm25 serving")
    b.add_argument("--chunk-size", type=int, default=8192, help="passages per embedding chunk file = resume granularity (default 8192)")
    b.add_argument("--batch-size", type=int, default=64, help="passages per encoder forward pass (default 64)")
    b.add_argument("--device", default="auto", help="auto, cpu, cuda (all GPUs) or cuda:N (default auto)")
    b.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=None, help="fp16 encoding (default: on for GPU, off for CPU, where it is 3.5x slower)")
    b.add_argument("--bf16", action="store_true", help="bf16 encoding: opt-in for CPUs with bf16 instructions (about 1.8x faster; fp32 is the CPU default)")
    b.add_argument("--train-sample", type=int, default=100_000, help="vectors sampled (seeded) to train IVF/PQ index types (default 100000)")
    b.add_argument("--nprobe", type=int, default=16, help="IVF lists probed per query at serve time, stored in meta.json (default 16)")
    b.add_argument("--seed", type=int, default=0, help="seed of the training sample (default 0)")
    b.add_argument("--limit", type=int, default=None, help="index only the first N passages (for quick tries)")
    b.add_argument("--overwrite", action="store_true", help="delete an existing (finished or partial) index at --out first")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    i = sub.add_parser("info", help="print an index's meta.json and file sizes", description="Print an index directory's settings (meta.json) and file sizes as JSON.")
    i.add_argument("dir", help="index directory")
    return p


def index_main(argv: list[str]) -> int:
    parser = _index_parser()
    args = parser.parse_args(argv)
    if args.action is None:
        parser.print_help()
        return 2
    if args.action == "info":
        from retriever.index_builder import index_info

        try:
            info = index_info(args.dir)
        except FileNotFoundError as e:
            raise UserError(str(e)) from None
        print(json.dumps(info, indent=2))
        return 0

    from retriever.corpus import CorpusError
    from retriever.index_builder import BuildConfig, build_index

    cfg = BuildConfig(
        corpus=args.corpus,
        out=args.out,
        encoder=args.encoder,
        pooling=args.pooling,
        query_prefix=args.query_prefix,
        passage_prefix=args.passage_prefix,
        max_length=args.max_length,
        index_type=args.index_type,
        metric=args.metric,
        bm25=args.bm25,
        chunk_size=args.chunk_size,
        batch_size=args.batch_size,
        device=args.device,
        fp16=args.fp16,
        bf16=args.bf16,
        train_sample=args.train_sample,
        nprobe=args.nprobe,
        seed=args.seed,
        limit=args.limit,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    try:
        res = build_index(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    except (FileNotFoundError, FileExistsError, CorpusError, ValueError) as e:
        raise UserError(str(e)) from None
    print(
        json.dumps(
            {
                "out": str(res.out),
                "rows": res.rows,
                "chunks_total": res.chunks_total,
                "chunks_encoded": res.chunks_encoded,
                "chunks_reused": res.chunks_reused,
                "empty_passages_skipped": res.empty_skipped,
                "passages_per_s": round(res.passages_per_s, 2),
                "total_seconds": round(res.total_seconds, 2),
            }
        )
    )
    return 0


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="emapg serve",
        description="Serve an index over HTTP. POST /retrieve is request/response compatible with Search-R1's retrieval server; "
        "also GET /health, GET /metrics (Prometheus text) and /openapi.json. Concurrent requests are micro-batched together.",
    )
    p.add_argument("--index", required=True, help="index directory built by `emapg index build`")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; use 0.0.0.0 only behind an API key or a firewall)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--topk", type=int, default=3, help="hits per query when a request gives no topk (default 3)")
    p.add_argument("--max-topk", type=int, default=100, help="largest topk a request may ask for (default 100)")
    p.add_argument("--max-batch", type=int, default=64, help="most queries encoded together across requests; 1 disables micro-batching (default 64)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="how long the first query of a batch may wait for company when traffic is concurrent; a lone client never waits (default 5 ms)")
    p.add_argument("--api-key", default=None, help="require this key in 'Authorization: Bearer KEY' or 'X-API-Key: KEY' (default: $EMAPG_RETRIEVER_API_KEY, else no key)")
    p.add_argument("--max-queries-per-request", type=int, default=4096, help="reject requests with more queries (default 4096; Search-R1 sends a whole rollout batch in one request)")
    p.add_argument("--max-query-chars", type=int, default=2000, help="reject queries longer than this many characters (default 2000)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="reject request bodies larger than this (default 4 MiB)")
    p.add_argument("--device", default="auto", help="encoder device: auto, cpu, cuda (all GPUs) or cuda:N (default auto)")
    p.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=None, help="fp16 encoder and GPU index (default: on with GPU, off on CPU)")
    p.add_argument("--bf16", action="store_true", help="bf16 query encoder: opt-in for CPUs with bf16 instructions (about 1.8x faster batches; fp32 is the CPU default)")
    p.add_argument("--gpu-shards", type=int, default=-1, help="GPUs for the FAISS index when the encoder is on GPU: -1 all, 0 keep index on CPU, N first N (default -1)")
    p.add_argument("--gpu-replicate", action="store_true", help="replicate the index on each GPU instead of sharding it (more memory, more throughput)")
    p.add_argument("--hybrid-bm25", action="store_true", help="fuse dense and BM25 rankings by reciprocal-rank fusion (index built with --bm25)")
    p.add_argument("--rrf-k", type=int, default=60, help="RRF constant k in 1/(k + rank) (default 60)")
    p.add_argument("--nprobe", type=int, default=None, help="IVF lists probed per query (default: the value in meta.json)")
    p.add_argument("--encode-batch-size", type=int, default=64, help="queries per encoder forward pass inside a batch (default 64)")
    p.add_argument("--query-cache-size", type=int, default=4096, help="LRU of query embeddings; repeated queries (GRPO groups) skip the encoder; 0 disables (default 4096)")
    p.add_argument("--encoder", default=None, help="assert the index was built with this encoder; refuse to start otherwise")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level (default info)")
    return p


def serve_main(argv: list[str]) -> int:
    args = _serve_parser().parse_args(argv)
    from retriever.searcher import EncoderMismatchError
    from retriever.server import ServeConfig, serve

    api_key = args.api_key if args.api_key is not None else os.environ.get("EMAPG_RETRIEVER_API_KEY") or None
    cfg = ServeConfig(
        index=args.index,
        host=args.host,
        port=args.port,
        topk=args.topk,
        max_topk=args.max_topk,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        api_key=api_key,
        max_queries_per_request=args.max_queries_per_request,
        max_query_chars=args.max_query_chars,
        max_body_bytes=args.max_body_bytes,
        device=args.device,
        fp16=args.fp16,
        bf16=args.bf16,
        gpu_shards=args.gpu_shards,
        gpu_replicate=args.gpu_replicate,
        hybrid_bm25=args.hybrid_bm25,
        rrf_k=args.rrf_k,
        nprobe=args.nprobe,
        encode_batch_size=args.encode_batch_size,
        query_cache_size=args.query_cache_size,
        encoder=args.encoder,
        log_level=args.log_level,
    )
    try:
        return serve(cfg)
    except (FileNotFoundError, EncoderMismatchError, ValueError) as e:
        raise UserError(str(e)) from None
