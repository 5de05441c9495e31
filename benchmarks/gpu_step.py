"""One training update of a Qwen2.5-3B-shaped policy (random weights) with FSDP2: tokens/s and memory.

What it times is the trainer's update half of a step -- the anchor/reference statistics
(``Trainer.compute_stored_stats``), the PPO mini-batches (``Trainer.update``) and the EMA blend
-- on a synthetic rollout batch with the paper's search shape (groups of ``--group`` responses
sharing one prompt). Generation is not included (that is vLLM's, timed by
``benchmarks/rollout_throughput.py``). Two configurations run in turn in one process:

* ``grpo``  -- no KL term, no anchor;
* ``emapg`` -- Top-k reverse KL (k=32, tail sampling + IW) to an EMA anchor blended every step.

The model is built locally from Qwen2.5-3B's shape (hidden 2048, 36 layers, 16/2 heads, MLP 11008,
vocab 151,936, tied embeddings; nothing is downloaded). On CUDA it runs as the trainer does on a
GPU: FSDP2 over a one-rank process group, bf16 compute with fp32 master weights, gradient
checkpointing. ``--shape tiny`` runs the same code on a 2-layer model on CPU (what the test
suite does, to keep this script working where no GPU is available).

    python benchmarks/gpu_step.py                  # on a GPU machine
    python benchmarks/gpu_step.py --shape tiny     # CPU smoke run

Writes ``benchmarks/results/gpu_step.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Qwen2.5-3B's architecture (its config.json), so FLOPs and memory match the paper's policy.
SHAPES = {
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=4096, max_position_embeddings=4096, rope_theta=1e4),
}


def build_model(shape: str, out: Path) -> Path:
    """A random-weight Qwen2 of ``shape`` saved as an HF folder (bf16 weights), with tiny-qwen2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from emapg.models import resolve_model

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], tie_word_embeddings=True, torch_dtype="bfloat16")
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(resolve_model("tiny-qwen2")).save_pretrained(out)
    return out


