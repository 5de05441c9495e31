"""How close is ``emapg plan`` to what the trainer really uses? Predicted against measured, config by config, on this CPU.

Each configuration runs ``emapg plan configs/math_tiny_cpu.yaml OVERRIDES --probe --json`` in a fresh process
(:mod:`trainer.plan.probe`: ``Trainer.setup`` and four real steps at the configured shapes, rows at the token budgets, every other one a token short: padded micro-batches): the
unprobed plan's peak memory against the measured peak (live torch tensor bytes over setup and two steps, from the
profiler's allocation events: the CPU counterpart of ``torch.cuda.max_memory_allocated``), and the step time of the
last step against the unprobed plan and against the plan refitted from the step before it (the probe; both unprofiled).
A step's time is its measured phases: rollout and weight sync with a colocated engine, the update always.

    python benchmarks/plan_accuracy.py                 # every configuration
    python benchmarks/plan_accuracy.py --only tiny_k3  # some (merged into the existing JSON)
    python benchmarks/plan_accuracy.py --explain       # rewrite only the explanations of the misses

Writes ``benchmarks/results/plan_accuracy.json``: ``configs`` (each with ``memory_error``, a signed fraction
(predicted - measured) / measured, ``step_error_probed`` and ``step_error_unprobed``), ``worst_memory_error``,
``worst_step_error_probed``, ``worst_step_error_unprobed`` (the signed errors of largest magnitude) and the planner's
time for the 3B preset (``planner_seconds_3b``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "plan_accuracy.json"
BASE = "configs/math_tiny_cpu.yaml"

TINY = ["data.prompts_per_step=2", "rollout.n_samples=4", "rollout.max_prompt_tokens=128", "rollout.max_response_tokens=128",
        "rollout.max_tokens_per_turn=128", "algorithm.mini_batch_size=8", "algorithm.micro_batch_size=8", "run.device=cpu"]
SMOL = ["model.policy=smollm2-135m-instruct", "data.prompts_per_step=1", "rollout.n_samples=4",
        "rollout.max_prompt_tokens=64", "rollout.max_response_tokens=64", "rollout.max_tokens_per_turn=32",
        "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=4", "run.device=cpu"]
REMOTE = ["rollout.engine=remote", "rollout.engine_urls=[http://127.0.0.1:9]"]
TOPK = ["algorithm.kl.type=topk_reverse", "algorithm.kl.topk=32", "algorithm.kl.importance_weight=true"]
LORA = ["model.lora.enabled=true", "model.lora.rank=8"]

#: name -> (what it varies, overrides of configs/math_tiny_cpu.yaml)
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "tiny_k3": ("tiny-qwen2, full fine-tuning, K3 KL to a full fp32 EMA anchor, colocated transformers engine", TINY),
    "tiny_topk": ("Top-k (k = 32) reverse KL", TINY + TOPK),
    "tiny_exact_kl": ("exact full-vocabulary reverse KL (the anchor's hidden states stored)", TINY + ["algorithm.kl.type=exact_reverse"]),
    "tiny_micro2": ("micro-batches of 2 rows (gradient accumulation over 4)", TINY + ["algorithm.micro_batch_size=2"]),
    "tiny_lora": ("LoRA (r = 8), the EMA anchor over the adapters", TINY + LORA),
    "tiny_remote": ("no colocated engine (remote generation servers)", TINY + REMOTE),
    "tiny_distill": ("on-policy distillation from a local teacher (Top-k forward KL, k = 16)",
                     TINY + ["algorithm.distill.enabled=true", "algorithm.distill.teacher=tiny-qwen2",
                             "algorithm.distill.estimator=topk_forward_kl"]),
    "tiny_ckpt": ("gradient checkpointing", TINY + ["model.gradient_checkpointing=true"]),
    "tiny_one_pass": ("one training pass per row (the group's prompt not shared), no checkpointing: tiny_ckpt's pass "
                      "without the recompute", TINY + ["model.share_prompt_training=false"]),
    "smollm2_topk": ("SmolLM2-135M, full fine-tuning, Top-k KL, full fp32 EMA anchor, colocated engine", SMOL + TOPK),
    "smollm2_lora": ("SmolLM2-135M, LoRA (r = 8), Top-k KL, EMA over the adapters, colocated engine", SMOL + TOPK + LORA),
    "smollm2_grpo_remote": ("SmolLM2-135M, no KL (no anchor), micro-batches of 2, no colocated engine",
                            SMOL + REMOTE + ["algorithm.kl.enabled=false", "algorithm.micro_batch_size=2"]),
}

#: Why the misses happen, written after the measurement from what it recorded (see docs/planning.md).
EXPLANATIONS: dict[str, str] = {
    "memory measurement": "until this run the probe's CPU peak summed prof.events()' self_cpu_memory_usage in start "
                          "order: each op's net bytes placed at its start, so an op that frees what its children "
                          "allocated (the fused lm_head's autograd Function, the engine's evaluate_function nodes) moved "
                          "those frees before the allocations and hid the moment they were live together. It now sums the "
                          "profiler's allocation records in time order (probe.live_peak; their running sum equals the "
                          "allocator's own 'Total Allocated'): one Trainer.learn of tiny_one_pass peaks 109.2 MiB above "
                          "its start, not 85.2; tiny_k3 81.5, not 59.7; tiny_ckpt 54.4, not 46.4. The earlier +0.3%..+5.5% "
                          "agreement on the tiny configurations came from the planner missing the same moment: the fused "
                          "head's backward holds three (chunk, V) fp32 buffers (logits, their gradient, the entropy "
                          "term's centred logits) and the hidden states' gradient, not one buffer (a standalone "
                          "tiny-qwen2 one-pass step: 74.1 MiB saved + 27.0 = the measured 101.1 MiB peak), and a "
                          "checkpointed layer's backward holds its MLP's gradients (54.3 MiB measured standalone, 42 "
                          "counted before, 52 now). The planner counts both since commit 5bb9967.",
    "tiny_one_pass": "memory -0.1% (was +13.6%): the probe's rows all filled the token budget, so transformers ran "
                     "attention without a mask and without repeating the keys and values to every query head: the "
                     "forward saved 74.1 MiB (graph walk, unique storages) against 82.1 MiB with one padded row, which "
                     "is what a run's batches are and what the planner counts (82.0 MiB). The probe's batch now has "
                     "every other response one token short (padded micro-batches at the full width); with the "
                     "records-based peak and the lm_head's three buffers the prediction meets the measurement.",
    "tiny_exact_kl": "memory -0.1% in a rerun at 04:15 after the full run's -23.9%, which the corrected measurement "
                     "exposed: the exact KL's chunk (both logits, both log-softmaxes, the probabilities, two "
                     "temporaries) holds seven (chunk, V) buffers, and its second lm_head backward its own hidden-state "
                     "and fresh (V, h) weight gradients; the planner counted three buffers (35 MiB short). Now counted.",
    "smollm2_grpo_remote": "memory -0.8% (measured 2506.4 MiB, predicted 2485.5) since the trainer's fix of 2026-12-07; "
                           "it was -10.2% (measured 2767.4), the one miss of +-10%. Cause, measured from the allocation "
                           "records of one Trainer.learn with markers per backward: with the shared-prompt training "
                           "pass every decoder weight is used twice in one graph (the prompt pass, then the response "
                           "block reading its KV cache), and autograd holds a weight's first gradient in the using "
                           "node's input buffer until the other use's gradient arrives; the prompt pass's backward "
                           "runs last (lower sequence numbers), so under gradient accumulation every layer's fresh "
                           "gradient (~405 MiB for SmolLM2) was live beside .grad at the second micro-batch's peak: "
                           "1228 MiB above the update's start, 1048 with model.share_prompt_training=false, 972 with "
                           "the fix. The fix (trainer/model_forward.py: _PromptCut) cuts the graph between the prompt "
                           "pass and the response block and runs the prompt pass's backward as a nested backward once "
                           "the response block's is done, so each weight's gradient is added into .grad as soon as it is "
                           "built (same sum up to float rounding; tests/trainer/test_shared_prompt_grad.py counts the "
                           "accumulations and the second backward's peak). The peak is now the lm_head's moment the "
                           "planner counts. A first placement of the cut, after the cache's gather to one entry per "
                           "row, made every other shared-prompt configuration measure 2.01 MiB more on tiny-qwen2 (8 "
                           "rows x 256 columns x 256 values in fp32: the per-row keys' and values' gradients held "
                           "for the nested backward); cut before the gather, they measure as before the fix "
                           "(smollm2_topk 3295.0 MiB both times, tiny_k3 114.3 against 114.0).",
    "unprobed step time": "all within -42.4%..-4.6% and probed within -24.0%..+10.0% in this run (14:28), "
                          "where the 12:35 run of the same configurations measured -16.6%..+13.9% and -1.7%..+9.9%: "
                          "the machine ran slower (SmolLM2's smollm2_topk step 13.9 s against 11.7 s, tiny_lora's "
                          "1.19 s against 0.83 s, no other job running); before the catalogue's refit "
                          "+20..+58% on the tiny configurations. The catalogue's CPU "
                          "decode latency (3 ms a step) and rates had been fitted to SmolLM2. Measured on the "
                          "transformers engine (one thread): a decode step costs ~0.58 ms per decoder layer (eager "
                          "dispatch of ~50 ops: tiny-qwen2 at 1, 2, 4, 8 layers takes 2.1, 3.3, 5.8, 10.0 ms with 8 "
                          "rows) plus the slower of reading the weights (20.6 GB/s measured) and 2·N FLOPs per sequence "
                          "at 13.5 GFLOP/s; prefill runs at 0.45 of peak (58-90 GFLOP/s), the update at 0.35 (0.25-0.49 "
                          "measured across runs; tiny_k3 and smollm2_topk at 57 and 59 GFLOP/s side by side). One fit "
                          "over both models gives every measured decode step within -9%..+9% but SmolLM2's one-row step "
                          "(-26%); devices.yaml states the source. The machine's load moves a step by up to ~30% between "
                          "runs (tiny_k3's update: 0.23 s at 00:30, 0.31 s at 03:30 and in this run).",
}


def run_config(name: str, overrides: list[str], timeout: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "app.cli", "plan", BASE, *overrides, "--probe", "--json", "--out", "-"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{name}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    plan = json.loads(proc.stdout[proc.stdout.index("{"):])
    return summarize(name, overrides, plan, time.perf_counter() - t0)


def _total(seconds: dict[str, float | None], measured: dict[str, float | None]) -> float:
    """The sum of the phases that were measured."""
    return sum(seconds[k] for k, v in measured.items() if v is not None)


def summarize(name: str, overrides: list[str], plan: dict[str, Any], wall: float) -> dict[str, Any]:
    probe = plan["probe"]
    measured = probe["measured_step_seconds"]
    measured_total = sum(v for v in measured.values() if v is not None)
    unprobed_total = _total(probe["unprobed"]["step_seconds"], measured)
    probed_total = _total(plan["step_seconds"], measured)
    predicted_peak = probe["unprobed"]["memory_bytes"]["total"]
    return {
        "name": name,
        "what": CONFIGS[name][0],
        "overrides": overrides,
        "predicted_peak_bytes": predicted_peak,
        "predicted_components": probe["unprobed"]["memory_bytes"],
        "predicted_phase": plan["memory_phase"],
        "measured_peak_bytes": probe["measured_peak_bytes"],
        "measured_peak_phase": probe.get("measured_peak_phase"),
        "memory_error": (predicted_peak - probe["measured_peak_bytes"]) / probe["measured_peak_bytes"],
        "rss_growth_bytes": probe["rss_growth_bytes"],
        "measured_step_seconds": measured,
        "measured_steps": probe["steps"],
        "predicted_step_seconds_unprobed": probe["unprobed"]["step_seconds"],
        "predicted_step_seconds_probed": plan["step_seconds"],
        "step_error_unprobed": (unprobed_total - measured_total) / measured_total,
        "step_error_probed": (probed_total - measured_total) / measured_total,
        "wall_s": round(wall, 1),
    }


def worst(configs: list[dict[str, Any]], key: str) -> float:
    return max((c[key] for c in configs), key=abs)


def planner_seconds_3b() -> tuple[float, float]:
    """Wall time of `emapg plan` (process start to JSON) for the Qwen2.5-3B preset on 8 x H100 80GB, and of the plan
    itself in this process (``plan_run`` on the loaded config: the memory, time and fitting searches)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "app.cli", "plan", "configs/search_qwen2.5-3b_emapg.yaml", "--device", "h100-80gb",
                    "--devices", "8", "--json", "--out", "-"], cwd=ROOT, env=env, check=True, capture_output=True)
    command = time.perf_counter() - t0
    sys.path.insert(0, str(ROOT))
    from emapg.config import load_config
    from trainer.config import TrainConfig
    from trainer.plan.catalogue import get_device
    from trainer.plan.planner import plan_run

    cfg = load_config(TrainConfig, ROOT / "configs" / "search_qwen2.5-3b_emapg.yaml", [])
    t0 = time.perf_counter()
    plan_run(cfg, get_device("h100-80gb"), devices=8)
    return command, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="comma-separated configuration names (default: all); merged into --out")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    p.add_argument("--out", default=str(OUT), help="result JSON")
    p.add_argument("--explain", action="store_true", help="only write EXPLANATIONS (the misses' causes) into --out, "
                   "measuring nothing")
    args = p.parse_args()
    if args.explain:
        report = json.loads(Path(args.out).read_text())
        report["explanations"] = EXPLANATIONS
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        return 0
    names = [n for n in args.only.split(",") if n] or list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configurations {unknown}; choose from {', '.join(CONFIGS)}")
    out = Path(args.out)
    previous = {c["name"]: c for c in json.loads(out.read_text())["configs"]} if out.is_file() else {}
    for name in names:
        print(f"[{name}] {CONFIGS[name][0]}", flush=True)
        r = previous[name] = run_config(name, CONFIGS[name][1], args.timeout)
        print(f"  peak predicted {r['predicted_peak_bytes'] / 2**20:.1f} MiB, measured {r['measured_peak_bytes'] / 2**20:.1f} MiB "
              f"({r['memory_error']:+.1%}); step measured {sum(v for v in r['measured_step_seconds'].values() if v):.2f} s, "
              f"unprobed {r['step_error_unprobed']:+.1%}, probed {r['step_error_probed']:+.1%}", flush=True)
    configs = [previous[n] for n in CONFIGS if n in previous]
    command_s, plan_s = planner_seconds_3b()
    report = {
        "benchmark": "plan_accuracy",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "1")},
        "peak_definition": "peak live torch tensor bytes over Trainer.setup and two steps (the torch profiler's CPU "
                           "allocation records, summed in time order)",
        "targets": {"memory_error": 0.10, "step_error_probed": 0.25, "step_error_unprobed": 0.50, "planner_seconds_3b": 5.0},
        "configs": configs,
        "worst_memory_error": worst(configs, "memory_error"),
        "worst_step_error_probed": worst(configs, "step_error_probed"),
        "worst_step_error_unprobed": worst(configs, "step_error_unprobed"),
        "planner_seconds_3b": command_s,
        "planner_seconds_3b_in_process": plan_s,
        "explanations": EXPLANATIONS,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"worst memory error {report['worst_memory_error']:+.1%}, worst step error probed {report['worst_step_error_probed']:+.1%}, "
          f"unprobed {report['worst_step_error_unprobed']:+.1%}; planner {report['planner_seconds_3b']:.2f} s for the 3B preset")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
