"""LoRA (r = 16) vs full fine-tuning, both with an EMA anchor: anchor memory, optimizer-state memory,
weight-sync bytes and time, step time.

Two parts, in one run:

* **Qwen2.5-3B, computed exactly** from its parameter shapes (no weights needed): hidden 2048, MLP
  11008, 36 layers, 16 query / 2 key-value heads of 128, vocabulary 151,936, tied embeddings, q/k/v
  biases. Full fine-tuning keeps an fp32 EMA anchor of every parameter (4 B each) and AdamW's two fp32
  moments (8 B each); LoRA keeps the same for the adapters only (the base is shared and frozen). A
  weight sync sends what the trainer's ``Policy.export_weights`` returns: every weight in fp32 for full
  fine-tuning, the adapters in fp32 with LoRA (``sync_bytes_ratio_3b``; the JSON also gives the ratio
  against a bf16 full sync, ``sync_bytes_ratio_3b_bf16_full``). The shape formula is checked against the
  real SmolLM2-135M model's parameter counts (full and LoRA) in the same run.
* **SmolLM2-135M-Instruct, measured** with the trainer's own objects (``Trainer(cfg).setup(with_engine=False)``,
  CPU, fp32): the anchor's and the optimizer's tensor bytes after an update, the bytes of one weight sync
  and its time (``export_weights`` + safetensors serialisation, what the http sync sends, + loading it into
  a transformers engine: ``load_weights`` vs ``load_lora``), and the time of one PPO update (stored
  statistics + update) on the same synthetic batch. Step times are medians over repeats after a warm-up.

LoRA targets every linear layer of the decoder blocks (q, k, v, o, gate, up, down), alpha 32.

    python benchmarks/lora.py --quick     # < 3 min on 2 cores: 4 rows x 32 tokens, 2 timed repeats
    python benchmarks/lora.py             # 16 rows x 128 tokens, 4 timed repeats

Writes ``benchmarks/results/lora.json`` with ``anchor_plus_optimizer_memory_ratio_3b`` and
``sync_bytes_ratio_3b`` (full / LoRA; target >= 50).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RANK = 16
ALPHA = 32.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DecoderShape:
    """The parameter shapes of a Llama/Qwen2-style decoder."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool

    def linears(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each linear layer of one block."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, m = self.hidden, self.intermediate
        return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                "gate_proj": (m, h), "up_proj": (m, h), "down_proj": (h, m)}

    def full_params(self) -> int:
        per_block = sum(o * i for o, i in self.linears().values()) + 2 * self.hidden  # + 2 RMSNorm weights
        if self.qkv_bias:
            per_block += sum(self.linears()[n][0] for n in ("q_proj", "k_proj", "v_proj"))
        embed = self.vocab * self.hidden
        return self.layers * per_block + embed + (0 if self.tied else embed) + self.hidden  # + final norm

    def lora_params(self, rank: int, targets=TARGETS) -> int:
        """A (r, in) + B (out, r) per adapted linear layer."""
        return self.layers * sum(rank * (o + i) for n, (o, i) in self.linears().items() if n in targets)

    @classmethod
    def from_hf_config(cls, c) -> "DecoderShape":
        return cls(c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
                   c.num_key_value_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                   bool(c.tie_word_embeddings), bool(getattr(c, "attention_bias", c.model_type == "qwen2")))


QWEN25_3B = DecoderShape(vocab=151_936, hidden=2048, intermediate=11_008, layers=36, heads=16, kv_heads=2, head_dim=128,
                         tied=True, qkv_bias=True)


