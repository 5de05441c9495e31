"""Self-check of the math grader on real benchmark answers: where does it fail?

For every problem of a math set, the gold answer written as ``\\boxed{gold}`` must be graded
correct, and a *perturbed* answer (last digit changed, or a letter appended when there is no
digit) must be graded wrong. The exceptions are grader gaps worth knowing before trusting a
number: e.g. math-verify ignores base subscripts (``52_8`` = ``52_9``), rounds tiny
magnitudes to 6 decimals (``4.6 \\times 10^{-24}`` = ``4.6 \\times 10^{-25}``) and drops
units with exponents (``cm^2`` = ``cm^3``); and without a timeout it spends about five
minutes comparing ``x = \\frac{e^{t}}{3} + ce^{-3t}`` with the Minerva gold ``ce^{-2t}``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

from tasks.math import DEFAULT_GRADER, Grader, GraderPool, grade_many

__all__ = ["perturb_answer", "check_grader", "format_exceptions"]


def perturb_answer(answer: str, golds: Sequence[str] = ()) -> str:
    """A wrong version of ``answer``: its last digit shifted (by the smallest amount that does not
    produce another listed gold), or ``x`` appended when it has no digit."""
    positions = [m.start() for m in re.finditer(r"\d", answer)]
    if not positions:
        return answer + "x"
    i = positions[-1]
    others = {g.strip() for g in golds}
    for delta in range(1, 10):
        cand = answer[:i] + str((int(answer[i]) + delta) % 10) + answer[i + 1 :]
        if cand.strip() not in others:
            return cand
    return answer + "1"


def check_grader(
    examples_by_set: dict[str, Sequence[Any]],
    *,
    grader: Grader = DEFAULT_GRADER,
    pool: GraderPool | None = None,
    timeout: float = 5.0,
) -> dict[str, Any]:
    """Grade gold and perturbed answers of ``{set: [Example, ...]}``; returns per-set rates,
    the exceptions (gold rejected, perturbation accepted, timeouts) and items/s."""
    out: dict[str, Any] = {"grader": grader, "sets": {}}
    for name, examples in examples_by_set.items():
        golds = [list(ex.answers) for ex in examples]
        t0 = time.perf_counter()
        ok = grade_many([f"\\boxed{{{g[0]}}}" for g in golds], golds, grader=grader, pool=pool, timeout=timeout)
        wrong = [perturb_answer(g[0], g) for g in golds]
        bad = grade_many([f"\\boxed{{{w}}}" for w in wrong], golds, grader=grader, pool=pool, timeout=timeout)
        seconds = time.perf_counter() - t0
        n = len(examples)
        out["sets"][name] = {
            "n": n,
            "gold_accepted": sum(r.correct for r in ok) / n,
            "perturbed_accepted": sum(r.correct for r in bad) / n,
            "timeouts": sum(r.reason == "timeout" for r in ok + bad),
            "items_per_s": 2 * n / seconds,
            "gold_rejected": [{"id": ex.id, "gold": g[0], "reason": r.reason}
                              for ex, g, r in zip(examples, golds, ok) if not r.correct],
            "perturbed_accepted_items": [{"id": ex.id, "gold": g[0], "perturbed": w, "accepted_by": r.reason}
                                         for ex, g, w, r in zip(examples, golds, wrong, bad) if r.correct],
            "timed_out": [{"id": ex.id, "answer": r.extracted}
                          for ex, r in [*zip(examples, ok), *zip(examples, bad)] if r.reason == "timeout"],
        }
    return out


def format_exceptions(report: dict[str, Any]) -> str:
    """Readable list of a :func:`check_grader` report's exceptions."""
    lines = [f"grader {report['grader']}:"]
    for name, s in report["sets"].items():
        lines.append(f"  {name}: n={s['n']} gold accepted {100 * s['gold_accepted']:.1f}%, "
                     f"perturbed accepted {100 * s['perturbed_accepted']:.1f}%, timeouts {s['timeouts']}")
        lines += [f"    gold rejected: {e['gold']!r} ({e['reason']})" for e in s["gold_rejected"]]
        lines += [f"    perturbed accepted: {e['gold']!r} ~ {e['perturbed']!r} (by {e['accepted_by']})"
                  for e in s["perturbed_accepted_items"]]
        lines += [f"    timed out (counted wrong): {e['answer']!r}" for e in s["timed_out"]]
    return "\n".join(lines)
