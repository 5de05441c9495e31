"""Build the bundled ``data/`` folder from the collected source files in ``shared/data``.

Usage (from the repository root)::

    python scripts/bundle_data.py --shared ../shared/data            # everything
    python scripts/bundle_data.py --shared ../shared/data --only corpus

Deterministic: the same inputs give byte-identical outputs (gzip level 9, mtime 0, no
file name in the gzip header, keys in a fixed order, ``ensure_ascii=False``).
Provenance, licences and row counts of every output are documented in ``data/README.md``.
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def write_jsonl_gz(path: Path, rows: Iterable[dict]) -> int:
    """Write ``rows`` as gzip-compressed JSON lines, byte-reproducibly; return the row count."""
    buf = io.BytesIO()
    n = 0
    # filename="" and mtime=0 keep the gzip header free of paths and timestamps.
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buf, mtime=0) as gz:
        for row in rows:
            gz.write(json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n")
            n += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return n


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------- corpus


def build_corpus(shared: Path, out: Path) -> dict[str, int]:
    """wiki_mini corpus → Search-R1 format: ``{"id", "contents": "\\"Title\\"\\ntext", "source"}``.

    The shared corpus stores ``title\\ntext`` with a bare title; wiki-18 (and therefore the
    Search-R1 retrieval server and its prompts) wraps the title in double quotes without
    escaping inner quotes, so we do exactly that.
    """
    rows = []
    for rec in read_jsonl(shared / "wiki_mini_corpus" / "corpus.jsonl"):
        title, sep, text = rec["contents"].partition("\n")
        if not sep or not text.strip():
            raise ValueError(f"corpus row {rec['id']!r} has no 'title\\ntext' contents")
        rows.append({"id": str(rec["id"]), "contents": f'"{title}"\n{text}', "source": rec["source"]})
    return {"corpus/wiki_mini.jsonl.gz": write_jsonl_gz(out / "corpus" / "wiki_mini.jsonl.gz", rows)}


# --------------------------------------------------------------------------- QA sets


def _flashrag_index(raw_id: str) -> int:
    """FlashRAG / Search-R1 ids look like ``test_3283``: return the row index 3283."""
    split, _, idx = str(raw_id).rpartition("_")
    if not split or not idx.isdigit():
        raise ValueError(f"unexpected FlashRAG id {raw_id!r}")
    return int(idx)


def _answers(value) -> list[str]:
    """A source answer (string or list) as a non-empty list of stripped strings."""
    items = [value] if isinstance(value, str) else list(value)
    out = [str(a).strip() for a in items if str(a).strip()]
    if not out:
        raise ValueError(f"empty answer {value!r}")
    return out


def _nq_test(shared: Path) -> list[dict]:
    """NQ-open test (3,610) from the Search-R1 parquet, whose ids are FlashRAG's ``test_<k>``.

    Search-R1's preprocessing appended "?" to every question; no NQ-open question ends in
    "?" (checked against the Agentic-RAG copy of the same split), so we strip it to store the
    FlashRAG text. Prompt templates add it back where Search-R1's prompt does.
    """
    import pyarrow.parquet as pq

    table = pq.read_table(shared / "search_r1_nq_search" / "test.parquet", columns=["id", "question", "golden_answers"])
    reference = {r["question"].strip() for r in json.loads(
        (shared / "agentic_rag_qa" / "nq_test_questions_and_answers.json").read_text())}
    rows = []
    for r in table.to_pylist():
        question = r["question"].strip()
        question = question[:-1] if question.endswith("?") else question
        if question not in reference:
            raise ValueError(f"NQ test question {question!r} is not in the Agentic-RAG NQ test split")
        rows.append({"id": f"nq-test-{_flashrag_index(r['id'])}", "question": question,
                     "golden_answers": _answers(r["golden_answers"])})
    return rows


def _flashrag_subsample(shared: Path, name: str) -> list[dict]:
    """reason_over_search's FlashRAG-format test files (TriviaQA, PopQA 1,000; Bamboogle 125)."""
    rows = []
    for r in read_jsonl(shared / "reason_over_search" / "data_subsample" / name / "test.jsonl"):
        row = {"id": f"{name}-test-{_flashrag_index(r['id'])}", "question": r["question"].strip(),
               "golden_answers": _answers(r["golden_answers"])}
        if "metadata" in r:  # PopQA: subject/relation/object and popularity (s_pop)
            row["metadata"] = r["metadata"]
        rows.append(row)
    return rows