def synthetic_batch(args: argparse.Namespace, vocab: int, pad_id: int):
    """``batch`` trajectories in groups of ``group`` sharing a prompt; ragged responses, observation spans masked."""
    import torch

    from trainer.batch import build_token_batch

    g = torch.Generator().manual_seed(0)
    prompts, responses, masks = [], [], []
    for _ in range(args.batch // args.group):
        prompt = torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.group):
            n = int(torch.randint(args.response_len // 2, args.response_len + 1, (1,), generator=g))
            response = torch.randint(10, vocab, (n,), generator=g).tolist()
            mask = [1] * n
            for start in range(n // 4, n, n // 2 or 1):  # two tool observations per response, not trained on
                mask[start : start + n // 8] = [0] * len(mask[start : start + n // 8])
            prompts.append(prompt)
            responses.append(response)
            masks.append(mask)
    batch = build_token_batch(prompts, responses, masks, pad_id=pad_id)
    rewards = torch.randint(0, 2, (len(prompts),), generator=g).float()
    group_ids = [str(i // args.group) for i in range(len(prompts))]
    return batch, rewards, group_ids


def overrides(args: argparse.Namespace, model_dir: Path, mode: str, cuda: bool) -> list[str]:
    out = [
        f"run.output_dir={tempfile.mkdtemp(prefix='gpu-step-')}", "run.save_every=0", "logging.progress=false",
        "logging.tensorboard=false", f"model.policy={model_dir}", f"run.device={'cuda' if cuda else 'cpu'}",
        f"run.precision={'bf16' if cuda else 'fp32'}", f"distributed.fsdp={'on' if cuda else 'off'}",
        f"model.gradient_checkpointing={str(cuda).lower()}", f"algorithm.mini_batch_size={args.batch}",
        f"algorithm.micro_batch_size={args.micro_batch}", "algorithm.loss_agg=token-mean", "algorithm.dual_clip=null",
        f"rollout.n_samples={args.group}", f"rollout.max_prompt_tokens={args.prompt_len}",
        f"rollout.max_response_tokens={args.response_len}", "rollout.temperature=1.0",
        f"data.prompts_per_step={args.batch // args.group}",
    ]
    if mode == "emapg":
        out += ["algorithm.kl.enabled=true", "algorithm.kl.type=topk_reverse", "algorithm.kl.topk=32",
                "algorithm.kl.tail_sampling=true", "algorithm.kl.importance_weight=true", "algorithm.kl.coef=0.001",
                "algorithm.ema.decay=0.9", "algorithm.ema.period=1", "algorithm.ema.dtype=bf16" if cuda else "algorithm.ema.dtype=fp32"]
    else:
        out += ["algorithm.kl.enabled=false", "algorithm.ema.decay=1.0"]
    return out


def run_mode(args: argparse.Namespace, model_dir: Path, mode: str, cuda: bool) -> dict:
    import torch

    from emapg.config import load_config
    from emapg.paths import CONFIG_DIR
    from trainer.config import TrainConfig
    from trainer.algo.grpo import broadcast_advantages, grpo_advantages
    from trainer.loop import Trainer

    cfg = load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", overrides(args, model_dir, mode, cuda))
    trainer = Trainer(cfg).setup(with_engine=False)  # no generation engine: this benchmark feeds it rollouts directly
    try:
        batch, rewards, group_ids = synthetic_batch(args, trainer.model.config.vocab_size, trainer.pad_id)
        adv = grpo_advantages(rewards, group_ids)
        times, phases = [], []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for step in range(args.steps):
            batch.stored.clear()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            stored = trainer.compute_stored_stats(batch)
            batch.stored["advantages"] = broadcast_advantages(adv, batch.loss_mask)
            trainer.update(batch)
            if trainer.anchor is not None:
                trainer.anchor.maybe_update(step + 1)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            phases.append(stored)
        tokens = int(batch.attention_mask.sum())
        steady = times[1:] or times
        mean = sum(steady) / len(steady)
        peak = (torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return {
            "plan": plan_beside(cfg, peak, mean, cuda),
            "step_times_s": times,
            "phase_times_s": phases,
            "tokens_per_step": tokens,
            "tokens_per_s": tokens / mean,
            "step_time_s_mean": mean,
            "peak_memory_gib": peak / 2**30,
        }
    finally:
        trainer.close()
        del trainer
        if cuda:
            torch.cuda.empty_cache()


def plan_beside(cfg, measured_peak: int, measured_update_s: float, cuda: bool) -> dict:
    """``emapg plan``'s prediction for this very update (no engine: none runs here), beside what was measured.

    On a GPU the measured peak is ``torch.cuda.max_memory_allocated`` (what the plan predicts); on a CPU it is the
    process's peak RSS, which also holds the interpreter and libraries, so only the GPU figures judge the plan.
    """
    import copy

    from trainer.plan.catalogue import get_device, local_device
    from trainer.plan.planner import plan_run

    c = copy.deepcopy(cfg)
    c.rollout.engine = "remote"  # the update alone: no colocated engine in this benchmark
    plan = plan_run(c, local_device() if cuda else get_device("cpu"), search=False)
    phases = {p: v for p, v in plan.phases.items() if p != "rollout"}
    predicted = max(sum(v.values()) for v in phases.values())
    return {"predicted_peak_bytes": predicted, "measured_peak_bytes": measured_peak,
            "memory_error": (predicted - measured_peak) / measured_peak,
            "predicted_update_s": plan.step_seconds["update"], "measured_update_s": measured_update_s,
            "update_time_error": (plan.step_seconds["update"] - measured_update_s) / measured_update_s,
            "components": plan.memory_bytes, "measured_with": "cuda allocator" if cuda else "peak RSS (not comparable)"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-3b", help="model shape (tiny: CPU smoke run)")
    p.add_argument("--batch", type=int, default=40, help="trajectories per update (one optimizer step)")
    p.add_argument("--group", type=int, default=5, help="trajectories per prompt (the paper's search group size)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (shared within a group)")
    p.add_argument("--response-len", type=int, default=1024, help="maximum response tokens (lengths vary in [L/2, L])")
    p.add_argument("--micro-batch", type=int, default=8, help="trajectories per micro-batch (the paper's 8 per GPU)")
    p.add_argument("--steps", type=int, default=3, help="updates per configuration (the first is a warm-up)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_step.json"), help="result JSON")
    args = p.parse_args()
    if args.batch % args.group:
        p.error("--batch must be a multiple of --group")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    cuda = torch.cuda.is_available()
    if args.shape != "tiny" and not cuda:
        p.error(f"--shape {args.shape} needs a CUDA GPU; use --shape tiny for a CPU smoke run")
    if cuda:  # FSDP2 needs a process group, even of one rank
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    with tempfile.TemporaryDirectory(prefix="gpu-step-model-") as tmp:
        t0 = time.perf_counter()
        model_dir = build_model(args.shape, Path(tmp) / "model")
        print(f"built {args.shape} in {time.perf_counter() - t0:.0f} s")
        results = {}
        for mode in ("grpo", "emapg"):
            results[mode] = r = run_mode(args, model_dir, mode, cuda)
            print(f"{mode:6s} update {r['step_time_s_mean']:.3f} s  {r['tokens_per_s']:.0f} tokens/s  "
                  f"peak {r['peak_memory_gib']:.1f} GiB  phases {r['phase_times_s'][-1]}")
    report = {
        "config": {**vars(args), "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__},
        "results": results,
        "emapg_over_grpo_update_time_ratio": results["emapg"]["step_time_s_mean"] / results["grpo"]["step_time_s_mean"],
        "emapg_over_grpo_peak_memory_ratio": results["emapg"]["peak_memory_gib"] / results["grpo"]["peak_memory_gib"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"emapg_over_grpo_update_time_ratio = {report['emapg_over_grpo_update_time_ratio']:.3f}")
    print(f"wrote {args.out}")
    if cuda:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
