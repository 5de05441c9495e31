"""``emapg index build|info|ladder|shard``, ``emapg serve`` and ``emapg router``: argument parsing only; the work is elsewhere."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from emapg.config import add_config_arguments, config_from_args
from emapg.errors import UserError


def index_parser() -> argparse.ArgumentParser:
    from retriever.index_builder import BuildConfig

    p = argparse.ArgumentParser(prog="emapg index", description="Build or inspect a dense (FAISS) + optional BM25 index of a passage corpus.")
    from retriever.ladder import LadderConfig

    sub = p.add_subparsers(dest="action", metavar="<build|info|ladder|shard>")
    b = sub.add_parser(
        "build",
        help="encode a corpus and build the index (resumable)",
        description="Encode a Search-R1 style corpus ({'id','contents'} jsonl or jsonl.gz) and build a FAISS index. "
        "Encoding is chunked to disk: rerunning the same command after an interruption resumes from the last finished chunk.",
    )
    add_config_arguments(b, BuildConfig)
    i = sub.add_parser("info", help="print an index's meta.json and file sizes", description="Print an index directory's settings (meta.json) and file sizes as JSON.")
    i.add_argument("dir", help="index directory")
    lad = sub.add_parser(
        "ladder",
        help="build compressed candidates of an index and measure recall vs Flat, memory and speed (resumable)",
        description="Build a ladder of compressed indexes (fp16, SQ8, IVF, PQ, OPQ, HNSW, IVF-PQ re-ranked from disk) from a built "
        "index's vectors; measure recall@1/3/10 against Flat, answer recall on a QA set, bytes per passage, build time and "
        "peak RAM, q/s in-process and through a real server; extrapolate memory to --target-rows x --dim; recommend the "
        "cheapest rung meeting --recall-floor. Prints a table, writes <out>/results.json; a rerun resumes.",
    )
    add_config_arguments(lad, LadderConfig)
    from retriever.sharding import ShardConfig

    sh = sub.add_parser("shard", help="split an index into contiguous shards, one servable index directory each",
                        description="Split a built index into N shard directories (contiguous row ranges; each its own "
                        "`emapg serve`), for `emapg router`. Flat shards return exactly the unsharded index's hits.")  # fmt: skip
    add_config_arguments(sh, ShardConfig)
    return p


def index_main(argv: list[str]) -> int:
    parser = index_parser()
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

    if args.action == "ladder":
        return _ladder_main(args)
    if args.action == "shard":
        return _shard_main(args)
    from retriever.corpus import CorpusError
    from retriever.index_builder import BuildConfig, build_index

    cfg = config_from_args(BuildConfig, args)  # ignores "action"
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


def _ladder_main(args: argparse.Namespace) -> int:
    from retriever.corpus import CorpusError
    from retriever.ladder import LadderConfig, format_table, run_ladder

    cfg = config_from_args(LadderConfig, args)
    try:
        report = run_ladder(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    except (FileNotFoundError, FileExistsError, CorpusError, ValueError) as e:
        raise UserError(str(e)) from None
    print(format_table(report), file=sys.stderr)
    print(json.dumps({"results": str(Path(cfg.out) / "results.json"), "recommended": report["recommended"],
                      "recommended_target": report["recommended_target"]}))  # fmt: skip
    return 0


def _shard_main(args: argparse.Namespace) -> int:
    from retriever.sharding import ShardConfig, shard_index

    cfg = config_from_args(ShardConfig, args)
    try:
        dirs = shard_index(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise UserError(str(e)) from None
    print(json.dumps({"shards": [str(d) for d in dirs]}))
    return 0


def serve_parser() -> argparse.ArgumentParser:
    from retriever.server import ServeConfig

    p = argparse.ArgumentParser(
        prog="emapg serve",
        description="Serve an index over HTTP. POST /retrieve is request/response compatible with Search-R1's retrieval server; "
        "also GET /health, GET /metrics (Prometheus text) and /openapi.json; with --mcp, an MCP server (Model Context Protocol, "
        "streamable HTTP) on /mcp with the tools search and search_batch over the same index. Concurrent requests are micro-batched together. "
        "API key: put it in a file (--api-key-file) or in $EMAPG_RETRIEVER_API_KEY; /health and /openapi.json stay open.",
    )
    add_config_arguments(p, ServeConfig)
    return p


def serve_main(argv: list[str]) -> int:
    args = serve_parser().parse_args(argv)
    from retriever.searcher import EncoderMismatchError
    from retriever.server import ServeConfig, serve

    try:
        return serve(config_from_args(ServeConfig, args))
    except (FileNotFoundError, EncoderMismatchError, ValueError) as e:
        raise UserError(str(e)) from None


def router_parser() -> argparse.ArgumentParser:
    from retriever.router import RouterConfig

    p = argparse.ArgumentParser(
        prog="emapg router",
        description="Serve one /retrieve (Search-R1 compatible, like `emapg serve`) over a sharded index: fan out to one replica "
        "of every shard (`emapg index shard`, one `emapg serve` each), merge the top-k exactly, per-shard deadline, health "
        "gating, per-shard latency in /metrics. A missing shard gives a 200 flagged 'partial', never a 5xx; 503 only when no "
        "shard answers.",
    )
    add_config_arguments(p, RouterConfig)
    return p


def router_main(argv: list[str]) -> int:
    args = router_parser().parse_args(argv)
    from retriever.router import RouterConfig, serve

    return serve(config_from_args(RouterConfig, args))
