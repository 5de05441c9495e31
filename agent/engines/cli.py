"""``emapg engine serve``: run a generation engine as a separate server (agent/engines/server.py).

The options are generated from :class:`agent.engines.server.EngineServeConfig` (help written once).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from emapg.config import add_config_arguments, config_from_args
from emapg.errors import UserError


def serve_parser() -> argparse.ArgumentParser:
    from agent.engines.server import EngineServeConfig

    p = argparse.ArgumentParser(
        prog="emapg engine serve",
        description="Serve a generation engine over HTTP for the trainer (rollout.engine=remote): POST /generate "
        "(token ids in, token ids + log-probs out), POST /score, weight sync (http buckets or a collective "
        "broadcast), POST /sleep and /wake, GET /health and /metrics. Concurrent requests are batched together. "
        "API key: put it in a file (--api-key-file) or in $EMAPG_ENGINE_API_KEY; /health and /openapi.json stay open.",
    )
    add_config_arguments(p, EngineServeConfig)
    return p


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="emapg engine", description="Generation engine as a separate server.")
    sub = p.add_subparsers(dest="action", metavar="<action>")
    sub.add_parser("serve", help="serve a vLLM or transformers engine over HTTP", add_help=False)
    if not argv or argv[0] != "serve":
        p.parse_args(argv)  # --help, or an error for unknown actions
        p.print_help()
        return 2
    args = serve_parser().parse_args(argv[1:])
    from agent.engines.server import EngineServeConfig, serve

    cfg = config_from_args(EngineServeConfig, args)
    if cfg.model.startswith(("/", "./", "../", "~")) and not Path(cfg.model).expanduser().is_dir():
        raise UserError(f"--model {cfg.model}: no such model folder")  # before binding the port
    try:
        return serve(cfg)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None