def exact_costs(shape: DecoderShape, rank: int) -> dict:
    """Bytes of the EMA anchor, AdamW state and a weight sync, full vs LoRA, from the shapes."""
    n, n_lora = shape.full_params(), shape.lora_params(rank)
    full = {"params_trained": n, "anchor_bytes": 4 * n, "optimizer_bytes": 8 * n, "sync_bytes": 4 * n, "sync_bytes_bf16": 2 * n}
    lora = {"params_trained": n_lora, "anchor_bytes": 4 * n_lora, "optimizer_bytes": 8 * n_lora, "sync_bytes": 4 * n_lora}
    return {
        "full": full, "lora": lora, "rank": rank, "params_total": n,
        "anchor_plus_optimizer_memory_ratio": (full["anchor_bytes"] + full["optimizer_bytes"]) / (lora["anchor_bytes"] + lora["optimizer_bytes"]),
        "sync_bytes_ratio": full["sync_bytes"] / lora["sync_bytes"],
        "sync_bytes_ratio_bf16_full": full["sync_bytes_bf16"] / lora["sync_bytes"],
    }


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_bytes(optimizer) -> int:
    import torch

    return _tensor_bytes(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def _synthetic_batch(rows: int, length: int, vocab: int, group: int):
    """Fixed token ids: ``rows`` trajectories in groups of ``group`` sharing a prompt, prompt and response ``length`` each."""
    import torch

    from trainer.batch import build_token_batch

    g = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for r in range(rows):
        if r % group == 0:
            prompt = torch.randint(10, vocab, (length,), generator=g).tolist()
        prompts.append(prompt)
        responses.append(torch.randint(10, vocab, (length,), generator=g).tolist())
    rewards = torch.tensor([float(i % 2) for i in range(rows)])
    return build_token_batch(prompts, responses, [[1] * length for _ in responses], pad_id=0), rewards


def measure(mode: str, model_dir: str, rows: int, length: int, repeats: int, engine) -> dict:
    import torch
    from safetensors.torch import save

    from emapg.config import load_config
    from emapg.paths import CONFIG_DIR
    from trainer.config import TrainConfig
    from trainer.algo.grpo import broadcast_advantages, grpo_advantages
    from trainer.lora import engine_lora_config
    from trainer.loop import Trainer

    group = 4
    overrides = [
        f"model.policy={model_dir}", "run.output_dir=/tmp/emapg-bench-lora", "logging.progress=false", "logging.tensorboard=false",
        f"data.prompts_per_step={rows // group}", f"rollout.n_samples={group}", f"algorithm.mini_batch_size={rows}",
        f"algorithm.micro_batch_size={min(rows, 4)}", "algorithm.kl.type=topk_reverse", "algorithm.kl.topk=32",
        "algorithm.ema.decay=0.9", "algorithm.ema.period=1", "optim.lr=1e-5", "run.device=cpu",
    ]
    if mode == "lora":
        overrides += ["model.lora.enabled=true", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}"]
    trainer = Trainer(load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", overrides)).setup(with_engine=False)
    try:
        policy = trainer.policy
        batch, rewards = _synthetic_batch(rows, length, trainer.model.config.vocab_size, group)
        group_ids = [str(i // group) for i in range(rows)]
        times = []
        for i in range(repeats + 1):  # the first is a warm-up
            batch.stored.clear()
            t0 = time.perf_counter()
            trainer.compute_stored_stats(batch)
            adv = grpo_advantages(rewards, group_ids)
            batch.stored["advantages"] = broadcast_advantages(adv, batch.loss_mask)
            trainer.update(batch)
            policy.anchor.maybe_update(i + 1)
            if i:
                times.append(time.perf_counter() - t0)
        trained = [p for g in policy.optimizer.param_groups for p in g["params"]]
        sync_times, load_times = [], []
        state = {}
        for _ in range(max(2, repeats)):
            t0 = time.perf_counter()
            state = policy.export_weights(all_ranks=True)
            body = save({k: v.detach().contiguous().clone() for k, v in state.items()})
            t1 = time.perf_counter()
            if mode == "lora":
                engine.load_lora(state, engine_lora_config(policy.model))
            else:
                engine.load_weights(state)
            load_times.append(time.perf_counter() - t1)
            sync_times.append(t1 - t0)
        return {
            "params_trained": sum(p.numel() for p in trained),
            "params_total": sum(p.numel() for p in trainer.model.parameters()),
            "anchor_bytes": _tensor_bytes(policy.anchor.tensors.values()),
            "optimizer_bytes": _optimizer_bytes(policy.optimizer),
            "sync_bytes": _tensor_bytes(state.values()), "sync_tensors": len(state), "sync_body_bytes": len(body),
            "sync_export_serialize_s": statistics.median(sync_times[1:]), "sync_engine_load_s": statistics.median(load_times[1:]),
            "step_times_s": times, "step_time_s": statistics.median(times),
        }
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI size: 4 rows x 32 tokens, 2 timed repeats (< 3 min on 2 cores)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lora.json")
    args = ap.parse_args(argv)
    rows, length, repeats = (4, 32, 2) if args.quick else (16, 128, 4)

    import torch
    from transformers import AutoConfig

    from agent.engines.hf_engine import HFEngine
    from emapg.models import resolve_model

    torch.manual_seed(0)
    started = time.perf_counter()
    model_dir = resolve_model("smollm2-135m-instruct")
    small = DecoderShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    exact_3b = exact_costs(QWEN25_3B, RANK)
    measured = {}
    for mode in ("full", "lora"):
        engine = HFEngine(model_dir, max_model_len=2 * length + 8)  # a fresh engine per mode: LoRA wraps it in peft
        try:
            measured[mode] = measure(mode, model_dir, rows, length, repeats, engine)
        finally:
            engine.close()
        print(f"{mode}: step {measured[mode]['step_time_s']:.2f}s, anchor {measured[mode]['anchor_bytes'] / 2**20:.1f} MiB, "
              f"optimizer {measured[mode]['optimizer_bytes'] / 2**20:.1f} MiB, sync {measured[mode]['sync_bytes'] / 2**20:.2f} MiB", flush=True)
    # The shape formula, checked on the measured model: what the exact 3B figures rest on.
    formula = {"full": small.full_params(), "lora": small.lora_params(RANK)}
    assert formula["full"] == measured["full"]["params_total"], (formula, measured["full"]["params_total"])
    assert formula["lora"] == measured["lora"]["params_trained"], (formula, measured["lora"]["params_trained"])
    f, lo = measured["full"], measured["lora"]
    report = {
        "anchor_plus_optimizer_memory_ratio_3b": exact_3b["anchor_plus_optimizer_memory_ratio"],
        "sync_bytes_ratio_3b": exact_3b["sync_bytes_ratio"],
        "sync_bytes_ratio_3b_bf16_full": exact_3b["sync_bytes_ratio_bf16_full"],
        "qwen2.5-3b_exact": exact_3b,
        "smollm2_135m_measured": {
            "full": f, "lora": lo,
            "anchor_memory_ratio": f["anchor_bytes"] / lo["anchor_bytes"],
            "optimizer_memory_ratio": f["optimizer_bytes"] / lo["optimizer_bytes"],
            "anchor_plus_optimizer_memory_ratio": (f["anchor_bytes"] + f["optimizer_bytes"]) / (lo["anchor_bytes"] + lo["optimizer_bytes"]),
            "sync_bytes_ratio": f["sync_bytes"] / lo["sync_bytes"],
            "sync_time_ratio": (f["sync_export_serialize_s"] + f["sync_engine_load_s"]) / (lo["sync_export_serialize_s"] + lo["sync_engine_load_s"]),
            "full_over_lora_step_time_ratio": f["step_time_s"] / lo["step_time_s"],
            "exact_formula": exact_costs(small, RANK),
        },
        "shape_formula_checked_on_smollm2": formula,
        "conditions": {
            "rank": RANK, "alpha": ALPHA, "targets": list(TARGETS), "rows": rows, "tokens_per_prompt_and_response": length,
            "timed_repeats": repeats, "quick": args.quick, "device": "cpu", "dtype": "float32", "anchor": "fp32 EMA, eta 0.9",
            "kl": "topk_reverse k=32", "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "torch": torch.__version__, "wall_s": round(time.perf_counter() - started, 1),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    sm = report["smollm2_135m_measured"]
    print(f"Qwen2.5-3B (exact, r={RANK}): anchor+optimizer {report['anchor_plus_optimizer_memory_ratio_3b']:.1f}x smaller, "
          f"sync bytes {report['sync_bytes_ratio_3b']:.1f}x ({report['sync_bytes_ratio_3b_bf16_full']:.1f}x vs a bf16 full sync)")
    print(f"SmolLM2-135M (measured): anchor+optimizer {sm['anchor_plus_optimizer_memory_ratio']:.1f}x, sync bytes "
          f"{sm['sync_bytes_ratio']:.1f}x, sync time {sm['sync_time_ratio']:.1f}x, step time full/LoRA {sm['full_over_lora_step_time_ratio']:.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
