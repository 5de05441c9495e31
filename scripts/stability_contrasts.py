"""Newcombe intervals for the collapse-rate contrasts that docs/training.md quotes and that ``studies/stability.py``'s
summary does not hold (it compares each arm with GRPO only): pooled arms against pooled arms, and one arm against
another. Computed by the study's own :func:`studies.stability.newcombe` from the collapse counts the results file
records (``toy.<arm>.collapsed`` of ``len(toy.<arm>.seeds)`` runs) and written into the same file under
``toy.contrasts``, so the docs bind them (``<!--@stability_beta1:toy.contrasts.NAME.newcombe.0-->``).

    python scripts/stability_contrasts.py          # write the contrasts into the results files
    python scripts/stability_contrasts.py --check  # exit 1 when a file's contrasts are missing or differ
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from studies.stability import newcombe  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
#: results file -> contrast name -> (arms pooled on the left, arms pooled on the right)
CONTRASTS: dict[str, dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "stability_beta1": {
        "topk_minus_k3": (("emapg", "frozen_topk"), ("grpo", "ema_k3")),
        "frozen_topk_exact_minus_frozen_topk": (("frozen_topk_exact",), ("frozen_topk",)),
    },
}


def contrast(toy: dict[str, Any], left: tuple[str, ...], right: tuple[str, ...]) -> dict[str, Any]:
    """The pooled collapse counts of both sides, their difference in rate and its Newcombe interval."""
    k1, n1 = sum(toy[a]["collapsed"] for a in left), sum(len(toy[a]["seeds"]) for a in left)
    k2, n2 = sum(toy[a]["collapsed"] for a in right), sum(len(toy[a]["seeds"]) for a in right)
    return {"left": list(left), "right": list(right), "collapsed_left": k1, "runs_left": n1, "collapsed_right": k2,
            "runs_right": n2, "difference": k1 / n1 - k2 / n2, "newcombe": newcombe(k1, n1, k2, n2),
            "method": "studies.stability.newcombe (Newcombe's hybrid score interval, method 10) over the pooled counts"}


def contrasts(data: dict[str, Any], spec: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]) -> dict[str, Any]:
    return {name: contrast(data["toy"], left, right) for name, (left, right) in spec.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="only check the files' contrasts")
    args = p.parse_args(argv)
    stale = []
    for name, spec in CONTRASTS.items():
        path = RESULTS / f"{name}.json"
        data = json.loads(path.read_text())
        want = contrasts(data, spec)
        if data["toy"].get("contrasts") == want:
            continue
        stale.append(name)
        if not args.check:
            data["toy"]["contrasts"] = want
            path.write_text(json.dumps(data, indent=2))  # as studies/stability.py writes it
            print(f"wrote {path.relative_to(REPO)} toy.contrasts")
    if args.check and stale:
        print(f"{', '.join(stale)}: run python scripts/stability_contrasts.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
