"""A small task that needs two tools: search, then arithmetic on what was found (``rollout.tools=[search, calculator]``).

Each question is a bundled NQ gold-passage question whose answer is a year, asked as a difference: *"How many years
before 2025 was it: when was the minimum wage established in the united states?"*; the gold answers are
``2025 - year`` for each gold year (``"87"``, ``"92"``, ``"113"``). The year is in the question's gold passage (the
bundled corpus, and the tests' small index), so the agent must search for it and subtract -- with the calculator
tool, or by itself. Graded by the QA task's metrics (exact match on the number). A smoke-sized task for the
multi-tool environment (docs/mcp.md), not a benchmark: its questions come from the NQ *test* split.

    python -m tasks.year_arithmetic out.jsonl [--limit N]    # then: data.train=out.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

__all__ = ["REFERENCE_YEAR", "year_arithmetic", "write_year_arithmetic"]

REFERENCE_YEAR = 2025
_YEAR = re.compile(r"1[0-9]{3}|20[0-2][0-9]")
TEMPLATE = "How many years before {ref} was it: {question}?"


def year_arithmetic(limit: int | None = None, *, scan: int | None = None, reference_year: int = REFERENCE_YEAR) -> list[dict]:
    """Rows ``{"id", "question", "answers", "years"}`` from the first ``scan`` nq_gold test questions (all: None) whose
    answers are years before ``reference_year``; at most ``limit``."""
    from tasks.datasets import load_dataset

    rows = []
    for ex in load_dataset("nq_gold", split="test")[:scan]:
        years = sorted({int(a.strip()) for a in ex.answers if _YEAR.fullmatch(a.strip()) and int(a.strip()) < reference_year})
        if not years:
            continue
        rows.append({"id": f"year_arith-{ex.id}", "question": TEMPLATE.format(ref=reference_year, question=ex.question),
                     "answers": [str(reference_year - y) for y in years], "years": years})
        if limit is not None and len(rows) == limit:
            break
    return rows


def write_year_arithmetic(path: str | Path, limit: int | None = None, *, scan: int | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in year_arithmetic(limit, scan=scan)), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasks.year_arithmetic", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the .jsonl file to write ({id, question, answers})")
    p.add_argument("--limit", type=int, default=None, help="at most this many questions")
    args = p.parse_args(argv)
    print(write_year_arithmetic(args.out, args.limit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
