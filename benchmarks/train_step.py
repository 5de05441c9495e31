"""Time per training step and peak memory: our trainer vs TRL's GRPOTrainer, EMA + Top-k KL on vs off.

Same work on every side: the same model, the same MATH prompts in the same order, P prompts x G
samples, completions of up to L tokens sampled at temperature 1 by transformers on CPU, one
optimizer step per rollout batch over all P x G completions, token-mean (DAPO) loss, clip
0.2 / 0.28, the same math reward (tasks.math) on both sides.

* ``ours_grpo``  -- our trainer, no KL term, no anchor (TRL's default ``beta=0``);
* ``ours_emapg`` -- our trainer, Top-k reverse KL (k=32, tail + IW) against an EMA anchor that is
  blended *every* step (worst case; the paper blends every 10);
* ``ours_emapg_unshared`` -- ``ours_emapg`` with ``model.share_prompt=false`` (the training and
  anchor passes run every row's prompt), to show what sharing the prompt saves;
* ``ours_grpo_k3`` -- our trainer, the paper's GRPO baseline (ALGORITHM.md §3.2): K3 KL to a frozen
  reference, which needs the same extra (no-grad) reference forward as the EMA anchor;
* ``trl``        -- ``trl.GRPOTrainer`` (``beta=0``) from the bench profile (requirements/bench.txt,
  installed by ``make bench``). Missing TRL is an error, not a silent None; ``--no-trl`` skips it.

Our forwards -- the differentiable training pass and the no-grad anchor/reference pass -- run each
group's prompt once and continue the G responses from its KV cache (``model.share_prompt`` and
``model.share_prompt_training``, on by default; gradients flow back through the shared prompt activations), so the training pass computes
one prompt + G responses per group where TRL computes G prompt+response rows, and the extra no-grad
forward of the anchor that EMA-PG costs over plain GRPO is one response-length pass per row.

Configurations (``--config``):

* ``tiny`` -- tiny-qwen2 (1.7M parameters), every mode; ``--quick`` shrinks it for CI
  (4 x 4 x 32 tokens, < 3 min on 2 cores). Steps are ~0.6 s, so ratios are indicative only.
* ``smollm2`` -- SmolLM2-135M-Instruct, ``ours_grpo``, ``ours_emapg`` and ``trl``, steps of
  several seconds so that EMA-PG / GRPO is a measurement, not noise (~15 min on 2 cores).

Each configuration runs in its own process (peak RSS is per process), ``--rounds`` times in
turn, so a burst of load from other processes on the machine hits one round of each rather than
all of one configuration. Per process the first step is a warm-up; a round's figure is the median
of the rest. The JSON keeps every step time and, per configuration, min / median / max over the
rounds; a ratio is computed per round (both sides measured back to back) and reported as the
median over rounds with its min / max. Our steps also keep the trainer's phase timings
(``time/*``: rollout, old log-probs, anchor, training). Writes ``benchmarks/results/train_step.json``
(``train_step_smollm2.json`` for ``--config smollm2``) with ``ours_over_trl_step_time_ratio`` and
``emapg_over_grpo_step_time_ratio``.

    python benchmarks/train_step.py --quick
    python benchmarks/train_step.py --config smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS_DIR = ROOT / "benchmarks" / "results"
MODES = ("ours_grpo", "ours_emapg", "ours_emapg_unshared", "ours_grpo_k3", "trl")
# Sizes per configuration; command-line values override them.
CONFIGS = {
    "tiny": dict(model="tiny-qwen2", prompts=8, group=4, length=64, steps=6, rounds=2, modes=MODES,
                 out="train_step.json"),
    "tiny-quick": dict(model="tiny-qwen2", prompts=4, group=4, length=32, steps=5, rounds=2, modes=MODES,
                       out="train_step.json"),
    "smollm2": dict(model="smollm2-135m-instruct", prompts=2, group=4, length=32, steps=3, rounds=3,
                    modes=("ours_grpo", "ours_emapg", "trl"), out="train_step_smollm2.json"),
}


def prompt_pool(model: str, n: int, max_tokens: int) -> list[dict]:
    """The first ``n`` MATH train problems whose rendered prompt fits ``max_tokens`` tokens of ``model``."""
    from transformers import AutoTokenizer

    from agent.prompts import build_prompt
    from emapg.models import resolve_model
    from tasks.datasets import load_dataset

    tok = AutoTokenizer.from_pretrained(resolve_model(model))
    pool = []
    for ex in load_dataset("math", split="train"):
        if len(build_prompt(tok, ex.question, "math_boxed").token_ids) <= max_tokens:
            pool.append({"id": ex.id, "question": ex.question, "answer": ex.answers[0]})
        if len(pool) == n:
            return pool
    raise RuntimeError("not enough short MATH problems")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_ours(args: argparse.Namespace, pool_file: Path, mode: str) -> dict:
    from emapg.config import load_config
    from emapg.paths import CONFIG_DIR
    from trainer.config import TrainConfig
    from trainer.loop import Trainer

    batch = args.prompts * args.group
    overrides = [
        f"run.output_dir={tempfile.mkdtemp(prefix='bench-ours-')}", "run.save_every=0", "logging.progress=false",
        "logging.tensorboard=false", "logging.log_samples=0", f"run.total_steps={args.steps}", f"model.policy={args.model}",
        f"data.train={pool_file}", "data.shuffle=false", f"data.prompts_per_step={args.prompts}",
        f"rollout.n_samples={args.group}", f"rollout.max_tokens_per_turn={args.length}",
        f"rollout.max_response_tokens={args.length}", "rollout.top_p=1.0", "rollout.temperature=1.0",
        f"algorithm.mini_batch_size={batch}", f"algorithm.micro_batch_size={batch}", "algorithm.loss_agg=token-mean",
        "algorithm.dual_clip=null", "algorithm.clip_high=0.28", "optim.lr=1e-4", "reward.math_workers=1",
    ]
    if mode in ("ours_emapg", "ours_emapg_unshared"):
        overrides += ["model.share_prompt=" + str(mode == "ours_emapg").lower()]
        overrides += ["algorithm.kl.enabled=true", "algorithm.kl.type=topk_reverse", "algorithm.kl.topk=32",
                      "algorithm.kl.importance_weight=true", "algorithm.ema.decay=0.9", "algorithm.ema.period=1"]
    elif mode == "ours_grpo_k3":
        overrides += ["algorithm.kl.enabled=true", "algorithm.kl.type=k3", "algorithm.kl.importance_weight=false",
                      "algorithm.ema.decay=1.0"]
    else:
        overrides += ["algorithm.kl.enabled=false", "algorithm.ema.decay=1.0"]
    trainer = Trainer(load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", overrides)).setup()
    times, lengths, phases = [], [], []
    try:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            m = trainer.train_step()
            times.append(time.perf_counter() - t0)
            lengths.append(m["response/length_mean"])
            phases.append({k: float(v) for k, v in m.items() if k.startswith("time/")})
    finally:
        trainer.close()
    return {"step_times_s": times, "phase_times_s": phases, "mean_response_len": statistics.mean(lengths),
            "peak_rss_mb": peak_rss_mb()}


def run_trl(args: argparse.Namespace, pool_file: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agent.prompts import load_template, render
    from emapg.models import resolve_model
    from tasks.math import grade_many

    torch.manual_seed(0)
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = [json.loads(x) for x in pool_file.read_text().splitlines()]
    template = load_template("math_boxed")
    data = Dataset.from_list([
        {"prompt": [{"role": "user", "content": render(template, r["question"])}], "answer": r["answer"]} for r in rows
    ])
    lengths: list[float] = []

    def math_reward(completions, answer, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [float(g.correct) for g in grade_many(texts, answer, workers=1)]

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:  # TRL's own count of completion tokens
                lengths.append(float(logs["completions/mean_length"]))

    batch = args.prompts * args.group
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), per_device_train_batch_size=batch, num_generations=args.group,
        steps_per_generation=1, num_iterations=1, gradient_accumulation_steps=1, max_completion_length=args.length,
        temperature=1.0, top_p=1.0, beta=0.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, learning_rate=1e-4,
        max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
        shuffle_dataset=False, seed=0, dataloader_num_workers=0, disable_dropout=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=math_reward, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=[Clock()])
    trainer.train()
    return {"step_times_s": times, "mean_response_len": statistics.mean(lengths) if lengths else None,
            "peak_rss_mb": peak_rss_mb()}


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    pool_file = Path(args.pool)
    if args.worker == "trl":
        out = run_trl(args, pool_file)
    else:
        out = run_ours(args, pool_file, args.worker)
    Path(args.out).write_text(json.dumps(out))


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def round_median(run: dict) -> float:
    """A process's figure: the median of its steps after the first (warm-up)."""
    return statistics.median(run["step_times_s"][1:] or run["step_times_s"])


