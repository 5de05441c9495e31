"""The ``emapg`` command: one entry point, one subcommand per job.

Each subcommand lives in the package that owns it and exposes ``main(argv) -> int``;
this module only dispatches, so ``emapg --help`` stays fast (nothing heavy is imported).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from emapg import __version__
from emapg.errors import ConfigError, UserError

__all__ = ["COMMANDS", "UserError", "main"]  # UserError stays importable from here for scripts written against it


# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "index": ("retriever.cli", "index_main", "build or inspect a FAISS/BM25 index of a passage corpus"),
    "serve": ("retriever.cli", "serve_main", "serve an index over HTTP (Search-R1 compatible /retrieve)"),
    "router": ("retriever.cli", "router_main", "one /retrieve over a sharded index: fan-out, exact merge, deadlines, health gating"),
    "engine": ("agent.engines.cli", "main", "serve a vLLM or transformers generation engine over HTTP for remote rollouts"),
    "train": ("trainer.cli", "main", "train a policy with EMA-PG or GRPO from a YAML config"),
    "plan": ("trainer.plan.cli", "main", "will a training config fit, how long, what will it cost: memory, step time, run hours"),
    "sft": ("trainer.cli", "sft_main", "warm-start a search agent: fine-tune on trajectories, observations masked out of the loss"),
    "export": ("trainer.cli", "export_main", "write a trained policy (a LoRA run merged into its base) as a plain HF folder"),
    "eval": ("eval.cli", "main", "evaluate a model on the QA or math suites; `eval compare` for side-by-side reports"),
    "plot": ("trainer.plot", "main", "plot training curves of one or several runs to PNG"),
    "demo": ("app.demo", "main", "the whole pipeline on bundled data: index, serve, train, eval, report"),
    "view": ("app.viewer.server", "main", "a local web page of runs: curves, trajectories, eval items, two checkpoints compared"),
    "data": ("app.data_cli", "main", "audit which questions an index can answer: gold in the corpus, in the first search, after a second search"),
    "models": ("app.model_cli", "main", "prepare the offline default models (convert SmolLM2, locate MiniLM)"),
    "config": ("app.config_cli", "main", "show a config with overrides applied, or the reference of all options"),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="emapg",
        description="ema-pg: train and evaluate LLM search agents and math reasoners with EMA-PG "
        "(EMA anchor + Top-k KL on GRPO). Run `emapg <command> --help` for a command's options.",
    )
    p.add_argument("--version", action="version", version=f"emapg {__version__}")
    sub = p.add_subparsers(dest="command", metavar="<command>")
    for name, (_, _, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = _parser()
    if not argv or argv[0] not in COMMANDS:
        if argv and not argv[0].startswith("-"):
            parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
        parser.parse_args(argv)  # handles --help / --version
        parser.print_help()
        return 2
    module_name, func_name, _ = COMMANDS[argv[0]]
    module = importlib.import_module(module_name)
    try:
        return int(getattr(module, func_name)(argv[1:]) or 0)
    except (UserError, ConfigError) as e:
        print(f"emapg {argv[0]}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"emapg {argv[0]}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Run through the importable module: as __main__, this file's UserError would be a second class,
    # distinct from the one subcommands raise, and user errors would end in a traceback.
    from app.cli import main as _main

    sys.exit(_main())
