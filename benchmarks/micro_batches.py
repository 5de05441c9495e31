"""Token-budget vs fixed-row micro-batches: the PPO update's step time and padding on ragged search trajectories.

What it times is the update half of a training step (``Trainer.compute_stored_stats`` and
``Trainer.update``: EMA-PG, Top-k reverse KL k=32 to an EMA anchor, token-mean loss) on a batch of
search trajectories built like the agent's: a real Search-R1 prompt for a real NQ train question,
then 0-3 rounds of a model turn and an ``<information>`` observation of three real passages of the
bundled corpus (cut at ``max_obs`` tokens, masked out of the loss), then an answer turn. Turn
counts and model-turn lengths are drawn per trajectory (seeded), so rows are as ragged as real
rollouts are. The generation itself is not timed (``benchmarks/rollout_throughput.py`` does that).

Two micro-batch plans of the same update, side by side in one process on one model (steps
alternate, so a burst of load from elsewhere hits both):

* ``fixed``  -- ``algorithm.micro_batch_size`` consecutive rows per forward/backward (today's default);
* ``tokens`` -- ``algorithm.micro_batch_tokens`` = micro_batch_size × (max prompt + max response
  tokens): the same worst-case activation memory, rows sorted by length and packed
  (:func:`trainer.batch.plan_micro_batches`).

Both give the same loss and gradient (``tests/trainer/test_step.py``: float64, to rounding); what
differs is the padding the model computes (``perf/padding_frac``) and so the time. Both run with
``model.share_prompt`` / ``share_prompt_training`` (the defaults: each distinct prompt of a
micro-batch runs once, in the training pass too), so what a plan's forwards really compute is ``distinct prompts × widest prompt
+ rows × widest response`` per micro-batch (``shared_computed_tokens``); the token-budget planner
keeps a group together where that costs no extra forward. It also reports
the planner's padding alone (no model run) at the paper's full search shape (Search-R1: 512
trajectories, observations of up to 500 tokens, responses of up to 4096, micro-batches of 8).

    python benchmarks/micro_batches.py --threads 2   # SmolLM2-135M, ~6 min on 2 idle cores
    python benchmarks/micro_batches.py --quick    # tiny-qwen2, a smoke run (CI)

Writes ``benchmarks/results/micro_batches.json`` (``--out`` to change) with
``tokens_over_fixed_step_time_ratio`` (median over rounds) and both padding fractions.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS_DIR = ROOT / "benchmarks" / "results"
CORPUS = ROOT / "data" / "corpus" / "wiki_mini.jsonl.gz"
SIZES = {
    "smollm2": dict(model="smollm2-135m-instruct", prompts=2, group=4, micro=2, max_obs=128, max_response=640, rounds=2),
    "quick": dict(model="tiny-qwen2", prompts=4, group=4, micro=4, max_obs=64, max_response=256, rounds=2),
}


def search_trajectories(tok, n_prompts: int, group: int, *, max_obs: int, max_response: int, seed: int = 0):
    """(prompts, responses, loss masks) of ``n_prompts × group`` search-shaped trajectories (see the module doc)."""
    from agent.actions import format_passages, information_text
    from agent.prompts import build_prompt
    from tasks.datasets import load_dataset

    rng = random.Random(seed)
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        passages = [json.loads(line) for _, line in zip(range(2000), f)]
    questions = [ex.question for _, ex in zip(range(n_prompts), load_dataset("nq", split="train"))]
    vocab = len(tok)
    prompts, responses, masks = [], [], []
    for question in questions:
        prompt = build_prompt(tok, question, "search_r1").token_ids
        for _ in range(group):
            ids: list[int] = []
            mask: list[int] = []
            for _ in range(rng.choices([0, 1, 2, 3], weights=[0.1, 0.35, 0.3, 0.25])[0]):
                turn = [rng.randrange(100, vocab) for _ in range(rng.randint(16, 64))]  # think + <search> query
                hits = [{"id": p["id"], "contents": p["contents"]} for p in rng.sample(passages, 3)]
                obs = tok(information_text(format_passages(hits)), add_special_tokens=False)["input_ids"][:max_obs]
                ids += turn + obs
                mask += [1] * len(turn) + [0] * len(obs)
            answer = [rng.randrange(100, vocab) for _ in range(rng.randint(8, 32))]  # think + <answer>
            ids, mask = (ids + answer)[:max_response], (mask + [1] * len(answer))[:max_response]
            prompts.append(prompt)
            responses.append(ids)
            masks.append(mask)
    return prompts, responses, masks


def full_shape_padding(seed: int = 0) -> dict:
    """The planner's padding alone at the paper's search shape: 128 prompts × 4 samples, 1-4 searches with
    observations of 350-500 tokens, responses cut at 4096, micro-batches of 8 rows (lengths only, no model)."""
    from trainer.batch import build_token_batch
    from trainer.batch import plan_micro_batches

    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(128):
        prompt = [1] * rng.randint(180, 260)
        for _ in range(4):
            n = sum(rng.randint(20, 120) + rng.randint(350, 500)
                    for _ in range(rng.choices([1, 2, 3, 4], weights=[0.35, 0.35, 0.2, 0.1])[0]))
            prompts.append(prompt)
            responses.append([1] * min(4096, n + rng.randint(10, 60)))
    batch = build_token_batch(prompts, responses, [[1] * len(r) for r in responses], pad_id=0)
    real = float(batch.attention_mask.sum())
    micro, budget = 8, 8 * (260 + 4096)
    out: dict = {"rows": len(prompts), "micro_batch_size": micro, "micro_batch_tokens": budget, "real_tokens": real}
    for name, plan in (("fixed", plan_micro_batches(batch, range(len(prompts)), micro)),
                       ("tokens", plan_micro_batches(batch, range(len(prompts)), micro, budget, share_prompts=True))):
        computed = sum(batch.micro(r).input_ids.numel() for r in plan)
        out[name] = {"micro_batches": len(plan), "computed_tokens": computed, "padding_frac": 1 - real / computed,
                     "shared_computed_tokens": shared_computed_tokens(batch, plan)}
    out["tokens_over_fixed_computed_ratio"] = out["tokens"]["computed_tokens"] / out["fixed"]["computed_tokens"]
    out["tokens_over_fixed_shared_computed_ratio"] = (out["tokens"]["shared_computed_tokens"]
                                                      / out["fixed"]["shared_computed_tokens"])
    return out


def shared_computed_tokens(batch, plan) -> int:
    """Tokens the forwards of ``plan`` compute with prompt sharing: per micro-batch, each distinct prompt
    once at the widest prompt's width, every row's response at the widest response's width."""
    import torch

    total = 0
    for rows in plan:
        mb = batch.micro(rows)
        width = mb.input_ids.shape[1] - mb.response_width
        prompts = mb.input_ids[:, :width].masked_fill(mb.attention_mask[:, :width] == 0, -1)
        total += torch.unique(prompts, dim=0).shape[0] * width + mb.input_ids.shape[0] * mb.response_width
    return total