def summarize(rounds: list[dict]) -> dict:
    """One configuration over the rounds: every step, each round's median, and their min / median / max."""
    medians = [round_median(r) for r in rounds]
    lengths = [r["mean_response_len"] for r in rounds if r["mean_response_len"] is not None]
    out = {
        "step_times_s": [r["step_times_s"] for r in rounds],
        "round_medians_s": medians,
        "step_time_s": spread(medians),
        "step_time_s_median": statistics.median(medians),
        "mean_response_len": statistics.mean(lengths) if lengths else None,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in rounds),
    }
    if all("phase_times_s" in r for r in rounds):  # our trainer's own split of a step (warm-up excluded)
        keys = sorted({k for r in rounds for p in r["phase_times_s"] for k in p})
        out["phase_time_s_median"] = {
            k: statistics.median(p.get(k, 0.0) for r in rounds for p in (r["phase_times_s"][1:] or r["phase_times_s"]))
            for k in keys
        }
    return out


def paired_ratio(raw: dict[str, list[dict]], a: str, b: str) -> dict:
    """a / b step time, round by round (each round ran a and b back to back): per round and min / median / max."""
    per_round = [round_median(x) / round_median(y) for x, y in zip(raw[a], raw[b])]
    return {"per_round": per_round, **spread(per_round)}


