"""``emapg index build|info`` and ``emapg serve``: argument parsing only; the work is elsewhere."""

from __future__ import annotations

import argparse
import json
import sys

from emapg.config import add_config_arguments, config_from_args
from emapg.errors import UserError


def index_parser() -> argparse.ArgumentParser:
    from retriever.index_builder import BuildConfig

    p = argparse.ArgumentParser(prog="emapg index", description="Build or inspect a dense (FAISS) + optional BM25 index of a passage corpus.")
    sub = p.add_subparsers(dest="action", metavar="<build|info>")
    b = sub.add_parser(
        "build",
        help="encode a corpus and build the index (resumable)",
        description="Encode a Search-R1 style corpus ({'id','contents'} jsonl or jsonl.gz) and build a FAISS index. "
        "Encoding is chunked to disk: rerunning the same command after an interruption resumes from the last finished chunk.",
    )
    add_config_arguments(b, BuildConfig)
    i = sub.add_parser("info", help="print an index's meta.json and file sizes", description="Print an index directory's settings (meta.json) and file sizes as JSON.")
    i.add_argument("dir", help="index directory")
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


def serve_parser() -> argparse.ArgumentParser:
    from retriever.server import ServeConfig

    p = argparse.ArgumentParser(
        prog="emapg serve",
        description="Serve an index over HTTP. POST /retrieve is request/response compatible with Search-R1's retrieval server; "
        "also GET /health, GET /metrics (Prometheus text) and /openapi.json. Concurrent requests are micro-batched together. "
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
