"""The training update on the demo's own rows: fp32 full fine-tuning vs bf16 autocast vs LoRA vs LoRA + bf16.

What the CPU demo's step spends most of its time on is the update, not generation (49 of each 60-s step in the
2026-12-04 demo, 6 s generation). This measures the update side by side in one run, on the same rows:

1. **The rows.** The starter search policy (``emapg.models.STARTER``) samples one batch the demo's way:
   ``configs/demo_search_smollm2.yaml`` (4 prompts x 4 samples, T = 1, 2 turns), questions of the answerable
   training pool (``qa_pool``), through the real retriever over the bundled index (transformers engine).
2. **The arms**, each a fresh :class:`trainer.loop.Trainer` on the demo config (EMA-PG: Top-k reverse KL k = 32 to
   an EMA anchor), the same rows and advantages: ``fp32`` (today's demo), ``bf16`` (``run.precision=bf16``: bf16
   autocast over fp32 master weights where the CPU multiplies bf16 natively -- the JSON says whether it did),
   ``lora`` (``model.lora.enabled``, r = 16, every linear layer of the decoder, fp32) and ``lora_bf16``.
   Per arm: the update (stored statistics + the PPO update + the EMA blend), timed after a warm-up, median over
   repeats; the weight export a remote engine needs after every update (``Policy.export_weights`` + safetensors
   serialisation, what the http sync sends); trajectories trained per minute of update + export.
3. **Agreement with the fp32 reference**: the first optimizer step's gradient of ``bf16`` against ``fp32`` (and of
   ``lora_bf16`` against ``lora``), captured just before ``optimizer.step``: cosine over every trained parameter and
   the ratio of norms; the stated tolerance is gradient cosine >= 0.99 and norms within 5%
   (``tests/trainer/test_step.py`` checks the same on a tiny model). The first AdamW *parameter* step is reported too
   but is not the criterion: with bias correction it is lr·g/(|g| + eps) ≈ lr·sign(g) per element, so its cosine
   counts sign agreements and is dragged down by the many near-zero gradient entries whose sign rounding flips
   (measured 2026-12-05: gradient cosine vs step cosine in the JSON).

Rounds alternate the arms (fp32, bf16, lora, lora_bf16, fp32, ...) so that a burst of other load hits one round of
each, not one arm. Writes ``benchmarks/results/update_speed.json`` with ``bf16_over_fp32_speedup``,
``lora_over_fp32_speedup``, ``lora_bf16_over_fp32_speedup`` (update + export time, fp32 / arm) and per arm
``trajectories_per_update_min``.

    python benchmarks/update_speed.py           # the demo's rows (16 trajectories), 2 rounds x 2 timed updates (~10 min)
    python benchmarks/update_speed.py --quick   # tiny-qwen2, toy rows: a smoke run (< 1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ARMS: dict[str, list[str]] = {
    "fp32": ["run.precision=fp32"],
    "bf16": ["run.precision=bf16"],
    "lora": ["run.precision=fp32", "model.lora.enabled=true", "model.lora.rank=16", "model.lora.alpha=32"],
    "lora_bf16": ["run.precision=bf16", "model.lora.enabled=true", "model.lora.rank=16", "model.lora.alpha=32"],
}
REFERENCE = {"bf16": "fp32", "lora_bf16": "lora"}


def base_overrides(policy: str, out: Path, quick: bool) -> list[str]:
    common = [f"model.policy={policy}", f"run.output_dir={out}", "logging.progress=false", "logging.tensorboard=false",
              "run.device=cpu", "algorithm.ema.period=1", "data.train=qa_pool", "data.split=train"]
    if quick:
        return [*common, "rollout.engine=hf", "rollout.max_tokens_per_turn=16", "rollout.max_obs_tokens=64"]
    return [*common, "rollout.engine=hf"]


def sample_rows(config: Path, overrides: list[str]) -> Any:
    """One batch sampled the demo's way by the starter (its trajectories, rewards and group ids)."""
    from emapg.config import load_config
    from trainer.config import TrainConfig
    from trainer.loop import Trainer

    trainer = Trainer(load_config(TrainConfig, config, overrides)).setup(with_engine=True)
    try:
        return trainer.sample_batch(trainer.sample_prompts())
    finally:
        trainer.close()