def resolve_sizes(args: argparse.Namespace) -> dict:
    name = "tiny-quick" if args.quick and args.config == "tiny" else args.config
    sizes = dict(CONFIGS[name])
    for key in ("prompts", "group", "length", "steps", "rounds"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    if args.modes:
        sizes["modes"] = tuple(args.modes.split(","))
    if args.no_trl:
        sizes["modes"] = tuple(m for m in sizes["modes"] if m != "trl")
    sizes["out"] = Path(args.out) if args.out else RESULTS_DIR / sizes["out"]
    return sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=["tiny", "smollm2"], default="tiny", help="model and sizes (see the module docstring)")
    p.add_argument("--quick", action="store_true", help="tiny config only: small sizes for CI (< 180 s on 2 cores)")
    p.add_argument("--prompts", type=int, help="prompts per step (default: the config's)")
    p.add_argument("--group", type=int, help="samples per prompt (GRPO group size)")
    p.add_argument("--length", type=int, help="maximum completion tokens")
    p.add_argument("--steps", type=int, help="steps per process (the first is a warm-up)")
    p.add_argument("--rounds", type=int, help="rounds; each runs every configuration once, in turn")
    p.add_argument("--modes", help=f"comma-separated subset of {','.join(MODES)} (default: the config's)")
    p.add_argument("--no-trl", action="store_true", help="skip the TRL comparison (its ratios are then null)")
    p.add_argument("--out", help="result JSON (default benchmarks/results/train_step[_smollm2].json)")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--pool", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.quick and args.config != "tiny":
        p.error("--quick applies to --config tiny only")
    if args.modes:
        unknown = set(args.modes.split(",")) - set(MODES)
        if unknown:
            p.error(f"--modes: unknown {sorted(unknown)}; choose from {','.join(MODES)}")
    for key in ("prompts", "group", "length", "steps", "rounds"):
        if getattr(args, key) is not None and getattr(args, key) < (2 if key == "steps" else 1):
            p.error(f"--{key} must be >= {2 if key == 'steps' else 1}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    sizes = resolve_sizes(args)
    modes = sizes["modes"]
    if "ours_grpo" not in modes:
        raise SystemExit("--modes must include ours_grpo (every ratio is taken against it)")
    if "trl" in modes:
        try:
            import trl
        except ImportError:
            raise SystemExit("TRL is not installed: `make bench` installs the bench profile "
                             "(pip install -r requirements/bench.txt -c requirements/cpu.lock.txt); --no-trl skips it") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    tmp = Path(tempfile.mkdtemp(prefix="bench-train-step-"))
    pool_file = tmp / "pool.jsonl"
    pool = prompt_pool(sizes["model"], sizes["prompts"] * sizes["steps"], max_tokens=160)
    pool_file.write_text("".join(json.dumps(r) + "\n" for r in pool))
    started = time.perf_counter()
    raw: dict[str, list[dict]] = {m: [] for m in modes}
    for rnd in range(sizes["rounds"]):
        for mode in modes:
            out = tmp / f"{mode}-{rnd}.json"
            t0 = time.perf_counter()
            cmd = [sys.executable, __file__, "--worker", mode, "--model", sizes["model"], "--pool", str(pool_file),
                   "--out", str(out), "--prompts", str(sizes["prompts"]), "--group", str(sizes["group"]),
                   "--length", str(sizes["length"]), "--steps", str(sizes["steps"])]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"{mode} failed")
            r = json.loads(out.read_text())
            raw[mode].append(r)
            print(f"round {rnd + 1} {mode:20s} step {round_median(r):.3f} s "
                  f"(median of {len(r['step_times_s']) - 1})  peak RSS {r['peak_rss_mb']:.0f} MB  "
                  f"mean completion {r['mean_response_len']:.1f} tokens  [{time.perf_counter() - t0:.0f} s wall]", flush=True)
    results = {m: summarize(raw[m]) for m in modes}
    g = results["ours_grpo"]
    report = {
        "config": {"name": args.config, "model": sizes["model"], "prompts": sizes["prompts"], "group_size": sizes["group"],
                   "max_completion_tokens": sizes["length"], "steps": sizes["steps"], "rounds": sizes["rounds"],
                   "modes": list(modes), "device": "cpu", "threads_per_process": 1, "quick": args.quick},
        "results": results,
        "wall_s": time.perf_counter() - started,
        "ratio_statistic": "median over rounds of the per-round ratio (min / max in *_rounds)",
        "emapg_over_grpo_step_time_ratio": None,
        "emapg_over_grpo_peak_memory_ratio": None,
        "emapg_over_grpo_k3_reference_step_time_ratio": None,
        "emapg_unshared_prompt_over_grpo_step_time_ratio": None,
        "ours_over_trl_step_time_ratio": None,
        "ours_over_trl_peak_memory_ratio": None,
        "trl_version": None,
    }
    pairs = {"emapg_over_grpo_step_time_ratio": ("ours_emapg", "ours_grpo"),
             "emapg_over_grpo_k3_reference_step_time_ratio": ("ours_emapg", "ours_grpo_k3"),
             "emapg_unshared_prompt_over_grpo_step_time_ratio": ("ours_emapg_unshared", "ours_grpo"),
             "ours_over_trl_step_time_ratio": ("ours_grpo", "trl")}
    for key, (a, b) in pairs.items():
        if a in modes and b in modes:
            stats = paired_ratio(raw, a, b)
            report[key] = stats["median"]
            report[key.replace("_ratio", "_ratio_rounds")] = stats
    if "ours_emapg" in modes:
        report["emapg_over_grpo_peak_memory_ratio"] = results["ours_emapg"]["peak_rss_mb"] / g["peak_rss_mb"]
    if "trl" in modes:
        report["trl_version"] = trl.__version__
        report["ours_over_trl_peak_memory_ratio"] = g["peak_rss_mb"] / results["trl"]["peak_rss_mb"]
    sizes["out"].parent.mkdir(parents=True, exist_ok=True)
    sizes["out"].write_text(json.dumps(report, indent=2) + "\n")
    for m, r in results.items():
        s = r["step_time_s"]
        print(f"{m:20s} step time over {sizes['rounds']} rounds: min {s['min']:.3f}  median {s['median']:.3f}  max {s['max']:.3f} s")
    targets = {"emapg_over_grpo_step_time_ratio": " (target <= 1.10)", "ours_over_trl_step_time_ratio": " (target <= 0.6)"}
    for key in pairs:
        if report[key] is not None:
            r = report[key.replace("_ratio", "_ratio_rounds")]
            print(f"{key} = {r['median']:.3f} [rounds {r['min']:.3f}..{r['max']:.3f}]{targets.get(key, '')}")
    if report["ours_over_trl_peak_memory_ratio"] is not None:
        print(f"ours_over_trl_peak_memory_ratio = {report['ours_over_trl_peak_memory_ratio']:.3f}")
    print(f"wrote {sizes['out']} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
