"""``emapg data audit``: which questions of a dataset an index can answer, and with how many searches.

For each question (:mod:`tasks.coverage`): the gold answer is in the corpus at all; in the first search's top-k for
the question text; reachable by a second search (where supporting titles or a decomposition are known: the bundled
multi-hop file, ``--dataset multihop``, or a jsonl with ``support_titles`` / ``decomposition``); or in neither.
Prints a table per dataset and writes every question's class and evidence to a JSON file. Whether an index holds the
gold documents decides what RL can teach a search agent.

    emapg data audit --dataset multihop --dataset nq --limit 200 --out audit.json

An application module (the ``emapg`` command's top floor): no library module imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from emapg.config import ConfigError, add_config_arguments, config_from_args, option
from emapg.errors import UserError


@dataclass
class AuditConfig:
    """``emapg data audit``."""

    datasets: list[str] = option(["multihop"], help="what to audit (repeatable): 'multihop' (the bundled multi-hop "
                                 "questions with supporting titles, data/qa/multihop/), a registered QA dataset name, or a "
                                 "jsonl(.gz) file of rows {id, question, golden_answers[, support_titles, decomposition]}")
    split: str = option("test", help="split of a registered dataset name")
    limit: int | None = option(None, ge=1, help="audit a seeded sample of this many questions per dataset (None: all)")
    seed: int = option(0, help="seed of the --limit sample")
    index: str | None = option(None, help="index folder to serve on a free 127.0.0.1 port (default: the bundled "
                               "corpus's MiniLM index, built from the shipped vectors if missing)")
    retriever_url: str | None = option(None, help="a running retriever's base URL instead of --index")
    topk: int = option(3, ge=1, le=100, help="passages per search")
    corpus: str | None = option(None, help="the corpus jsonl(.gz) for the 'gold in the corpus at all' check (default: "
                                "the bundled corpus when the index is the bundled one; 'none' skips the check)")
    out: str = option("audit.json", help="JSON file to write (every question's class and evidence, and the tables)")


AUDIT_HELP = ("classify each question: gold in the corpus, in the first search's top-k, reachable by a second search, "
              "or neither")


def audit_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The options of ``emapg data audit`` (on ``p``, or a parser of its own for the reference)."""
    p = p or argparse.ArgumentParser(prog="emapg data audit")
    p.description = __doc__.split("\n\nAn application module")[0]
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_config_arguments(p, AuditConfig, flags={"datasets": "--dataset"})
    return p


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="emapg data", description="Data tools: `emapg data audit --help`.")
    sub = p.add_subparsers(dest="action", required=True, metavar="<action>")
    audit_parser(sub.add_parser("audit", help=AUDIT_HELP))
    return p


def load_questions(name: str, cfg: AuditConfig) -> list:
    """The questions of one ``--dataset`` entry, as :class:`tasks.multihop.MultiHopQuestion`."""
    from tasks.datasets import DatasetError, load_dataset
    from tasks.multihop import MultiHopQuestion, load_multihop

    try:
        if name == "multihop" or Path(name).suffix in (".jsonl", ".gz") and Path(name).is_file():
            rows = load_multihop() if name == "multihop" else load_multihop(name)
            if cfg.limit is not None and len(rows) > cfg.limit:
                import random

                rows = sorted(random.Random(cfg.seed).sample(rows, cfg.limit), key=rows.index)
            return rows
        examples = load_dataset(name, split=cfg.split, limit=cfg.limit, seed=cfg.seed)
    except DatasetError as e:
        raise ConfigError(f"datasets: {e}") from None
    return [MultiHopQuestion(ex.id, ex.question.strip(), list(ex.answers), name, str(ex.meta.get("type", "")))
            for ex in examples]


def audit(cfg: AuditConfig) -> dict:
    from tqdm import tqdm

    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever
    from tasks.coverage import RULE, CorpusMatcher, classify, corpus_passages, table
    from tasks.datasets import BUNDLED_CORPUS

    questions = {name: load_questions(name, cfg) for name in cfg.datasets}
    if cfg.retriever_url and cfg.index:
        raise ConfigError("index: give --index or --retriever-url, not both")
    index = None if cfg.retriever_url else (Path(cfg.index) if cfg.index else ensure_bundled_index())
    corpus_path = cfg.corpus if cfg.corpus is not None else (str(BUNDLED_CORPUS) if cfg.index is None and not cfg.retriever_url else None)
    if corpus_path in (None, "none"):
        corpus = None
    else:
        if not Path(corpus_path).is_file():
            raise ConfigError(f"corpus: no such file: {corpus_path}")
        corpus = CorpusMatcher(corpus_passages(corpus_path))
    out: dict = {"rule": RULE.format(topk=cfg.topk), "topk": cfg.topk, "index": str(index) if index else cfg.retriever_url,
                 "corpus": corpus_path if corpus is not None else None, "datasets": {}}
    with open_retriever(urls=[cfg.retriever_url] if cfg.retriever_url else (), index_dir=index, topk=cfg.topk) as retriever:
        for name, qs in questions.items():
            with tqdm(total=len(qs), desc=f"audit {name}", unit="q", file=sys.stderr) as bar:
                done = [0]

                def advance(n: int, bar=bar, done=done) -> None:
                    bar.update(n - done[0])
                    done[0] = n

                records = classify(qs, retriever, topk=cfg.topk, corpus=corpus, progress=advance)
            out["datasets"][name] = {"by_source": table(records), "by_type": table(records, "type"),
                                     "questions": [r.to_dict() for r in records]}
    return out


def print_tables(result: dict, file=sys.stdout) -> None:
    from tasks.coverage import CLASSES

    for name, d in result["datasets"].items():
        print(f"\n{name} (top-{result['topk']})", file=file)
        head = ["source", "questions", *CLASSES]
        print("  ".join(f"{h:>18}" for h in head), file=file)
        for source, row in d["by_source"].items():
            n = row["questions"]
            cells = [source[:18], str(n)] + [f"{row[c]} ({100 * row[c] / n:.0f}%)" if n else "0" for c in CLASSES]
            print("  ".join(f"{c:>18}" for c in cells), file=file)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    del args.action
    cfg = config_from_args(AuditConfig, args)
    if not cfg.datasets:
        raise UserError("datasets: give at least one --dataset")
    result = audit(cfg)
    Path(cfg.out).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print_tables(result)
    print(f"\nwrote {cfg.out}")
    return 0