def trained_tensors(policy: Any) -> dict[str, Any]:
    """The trained parameters (every weight, or the LoRA adapters), detached copies, by name."""
    return {n: p.detach().clone() for n, p in policy.forward.named_parameters() if p.requires_grad}


def measure(arm: str, config: Path, overrides: list[str], sampled: Any, repeats: int) -> dict[str, Any]:
    import torch
    from safetensors.torch import save

    from emapg.config import load_config
    from trainer.algo.grpo import broadcast_advantages, grpo_advantages
    from trainer.batch import trajectory_batch
    from trainer.config import TrainConfig
    from trainer.loop import Trainer

    cfg = load_config(TrainConfig, config, [*overrides, *ARMS[arm]])
    torch.manual_seed(0)
    trainer = Trainer(cfg).setup(with_engine=False)
    try:
        policy = trainer.policy
        group_ids = [p.group_id for p in sampled.prompts for _ in range(cfg.rollout.n_samples)]
        update_s, export_s, first_step = [], [], None
        first_grad: dict[str, torch.Tensor] = {}

        def capture_gradient(optimizer: Any, args: Any, kwargs: Any) -> None:
            if not first_grad:  # the first optimizer step of the first update: its (clipped) gradient
                first_grad.update({n: p.grad.detach().flatten().double().clone()
                                   for n, p in policy.forward.named_parameters() if p.requires_grad and p.grad is not None})

        hook = policy.optimizer.register_step_pre_hook(capture_gradient)
        for i in range(repeats + 1):  # the first is a warm-up; its parameter step is compared with the reference
            batch = trajectory_batch(sampled.trajectories, pad_id=trainer.pad_id)
            before = trained_tensors(policy) if i == 0 else None
            t0 = time.perf_counter()
            trainer.compute_stored_stats(batch)
            adv = grpo_advantages(sampled.rewards, group_ids)
            batch.stored["advantages"] = broadcast_advantages(adv, batch.loss_mask)
            trainer.update(batch)
            policy.anchor.maybe_update(i + 1)
            t1 = time.perf_counter()
            state = policy.export_weights(all_ranks=True)
            save({k: v.detach().contiguous().clone() for k, v in state.items()})  # tied weights: a copy each, as lora.py
            t2 = time.perf_counter()
            if before is not None:
                hook.remove()
                after = trained_tensors(policy)
                first_step = torch.cat([(after[n] - before[n]).flatten().double() for n in sorted(before)])
            else:
                update_s.append(t1 - t0)
                export_s.append(t2 - t1)
        rows = len(sampled.trajectories)
        return {
            "compute_bf16": policy.bf16, "rows": rows,
            "tokens": int(sum(len(t.response_ids) + len(t.prompt_ids) for t in sampled.trajectories)),
            "update_s": update_s, "export_s": export_s,
            "trained_params": int(sum(p.numel() for p in policy.forward.parameters() if p.requires_grad)),
            "_first_step": first_step,
            "_first_grad": torch.cat([first_grad[n] for n in sorted(first_grad)]) if first_grad else None,
            "grad_clip": cfg.optim.grad_clip, "optimizer_eps": cfg.optim.eps,
        }
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny-qwen2 on a 2k-passage index, 1 round x 1 timed update")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the arms (alternating)")
    ap.add_argument("--repeats", type=int, default=2, help="timed updates per arm and round (after one warm-up)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "update_speed.json")
    args = ap.parse_args(argv)
    import torch

    from emapg.models import STARTER
    from emapg.paths import CONFIG_DIR
    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever
    from emapg.cpu import cpu_has_bf16

    started = time.perf_counter()
    rounds, repeats = (1, 1) if args.quick else (args.rounds, args.repeats)
    policy = "tiny-qwen2" if args.quick else STARTER
    config = CONFIG_DIR / ("search_tiny_cpu.yaml" if args.quick else "demo_search_smollm2.yaml")
    out_dir = Path("/tmp/emapg-bench-update-speed")
    overrides = base_overrides(policy, out_dir, args.quick)
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    with open_retriever(index_dir=ensure_bundled_index(2000 if args.quick else None)) as retriever:
        overrides += [f"retriever.urls=[{retriever.urls[0]}]", "retriever.index_dir=null"]
        t0 = time.perf_counter()
        sampled = sample_rows(config, overrides)
        sample_s = time.perf_counter() - t0
        print(f"[update_speed] sampled {len(sampled.trajectories)} trajectories in {sample_s:.0f} s "
              f"(reward mean {float(sampled.rewards.mean()):.2f})", flush=True)
        for r in range(rounds):
            for arm in ARMS:
                m = measure(arm, config, overrides, sampled, repeats)
                runs[arm].append(m)
                print(f"[update_speed] round {r + 1} {arm}: update {statistics.median(m['update_s']):.1f} s, "
                      f"export {statistics.median(m['export_s']):.2f} s (bf16 ran: {m['compute_bf16']})", flush=True)
    report: dict[str, Any] = {"benchmark": "update_speed", "mode": "quick" if args.quick else "default", "policy": policy,
                              "config": config.name, "rows": len(sampled.trajectories),
                              "tokens": runs["fp32"][0]["tokens"], "cpu_native_bf16": cpu_has_bf16(), "arms": {}}
    for arm, ms in runs.items():
        upd = [x for m in ms for x in m["update_s"]]
        exp = [x for m in ms for x in m["export_s"]]
        total = statistics.median(upd) + statistics.median(exp)
        report["arms"][arm] = {
            "overrides": ARMS[arm], "compute_bf16": ms[0]["compute_bf16"], "trained_params": ms[0]["trained_params"],
            "update_s": upd, "update_s_median": statistics.median(upd), "export_s_median": statistics.median(exp),
            "update_plus_export_s": total, "trajectories_per_update_min": 60 * len(sampled.trajectories) / total,
        }
    fp32 = report["arms"]["fp32"]["update_plus_export_s"]
    for arm in ("bf16", "lora", "lora_bf16"):
        report[f"{arm}_over_fp32_speedup"] = fp32 / report["arms"][arm]["update_plus_export_s"]
        report[f"{arm}_over_fp32_update_only_speedup"] = report["arms"]["fp32"]["update_s_median"] / report["arms"][arm]["update_s_median"]
    for arm, ref in REFERENCE.items():
        ga, gb = runs[arm][0]["_first_grad"], runs[ref][0]["_first_grad"]
        a, b = runs[arm][0]["_first_step"], runs[ref][0]["_first_step"]
        grad_cos = float(torch.nn.functional.cosine_similarity(ga, gb, dim=0))
        grad_ratio = float(ga.norm() / gb.norm())
        report["arms"][arm]["first_gradient_vs_" + ref] = {
            "cosine": grad_cos, "norm_ratio": grad_ratio, "tolerance": "cosine >= 0.99 and norm ratio within 5%",
            "within_tolerance": grad_cos >= 0.99 and abs(grad_ratio - 1.0) <= 0.05,
        }
        report["arms"][arm]["first_adamw_step_vs_" + ref] = {
            "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)), "norm_ratio": float(a.norm() / b.norm()),
            "sign_agreement": float(((a > 0) == (b > 0)).double().mean()),
            "note": "AdamW's first step is ~lr*sign(g) per element: a sign-agreement measure, not the criterion",
        }
    report["conditions"] = {"rounds": rounds, "timed_repeats": repeats, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                            "platform": platform.platform(), "torch": torch.__version__, "sample_s": round(sample_s, 1),
                            "wall_s": round(time.perf_counter() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for arm, a in report["arms"].items():
        agree = a.get(f"first_gradient_vs_{REFERENCE.get(arm)}", {})
        print(f"{arm:<10} update {a['update_s_median']:6.1f} s + export {a['export_s_median']:5.2f} s -> "
              f"{a['trajectories_per_update_min']:5.1f} trajectories/min" + (f", first gradient cosine vs {REFERENCE[arm]} "
                                                                            f"{agree['cosine']:.4f}" if agree else ""))
    print(f"speed-up over fp32 (update + export): bf16 {report['bf16_over_fp32_speedup']:.2f}x, lora {report['lora_over_fp32_speedup']:.2f}x, "
          f"lora_bf16 {report['lora_bf16_over_fp32_speedup']:.2f}x")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