def _agentic_dev(shared: Path, name: str, filename: str) -> list[dict]:
    """Agentic-RAG QA-only copies of the full dev splits; ids are the row number in the split."""
    data = json.loads((shared / "agentic_rag_qa" / filename).read_text())
    return [{"id": f"{name}-dev-{i}", "question": r["question"].strip(), "golden_answers": _answers(r["answer"])}
            for i, r in enumerate(data)]


def _rpt_train(shared: Path) -> list[dict]:
    return read_jsonl(shared / "rpt_hotpotqa" / "train.jsonl")


def build_qa(shared: Path, out: Path) -> dict[str, int]:
    hotpot_dev = _agentic_dev(shared, "hotpotqa", "hotpotqa_test_questions_and_answers.json")
    # RPT's "train" rows are HotpotQA dev questions: flag them in the dev set so evaluations
    # after training on the bundled train set can exclude them (meta["in_bundled_train"]).
    dev_row = {r["question"]: i for i, r in enumerate(hotpot_dev)}
    rpt = _rpt_train(shared)
    for r in rpt:
        if r["question"].strip() not in dev_row:
            raise ValueError(f"RPT train question {r['question']!r} is not in HotpotQA dev")
        hotpot_dev[dev_row[r["question"].strip()]]["in_bundled_train"] = True
    sets = {
        "nq": _nq_test(shared),
        "triviaqa": _flashrag_subsample(shared, "triviaqa"),
        "popqa": _flashrag_subsample(shared, "popqa"),
        "hotpotqa": hotpot_dev,
        "2wikimultihopqa": _agentic_dev(shared, "2wikimultihopqa", "2wikimultihop_test_questions_and_answers.json"),
        "musique": _agentic_dev(shared, "musique", "musique_test_questions_and_answers.json"),
        "bamboogle": _flashrag_subsample(shared, "bamboogle"),
    }
    counts = {}
    for name, rows in sets.items():
        rel = f"qa/{name}/test.jsonl.gz"
        counts[rel] = write_jsonl_gz(out / rel, rows)
    return counts


def build_nq_gold(shared: Path, out: Path) -> dict[str, int]:
    """NQ-open test questions with their gold passage (lost-in-the-middle oracle, 2,655 rows).

    ``gold_doc_id`` is the id of that passage in ``corpus/wiki_mini.jsonl.gz``, found with the
    corpus builder's dedup key (whitespace collapsed, title and text lower-cased), so retrieval
    recall can be computed by id.
    """
    def key(title: str, text: str) -> tuple[str, str]:
        return title.strip().lower(), re.sub(r"\s+", " ", text).strip().lower()

    corpus_ids = {}
    for rec in read_jsonl(shared / "wiki_mini_corpus" / "corpus.jsonl"):
        title, _, text = rec["contents"].partition("\n")
        corpus_ids.setdefault(key(title, text), rec["id"])
    nq = {r["question"]: r["id"] for r in _nq_test(shared)}
    rows = []
    for r in read_jsonl(shared / "lost_in_the_middle_nq" / "nq-open-oracle.jsonl.gz"):
        (ctx,) = r["ctxs"]  # exactly one gold passage per question
        nq_id = nq.get(r["question"].strip())
        doc_id = corpus_ids.get(key(ctx["title"], ctx["text"]))
        if nq_id is None or doc_id is None:
            raise ValueError(f"NQ oracle row {r['question']!r}: not in NQ test or passage not in the corpus")
        rows.append({"id": nq_id.replace("nq-", "nq_gold-", 1), "question": r["question"].strip(),
                     "golden_answers": _answers(r["answers"]), "gold_title": ctx["title"],
                     "gold_text": ctx["text"], "gold_doc_id": doc_id, "nq_id": nq_id})
    rows.sort(key=lambda row: int(row["nq_id"].rsplit("-", 1)[1]))
    return {"qa/nq_gold/test.jsonl.gz": write_jsonl_gz(out / "qa" / "nq_gold" / "test.jsonl.gz", rows)}


