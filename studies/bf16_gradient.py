"""Why bf16's first gradient agrees with fp32 only at cosine 0.979 on the demo's rows (issue #41).

``update_speed.py`` measured the bf16-autocast gradient of the first optimizer step at cosine 0.979 to the fp32
gradient on the demo's 16 rows, while a tiny model in the tests reaches 0.9997. Hypothesis, written before this
run: bf16's rounding error in each token's contribution scales with the size of that contribution, but GRPO's
advantages are centred per group, so the policy gradient is a *difference* of large per-trajectory gradients; its
relative error is then the per-term error times ``sum of term sizes / size of the sum``. Test: the same rows, the
same model, the same per-token weights |A| -- once with GRPO's signed advantages, once with their absolute values
(no cancellation between trajectories). If cancellation is the cause, the |A| gradient agrees far better, and the
signed gradient's error ``sqrt(2 (1 - cos))`` is predicted by the |A| error times the norm ratio
``|g_abs| / |g_signed|`` (both in fp32).

The arms update a fresh trainer each (fp32 and bf16 x signed and absolute advantages) on one batch sampled the demo's
way by the starter (as ``update_speed.py``); the gradient is read just before the first optimizer step.

    python studies/bf16_gradient.py           # the demo's rows, SmolLM2-135M starter (~8 min)
    python studies/bf16_gradient.py --quick   # tiny-qwen2, toy rows (< 1 min; bf16 needs a CPU with native bf16)

Writes ``benchmarks/results/bf16_gradient.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from studies import harness  # noqa: E402
harness.environment()

PRECISIONS = {"fp32": "run.precision=fp32", "bf16": "run.precision=bf16"}
ADVANTAGES = ("signed", "absolute", "absolute_uncertain")
CONFIDENT = 0.99  # ``absolute_uncertain``: tokens the starter sampled with at least this probability leave the loss


def without_confident_tokens(trajectories: list[Any]) -> tuple[list[Any], float]:
    """The trajectories with every generated token the engine sampled at probability >= CONFIDENT taken out of the
    loss mask; and the fraction of generated tokens taken out."""
    import dataclasses

    out, dropped, total = [], 0, 0
    for t in trajectories:
        mask = [0 if m and lp >= math.log(CONFIDENT) else m for m, lp in zip(t.loss_mask, t.sampling_logprobs)]
        mask += list(t.loss_mask[len(mask):])
        dropped += sum(t.loss_mask) - sum(mask)
        total += sum(t.loss_mask)
        out.append(dataclasses.replace(t, loss_mask=mask))
    return out, dropped / max(total, 1)


def first_gradient(config: Path, overrides: list[str], sampled: Any, advantages: str) -> tuple[Any, bool]:
    """The first optimizer step's gradient (every trained parameter, float64, flattened) of one update on ``sampled``
    with GRPO's advantages (``signed``), their absolute values (``absolute``), or their absolute values with the
    tokens the starter was sure of (p >= CONFIDENT) out of the loss (``absolute_uncertain``); and whether bf16 ran."""
    import torch

    from emapg.config import load_config
    from trainer.algo.grpo import broadcast_advantages, grpo_advantages
    from trainer.batch import trajectory_batch
    from trainer.config import TrainConfig
    from trainer.loop import Trainer

    cfg = load_config(TrainConfig, config, overrides)
    torch.manual_seed(0)
    trainer = Trainer(cfg).setup(with_engine=False)
    try:
        policy = trainer.policy
        grads: dict[str, torch.Tensor] = {}

        def capture(optimizer: Any, args: Any, kwargs: Any) -> None:
            if not grads:
                grads.update({n: p.grad.detach().flatten().double().clone()
                              for n, p in policy.forward.named_parameters() if p.requires_grad and p.grad is not None})
            raise StopUpdate

        policy.optimizer.register_step_pre_hook(capture)
        group_ids = [p.group_id for p in sampled.prompts for _ in range(cfg.rollout.n_samples)]
        trajectories = sampled.trajectories
        if advantages == "absolute_uncertain":
            trajectories, _ = without_confident_tokens(trajectories)
        batch = trajectory_batch(trajectories, pad_id=trainer.pad_id)
        trainer.compute_stored_stats(batch)
        adv = grpo_advantages(sampled.rewards, group_ids)
        if advantages != "signed":
            adv = adv.abs()
        batch.stored["advantages"] = broadcast_advantages(adv, batch.loss_mask)
        try:
            trainer.update(batch)
        except StopUpdate:
            pass
        return torch.cat([grads[n] for n in sorted(grads)]), policy.bf16
    finally:
        trainer.close()


class StopUpdate(Exception):
    """Raised from the optimizer's pre-step hook: the gradient is read, the step is not needed."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny-qwen2 on a 2k-passage index")
    ap.add_argument("--out", type=Path, default=harness.RESULTS / "bf16_gradient.json")
    harness.add_arguments(ap)
    args = ap.parse_args(argv)
    provenance = harness.start(__file__, quick=args.quick, allow_dirty=args.allow_dirty, also=["benchmarks/update_speed.py"])
    import torch

    from benchmarks.update_speed import base_overrides, sample_rows
    from emapg.cpu import cpu_has_bf16
    from emapg.models import STARTER
    from emapg.paths import CONFIG_DIR
    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever

    started = time.perf_counter()
    policy = "tiny-qwen2" if args.quick else STARTER
    config = CONFIG_DIR / ("search_tiny_cpu.yaml" if args.quick else "demo_search_smollm2.yaml")
    overrides = base_overrides(policy, Path("/tmp/emapg-bench-bf16-gradient"), args.quick)
    grads: dict[tuple[str, str], Any] = {}
    ran_bf16 = False
    with open_retriever(index_dir=ensure_bundled_index(2000 if args.quick else None)) as retriever:
        overrides += [f"retriever.urls=[{retriever.urls[0]}]", "retriever.index_dir=null"]
        sampled = sample_rows(config, overrides)
        rewards = [float(r) for r in sampled.rewards]
        print(f"[bf16_gradient] sampled {len(rewards)} trajectories (reward mean {sum(rewards) / len(rewards):.2f})", flush=True)
        for adv in ADVANTAGES:
            for prec, override in PRECISIONS.items():
                t0 = time.perf_counter()
                grads[prec, adv], bf16 = first_gradient(config, [*overrides, override], sampled, adv)
                ran_bf16 |= bf16
                print(f"[bf16_gradient] {prec} {adv}: |g| {float(grads[prec, adv].norm()):.4g} "
                      f"({time.perf_counter() - t0:.0f} s; bf16 ran: {bf16})", flush=True)
    report: dict[str, Any] = {"benchmark": "bf16_gradient", "mode": "quick" if args.quick else "default", "policy": policy,
                              "provenance": provenance, "config": config.name, "rows": len(rewards), "reward_mean": sum(rewards) / len(rewards),
                              "cpu_native_bf16": cpu_has_bf16(), "bf16_ran": ran_bf16, "advantages": {}}
    for adv in ADVANTAGES:
        a, b = grads["bf16", adv], grads["fp32", adv]
        cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
        report["advantages"][adv] = {
            "cosine_bf16_vs_fp32": cos, "relative_error": math.sqrt(max(0.0, 2 * (1 - cos))),
            "relative_error_direct": float((a - b).norm() / b.norm()), "fp32_norm": float(b.norm()), "bf16_norm": float(a.norm()),
        }
    signed, absolute = report["advantages"]["signed"], report["advantages"]["absolute"]
    report["cancellation_norm_ratio"] = absolute["fp32_norm"] / signed["fp32_norm"]
    report["predicted_signed_relative_error"] = absolute["relative_error"] * report["cancellation_norm_ratio"]
    report["predicted_signed_cosine"] = 1 - report["predicted_signed_relative_error"] ** 2 / 2
    report["confident_token_fraction"] = without_confident_tokens(sampled.trajectories)[1]
    report["machine"] = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
    report["wall_s"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"signed advantages (GRPO): cosine {signed['cosine_bf16_vs_fp32']:.4f} (relative error {signed['relative_error']:.3f})\n"
          f"absolute advantages:      cosine {absolute['cosine_bf16_vs_fp32']:.4f} (relative error {absolute['relative_error']:.3f})\n"
          f"|g_abs| / |g_signed| (fp32) {report['cancellation_norm_ratio']:.2f}: predicted signed error "
          f"{report['predicted_signed_relative_error']:.3f} (cosine {report['predicted_signed_cosine']:.4f})\n"
          f"absolute, tokens sampled at p >= {CONFIDENT} out of the loss ({report['confident_token_fraction']:.0%} of them): cosine "
          f"{report['advantages']['absolute_uncertain']['cosine_bf16_vs_fp32']:.4f}\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
