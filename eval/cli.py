"""``emapg eval``: evaluate a model on the QA or math suite; ``emapg eval compare`` for reports.

    emapg eval --model PATH_OR_NAME --suite qa|math --limit N --out DIR [options]
    emapg eval compare RUN_DIR [RUN_DIR ...] --out DIR [--no-paper]
"""

from __future__ import annotations

import argparse
import os
import sys

from emapg.errors import UserError
from emapg.config import ConfigError


def _eval_parser() -> argparse.ArgumentParser:
    from eval.protocols import PROTOCOLS

    p = argparse.ArgumentParser(
        prog="emapg eval",
        description="Evaluate a model through the training rollout loop and engines. Writes DIR/items/<dataset>.jsonl "
        "(per question), DIR/results.json and DIR/report.md (+ plots). A rerun with the same settings resumes. "
        "`emapg eval compare RUN_DIR... --out DIR` puts runs side by side with the paper's numbers.",
    )
    p.add_argument("--model", required=True, help="checkpoint folder, alias (tiny-qwen2, smollm2-135m-instruct) or hub name")
    p.add_argument("--suite", choices=["qa", "math"], default="qa", help="qa: 7 search QA sets (EM); math: 5 math sets (pass@k)")
    p.add_argument("--out", required=True, help="output folder (a rerun with the same settings resumes)")
    p.add_argument("--limit", type=int, default=None, help="questions per dataset (deterministic seeded sample; default all)")
    p.add_argument("--datasets", default=None,
                   help="comma-separated dataset names (default: the whole suite), e.g. nq,hotpotqa,bamboogle")
    p.add_argument("--data-path", action="append", default=[], metavar="NAME=FILE",
                   help="use FILE (jsonl/json/parquet; FlashRAG or Search-R1 layout) for dataset NAME; repeatable")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the --limit sample")
    p.add_argument("--retriever-url", default=None, help="qa: URL of a running retrieval server (emapg serve)")
    p.add_argument("--index", default=None,
                   help="qa: index folder to serve for this run when no --retriever-url is given "
                   "(default: the bundled Wikipedia index, built on first use). API key: $EMAPG_RETRIEVER_API_KEY")
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm",
                   help="generation engine (default vllm; falls back to hf=transformers when vLLM is missing)")
    p.add_argument("--protocol", choices=sorted(PROTOCOLS), default=None,
                   help="settings preset (default: qa_greedy for qa, math_paper for math); the options below override it")
    p.add_argument("--n", type=int, default=None, help="samples per question")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per turn (qa) / per response (math)")
    p.add_argument("--max-turns", type=int, default=None, help="qa: maximum searches")
    p.add_argument("--topk", type=int, default=None, help="qa: passages per search")
    p.add_argument("--template", default=None, help="prompt template name or file")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--grader", choices=["math_verify", "mathd_or_math_verify"], default=None, help="math grader")
    p.add_argument("--grade-timeout", type=float, default=None, help="math: seconds per item before a grading timeout")
    p.add_argument("--grader-workers", type=int, default=2, help="math: grading worker processes")
    p.add_argument("--name", default=None, help="run label in reports (default: the --out folder name)")
    p.add_argument("--batch-size", type=int, default=32, help="questions per rollout batch (the unit of resume)")
    p.add_argument("--rollout-mode", choices=["batched", "async"], default="batched", help="rollout driver")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="emapg eval compare",
                                description="Side-by-side report of evaluation runs (markdown, JSON, PNG), with the "
                                "paper's published numbers as labelled reference columns.")
    p.add_argument("runs", nargs="+", help="run folders written by `emapg eval`")
    p.add_argument("--out", required=True, help="folder for report.md, comparison.json and plots")
    p.add_argument("--no-paper", action="store_true", help="leave out the paper's reference columns")
    return p


def _data_paths(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--data-path expects NAME=FILE, got {item!r}")
        out[name] = path
    return out


def build_config(args: argparse.Namespace):
    from eval.protocols import DEFAULT_PROTOCOL, get_protocol
    from eval.runner import EvalConfig

    name = args.protocol or DEFAULT_PROTOCOL[args.suite]
    protocol = get_protocol(
        name, n=args.n, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
        max_turns=args.max_turns, retrieval_topk=args.topk, template=args.template, seed=args.seed,
        grader=args.grader, grade_timeout=args.grade_timeout,
    )  # fmt: skip
    if protocol.suite != args.suite:
        raise UserError(f"protocol {name!r} is for the {protocol.suite} suite, not --suite {args.suite}")
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()] if args.datasets else []
    cfg = EvalConfig(
        model=args.model, out=args.out, protocol=protocol, datasets=datasets, data_paths=_data_paths(args.data_path),
        limit=args.limit, data_seed=args.data_seed, name=args.name, engine=args.engine, batch_size=args.batch_size,
        retriever_url=args.retriever_url, index=args.index,
        retriever_api_key=os.environ.get("EMAPG_RETRIEVER_API_KEY") or None,
        rollout_mode=args.rollout_mode, grader_workers=args.grader_workers, progress=not args.no_progress,
    )  # fmt: skip
    cfg.validate()
    return cfg


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compare":
        args = _compare_parser().parse_args(argv[1:])
        from eval.report import compare_runs

        data = compare_runs(args.runs, args.out, with_paper=not args.no_paper)
        print(f"compared {len(data['runs'])} run(s): {os.path.join(args.out, 'report.md')}")
        return 0
    args = _eval_parser().parse_args(argv)
    try:
        cfg = build_config(args)
    except ConfigError as e:
        raise UserError(str(e)) from None
    from eval.report import results_table
    from eval.runner import run_eval

    results = run_eval(cfg)
    print(results_table(results))
    print(f"\nresults: {os.path.join(cfg.out, 'results.json')}  report: {os.path.join(cfg.out, 'report.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