def overrides(sizes: dict, batch_rows: int) -> list[str]:
    return [
        f"run.output_dir={tempfile.mkdtemp(prefix='bench-micro-')}", "run.save_every=0", "logging.progress=false",
        "logging.tensorboard=false", f"model.policy={sizes['model']}", "run.device=cpu", "distributed.fsdp=off",
        f"algorithm.mini_batch_size={batch_rows}", f"algorithm.micro_batch_size={sizes['micro']}", "algorithm.loss_agg=token-mean",
        f"rollout.n_samples={sizes['group']}", f"data.prompts_per_step={sizes['prompts']}", "rollout.temperature=1.0",
        f"rollout.max_response_tokens={sizes['max_response']}", "algorithm.kl.enabled=true", "algorithm.kl.type=topk_reverse",
        "algorithm.kl.topk=32", "algorithm.kl.coef=0.001", "algorithm.ema.decay=0.9", "algorithm.ema.period=1", "optim.lr=1e-6",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny-qwen2 and small sizes: a smoke run")
    p.add_argument("--rounds", type=int, help="timed steps of each plan (after a two-row warm-up of each)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", help="result JSON (default benchmarks/results/micro_batches[_quick].json)")
    args = p.parse_args(argv)
    sizes = dict(SIZES["quick" if args.quick else "smollm2"])
    if args.rounds is not None:
        if args.rounds < 1:
            p.error("--rounds must be >= 1")
        sizes["rounds"] = args.rounds
    out_path = Path(args.out) if args.out else RESULTS_DIR / ("micro_batches_quick.json" if args.quick else "micro_batches.json")

    import torch

    torch.set_num_threads(args.threads)
    from emapg.config import load_config
    from emapg.paths import CONFIG_DIR
    from trainer.batch import build_token_batch
    from trainer.config import TrainConfig
    from trainer.algo.grpo import broadcast_advantages, grpo_advantages
    from trainer.loop import Trainer

    rows = sizes["prompts"] * sizes["group"]
    cfg = load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", overrides(sizes, rows))
    trainer = Trainer(cfg).setup(with_engine=False)  # the update only: batches are fed directly
    started = time.perf_counter()
    try:
        prompts, responses, masks = search_trajectories(trainer.tokenizer, sizes["prompts"], sizes["group"],
                                                        max_obs=sizes["max_obs"], max_response=sizes["max_response"])
        max_prompt = max(len(x) for x in prompts)
        budget = sizes["micro"] * (max_prompt + sizes["max_response"])  # fixed rows' worst-case memory
        plans = {"fixed": cfg, "tokens": replace(cfg, algorithm=replace(cfg.algorithm, micro_batch_tokens=budget))}
        g = torch.Generator().manual_seed(0)
        rewards = torch.randint(0, 2, (rows,), generator=g).float()
        adv = grpo_advantages(rewards, [str(i // sizes["group"]) for i in range(rows)])
        from trainer.batch import micro_batches

        whole = build_token_batch(prompts, responses, masks, pad_id=trainer.pad_id)
        shared = {name: shared_computed_tokens(whole, micro_batches(whole, range(rows), c.algorithm,
                                                                    share_prompts=c.model.share_prompt))
                  for name, c in plans.items()}
        times: dict[str, list[float]] = {name: [] for name in plans}
        padding: dict[str, float] = {}
        phases: dict[str, list[dict]] = {name: [] for name in plans}
        for name, plan_cfg in plans.items():  # warm-up (first-call allocations) on two rows
            trainer.cfg = plan_cfg
            warm = build_token_batch(prompts[:2], responses[:2], masks[:2], pad_id=trainer.pad_id)
            trainer.compute_stored_stats(warm)
            warm.stored["advantages"] = broadcast_advantages(adv[:2], warm.loss_mask)
            trainer.update(warm)
        for step in range(1, sizes["rounds"] + 1):
            for name, plan_cfg in plans.items():
                trainer.cfg = plan_cfg
                batch = build_token_batch(prompts, responses, masks, pad_id=trainer.pad_id)
                t0 = time.perf_counter()
                stored = trainer.compute_stored_stats(batch)
                batch.stored["advantages"] = broadcast_advantages(adv, batch.loss_mask)
                metrics = trainer.update(batch)
                dt = time.perf_counter() - t0
                padding[name] = metrics["perf/padding_frac"]
                times[name].append(dt)
                phases[name].append(stored)
                print(f"round {step} {name:6s} {dt:7.2f} s  padding {padding[name]:.3f}", flush=True)
    finally:
        trainer.cfg = cfg
        trainer.close()
    per_round = [t / f for t, f in zip(times["tokens"], times["fixed"])]
    real = sum(len(x) for x in prompts) + sum(len(x) for x in responses)
    report = {
        "config": {**sizes, "rows": rows, "micro_batch_tokens": budget, "threads": args.threads, "device": "cpu",
                   "kl": "topk_reverse k=32, EMA anchor", "on_policy_fused": True},
        "real_tokens": real,
        "response_tokens": {"min": min(map(len, responses)), "median": statistics.median(map(len, responses)),
                            "max": max(map(len, responses))},
        "prompt_tokens": {"min": min(map(len, prompts)), "max": max_prompt},
        "results": {name: {"step_times_s": times[name], "step_time_s_median": statistics.median(times[name]),
                           "padding_frac": padding[name], "shared_computed_tokens": shared[name],
                           "phase_times_s": phases[name]} for name in plans},
        "tokens_over_fixed_step_time_ratio": statistics.median(per_round),
        "tokens_over_fixed_step_time_ratio_rounds": {"per_round": per_round, "min": min(per_round), "max": max(per_round)},
        "padding_frac_fixed": padding["fixed"],
        "padding_frac_tokens": padding["tokens"],
        "full_search_shape_planner": full_shape_padding(),
        "wall_s": time.perf_counter() - started,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    full = report["full_search_shape_planner"]
    print(f"tokens_over_fixed_step_time_ratio = {report['tokens_over_fixed_step_time_ratio']:.3f} "
          f"[rounds {min(per_round):.3f}..{max(per_round):.3f}]; padding fixed {padding['fixed']:.3f} -> tokens {padding['tokens']:.3f}; "
          f"tokens computed with prompt sharing fixed {shared['fixed']} -> tokens {shared['tokens']}")
    print(f"full search shape (planner only, 512 rows): padding fixed {full['fixed']['padding_frac']:.3f} -> "
          f"tokens {full['tokens']['padding_frac']:.3f}; computed tokens ratio {full['tokens_over_fixed_computed_ratio']:.3f}")
    print(f"wrote {out_path} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