def build_train(shared: Path, out: Path) -> dict[str, int]:
    import pyarrow.parquet as pq

    nq = [{"id": f"nq-train-{_flashrag_index(r['id'])}", "question": r["question"].strip(),
           "golden_answers": _answers(r["golden_answers"])}
          for r in pq.read_table(shared / "search_r1_nq_search" / "train_first5000.parquet",
                                 columns=["id", "question", "golden_answers"]).to_pylist()]
    hotpot_dev = {r["question"]: r["id"] for r in
                  _agentic_dev(shared, "hotpotqa", "hotpotqa_test_questions_and_answers.json")}
    hotpot = [{"id": f"hotpotqa-train-{r['_id']}", "question": r["question"].strip(),
               "golden_answers": _answers(r["answer"]), "hotpot_id": r["_id"], "type": r["type"],
               "level": r["level"], "origin": "hipporag_train"}
              for r in json.loads((shared / "hipporag" / "hotpotqa_train.json").read_text())]
    # RPT's "train" file is drawn from HotpotQA dev: keep the dev id so the overlap is explicit.
    hotpot += [{"id": hotpot_dev[r["question"].strip()], "question": r["question"].strip(),
                "golden_answers": _answers(r["answer"]), "hotpot_id": r["id"], "type": r["type"],
                "level": r["level"], "origin": "rpt_train_from_dev"}
               for r in _rpt_train(shared)]
    return {
        "qa/nq/train.jsonl.gz": write_jsonl_gz(out / "qa" / "nq" / "train.jsonl.gz", nq),
        "qa/hotpotqa/train.jsonl.gz": write_jsonl_gz(out / "qa" / "hotpotqa" / "train.jsonl.gz", hotpot),
    }


# --------------------------------------------------------------------------- math


def _math_answer(value) -> list[str]:
    """Answers as a list of strings: AMC's floats 23.0 -> "23"; Minerva's trailing newlines dropped."""
    if isinstance(value, float):
        value = str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int):
        value = str(value)
    if value is None:
        raise ValueError("missing answer")
    return _answers(value)


def build_math(shared: Path, out: Path) -> dict[str, int]:
    def load(rel: str) -> list[dict]:
        return json.loads((shared / rel).read_text())

    def rows(name: str, data: list[dict], keep: tuple[str, ...], ident=None) -> list[dict]:
        result = []
        for i, r in enumerate(data):
            row = {"id": f"{name}-{ident(r) if ident else i}", "problem": r["problem"].strip(),
                   "answer": _math_answer(r["answer"])}
            row.update({k: r[k] for k in keep if r.get(k) is not None})
            result.append(row)
        return result

    sets = {
        "aime2024": rows("aime2024", load("aime2024/aime2024.json"), ("year", "aime_number", "problem_number")),
        "amc": rows("amc", load("amc_deepscaler/amc.json"), ("url",)),
        "math500": rows("math500", load("math500/math500.json"), ("unique_id", "difficulty")),
        "minerva": rows("minerva", load("minerva/minerva.json"), ("type", "idx")),
        "olympiadbench": rows("olympiadbench", load("olympiadbench/olympiad_bench.json"),
                              ("subfield", "answer_type", "unit", "is_multiple_answer", "error"),
                              ident=lambda r: r["id"]),
    }
    counts = {f"math/{name}.jsonl.gz": write_jsonl_gz(out / "math" / f"{name}.jsonl.gz", data)
              for name, data in sets.items()}
    # MATH train: 4 of 7,474 rows have no answer (None or ""): they cannot be rewarded, so they
    # are dropped; ids keep the source row number.
    train = [dict(r) for r in load("hendrycks_math_train/math_train.json")]
    kept = [(i, r) for i, r in enumerate(train) if r["answer"] is not None and str(r["answer"]).strip()]
    counts["math/math_train.jsonl.gz"] = write_jsonl_gz(
        out / "math" / "math_train.jsonl.gz",
        [{"id": f"math_train-{i}", "problem": r["problem"].strip(), "answer": _math_answer(r["answer"]),
          "type": r["type"], "difficulty": r["difficulty"]} for i, r in kept])
    return counts


BUILDERS: dict[str, Callable[[Path, Path], dict[str, int]]] = {
    "corpus": build_corpus,
    "qa": build_qa,
    "nq_gold": build_nq_gold,
    "train": build_train,
    "math": build_math,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shared", type=Path, default=REPO_ROOT.parent / "shared" / "data",
                        help="folder holding the collected source files (shared/data)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "data", help="output data folder")
    parser.add_argument("--only", choices=sorted(BUILDERS), action="append",
                        help="build only these parts (repeatable); default: all")
    args = parser.parse_args(argv)
    if not args.shared.is_dir():
        print(f"error: source folder {args.shared} does not exist (pass --shared)", file=sys.stderr)
        return 2
    for name in args.only or list(BUILDERS):
        for rel, n in BUILDERS[name](args.shared, args.out).items():
            size = (args.out / rel).stat().st_size
            print(f"{rel:45s} {n:7d} rows {size / 1e6:7.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
