"""``emapg eval``: evaluate a model on the QA or math suite; ``emapg eval compare`` for reports.

    emapg eval --model PATH_OR_NAME --suite qa|math --limit N --out DIR [options]
    emapg eval compare RUN_DIR [RUN_DIR ...] --out DIR [--no-paper]

Every option comes from a config dataclass (:class:`eval.runner.EvalConfig` with its
:class:`eval.protocols.EvalProtocol`, :class:`CompareConfig`) through
:func:`emapg.config.add_config_arguments`: the help is written once, on the field. This is an
application module: no library module imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass

from emapg.config import ConfigError, add_config_arguments, config_from_args, option, to_dict
from emapg.errors import UserError
from eval.protocols import DEFAULT_PROTOCOL, PROTOCOLS, EvalProtocol, get_protocol
from eval.runner import EvalConfig

#: The eval command's established flag spellings: protocol fields without the ``protocol-`` prefix
#: (``--n``, ``--temperature``, ...), ``--topk`` for the retrieval top-k, ``--data-path NAME=FILE``.
EVAL_FLAGS: dict[str, str] = {
    **{f"protocol.{f.name}": "--" + f.name.replace("_", "-") for f in dataclasses.fields(EvalProtocol)},
    "protocol.retrieval_topk": "--topk",
    "data_paths": "--data-path",
    "preset": "--protocol",
}
# Not options: the protocol's label is the preset's name; the API key is read from the environment
# (a command line is visible to every user of the machine in `ps`).
EVAL_EXCLUDE = ("protocol.name", "retriever_api_key", "engine_api_key")
API_KEY_ENV = "EMAPG_RETRIEVER_API_KEY"
ENGINE_API_KEY_ENV = "EMAPG_ENGINE_API_KEY"


@dataclass
class ProtocolPreset:
    """Which protocol preset the sampling and scoring options override (command line only)."""

    preset: str | None = option(
        None, help=f"settings preset: {', '.join(PROTOCOLS)} (default: {DEFAULT_PROTOCOL['qa']} for qa, "
        f"{DEFAULT_PROTOCOL['math']} for math, or the --suite of the preset given); the protocol options "
        "(--n ... --grade-timeout) override it and take their defaults from it")


@dataclass
class CompareConfig:
    """``emapg eval compare``: evaluation runs side by side."""

    runs: list[str] = option(help="run folders written by `emapg eval`")
    out: str = option(help="folder for report.md, comparison.json and plots")
    paper: bool = option(True, help="add the paper's published numbers, as a table of their own headed as another model at "
                                    "another scale (never columns or bars beside the runs')")
    allow_mismatch: bool = option(False, help="compare runs whose index fingerprint or protocol differ (listed as warnings in "
                                  "the report) instead of refusing")


def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="emapg eval",
        description="Evaluate a model through the training rollout loop and engines. Writes DIR/items/<dataset>.jsonl "
        "(per question), DIR/results.json and DIR/report.md (+ plots). A rerun with the same settings resumes. "
        "Library output (vLLM, transformers and torch logs and warnings, the engine's subprocesses) goes to "
        "DIR/eval.log, appended to on each run; the console gets progress and the results table. "
        f"The retriever's API key, if it needs one, is read from ${API_KEY_ENV}. "
        "`emapg eval compare RUN_DIR... --out DIR` puts runs side by side (the paper's numbers in a table of their own).",
    )
    add_config_arguments(p, ProtocolPreset, flags=EVAL_FLAGS)
    add_config_arguments(p, EvalConfig, exclude=EVAL_EXCLUDE, flags=EVAL_FLAGS, hide_defaults=("protocol.",))
    p.add_argument("--quiet", dest="progress", action="store_false", default=argparse.SUPPRESS, help="no progress (= --no-progress)")
    return p


def compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="emapg eval compare",
                                description="Side-by-side report of evaluation runs (markdown, JSON, PNG), with the "
                                "paper's published numbers in a table of their own (another model, another scale).")
    add_config_arguments(p, CompareConfig, positional=("runs",))
    return p


def build_config(args: argparse.Namespace) -> EvalConfig:
    """The validated :class:`EvalConfig` of a parsed ``emapg eval`` command line."""
    values = dict(vars(args))
    preset = values.pop("preset", None)
    suite = values.get("protocol.suite")
    name = preset or DEFAULT_PROTOCOL[suite or "qa"]
    base = get_protocol(name)
    if suite is not None and base.suite != suite:
        raise UserError(f"protocol {name!r} is for the {base.suite} suite, not --suite {suite}")
    overrides = {k.removeprefix("protocol."): v for k, v in values.items() if k.startswith("protocol.")}
    protocol = get_protocol(name, **overrides)
    rest = argparse.Namespace(**{k: v for k, v in values.items() if not k.startswith("protocol.")})
    return config_from_args(EvalConfig, rest, extra={"protocol": to_dict(protocol),
                                                     "retriever_api_key": os.environ.get(API_KEY_ENV) or None,
                                                     "engine_api_key": os.environ.get(ENGINE_API_KEY_ENV) or None})


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compare":
        from eval.report import compare_runs

        cmp = config_from_args(CompareConfig, compare_parser().parse_args(argv[1:]))
        data = compare_runs(cmp.runs, cmp.out, with_paper=cmp.paper, allow_mismatch=cmp.allow_mismatch)
        print(f"compared {len(data['runs'])} run(s): {os.path.join(cmp.out, 'report.md')}")
        return 0
    args = eval_parser().parse_args(argv)
    try:
        cfg = build_config(args)
    except ConfigError as e:
        raise UserError(str(e)) from None
    from emapg.console import library_output_to
    from eval.report import contamination_line, results_table
    from eval.runner import run_eval

    log = os.path.join(cfg.out, "eval.log")
    with library_output_to(log, title="emapg eval " + " ".join(argv), discard_unused=True):
        results = run_eval(cfg)
    if results.get("engine") not in (None, cfg.engine):  # e.g. vLLM could not be imported (the reason is in the log)
        print(f"emapg eval: ran on the {results['engine']} engine, not {cfg.engine} (see {log})", file=sys.stderr)
    print(results_table(results))
    print(contamination_line(results).replace("**", ""))
    if results.get("trained_on"):
        print("\nscored apart (trained on; in no average above):\n" + results_table(results, part="trained_on"))
    print(f"\nresults: {os.path.join(cfg.out, 'results.json')}  report: {os.path.join(cfg.out, 'report.md')}  log: {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
