"""Seconds per training step, by phase, from FLOPs, bytes and the device's achievable rates.

* ``rollout``: prefill (2·N FLOPs per prompt and observation token) at ``prefill_fraction`` of peak, then decoding:
  each decode step costs the engine's fixed ``decode_step_latency`` and ``decode_layer_latency`` per decoder layer,
  plus reading the weights once for the whole concurrent batch (``decode_fraction`` of the memory bandwidth) and
  2·N·batch FLOPs (``decode_flops_fraction`` of peak), whichever is slower (:func:`decode_step_seconds`); a vLLM
  KV cache too small for every sequence at once takes several waves.
* ``update``: the training pass at 6 FLOPs per parameter and token (4 with LoRA: no weight gradients of the frozen
  base), attention's 2·L·T·h per token forward (x3 trained), plus each extra no-grad forward the config needs at 2
  per parameter and token: π_old's pass when the update is not on-policy (several mini-batches or epochs) or needs
  π_old's top-k, the anchor's, a local teacher's, ``logging.kl_to_start``'s two; at ``update_fraction`` of peak.
  The decoder layers run on every token of the pass; the lm_head only on the response positions (the fused,
  chunked head of :func:`trainer.model_forward.causal_lm_hidden` projects ``hidden[:, -T-1:-1]``). Gradient
  checkpointing adds one more forward of each layer (and its attention) per trained token, up to the layer's last
  saved tensor -- the input of ``down_proj`` (torch's non-reentrant checkpoint stops recomputing there: early stop)
  -- and no lm_head. Under FSDP2 each micro-batch's all-gathers and reduce-scatter overlap its compute (the
  slower of the two counts). The optimizer step and the EMA blend are memory-bound passes over their tensors.
* ``sync``: the weights the engine gets (bf16 on a GPU, fp32 on a CPU; LoRA adapters only) over ``sync_bandwidth``
  (a colocated engine) or the network (remote servers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.config import TrainConfig
from trainer.plan.catalogue import Device, ModelShape
from trainer.plan.memory import FP32, Layout, generated_tokens


@dataclass(frozen=True)
class Rates:
    """Achievable rates: FLOP/s of the update and of prefill, bytes/s of decoding, the engine's fixed seconds per
    decode step and per decoder layer of a decode step, and FLOP/s of the decode step's arithmetic (``--probe``
    refits them all)."""

    update_flops: float
    prefill_flops: float
    decode_bandwidth: float
    decode_step_latency: float
    decode_layer_latency: float = 0.0
    decode_flops: float | None = None  # None: prefill_flops

    @classmethod
    def assumed(cls, device: Device) -> "Rates":
        decode_fraction = device.prefill_fraction if device.decode_flops_fraction is None else device.decode_flops_fraction
        return cls(device.bf16_flops * device.update_fraction, device.bf16_flops * device.prefill_fraction,
                   device.memory_bandwidth * device.decode_fraction, device.decode_step_latency,
                   device.decode_layer_latency, device.bf16_flops * decode_fraction)

    @property
    def decode_compute_flops(self) -> float:
        return self.prefill_flops if self.decode_flops is None else self.decode_flops


def needs_old_pass(cfg: TrainConfig, lay: Layout) -> tuple[bool, bool]:
    """(π_old pass runs, the anchor pass runs): :func:`trainer.stored_stats.plan_stored_stats`'s decision."""
    from trainer.algo.kl_kinds import get_kl_kind

    kl = cfg.algorithm.kl
    on_policy = cfg.algorithm.ppo_epochs == 1 and lay.rows <= max(1, cfg.algorithm.mini_batch_size // lay.world)
    needs = get_kl_kind(kl.type).needs(kl) if kl.enabled else None
    old_topk = bool(needs and needs.topk and needs.topk_of == "old")
    fused = old_topk and on_policy and lay.shard == 1
    old_pass = not fused and (not on_policy or old_topk)
    anchor = needs is not None and bool(needs.anchor_tokens or needs.exact or needs.topk)
    return old_pass, anchor


def update_flops(cfg: TrainConfig, shape: ModelShape, lay: Layout, teacher: ModelShape | None) -> float:
    ckpt = cfg.model.gradient_checkpointing
    trained_tokens = lay.step_tokens(cfg.model.share_prompt and cfg.model.share_prompt_training and not ckpt)
    free_tokens = lay.step_tokens(cfg.model.share_prompt)
    head_tokens = lay.rows * lay.response_tokens  # the positions the lm_head projects (each row's response)
    attention = 2 * shape.num_hidden_layers * lay.seq_tokens * shape.hidden_size  # per token, forward
    trained = 4 if cfg.model.lora.enabled else 6
    per_trained = trained * shape.body_matmul_params + 3 * attention
    if ckpt:  # each layer's forward again, up to down_proj's input (early stop), in the backward
        per_trained += 2 * shape.recomputed_layer_params * shape.num_hidden_layers + attention
    flops = cfg.algorithm.ppo_epochs * (trained_tokens * per_trained + head_tokens * trained * shape.embedding_params)
    old_pass, anchor = needs_old_pass(cfg, lay)
    forwards = int(old_pass) + int(anchor) + (2 if cfg.logging.kl_to_start else 0)
    flops += forwards * (free_tokens * (2 * shape.body_matmul_params + attention) + head_tokens * 2 * shape.embedding_params)
    kl = cfg.algorithm.kl
    if kl.enabled and kl.type.startswith("exact"):  # the anchor's full-vocabulary head in the training pass
        flops += 3 * 2 * shape.embedding_params * head_tokens
    d = cfg.algorithm.distill
    if d.enabled and d.teacher:
        t = teacher or shape
        flops += 2 * (free_tokens * t.body_matmul_params + head_tokens * t.embedding_params)
    return float(flops)


def update_seconds(cfg: TrainConfig, shape: ModelShape, lay: Layout, device: Device, rates: Rates,
                   teacher: ModelShape | None) -> float:
    compute = update_flops(cfg, shape, lay, teacher) / rates.update_flops
    lora = cfg.model.lora
    trainable = shape.lora_params(lora.rank, lora.target_modules) if lora.enabled else shape.params
    if lay.shard > 1:  # FSDP2: gather (bf16) forward and backward, reduce-scatter fp32 gradients, per micro-batch
        bandwidth = device.internode_bandwidth if lay.nodes > 1 else device.interconnect_bandwidth
        per_micro = (2 * shape.params * device.compute_bytes + trainable * FP32) * (lay.shard - 1) / lay.shard / bandwidth
        micro = cfg.algorithm.ppo_epochs * lay.mini_batches * lay.micro_batches_per_mini
        compute = max(compute, micro * per_micro)
    optimizer = cfg.algorithm.ppo_epochs * lay.mini_batches * trainable * FP32 * 8 / lay.shard / device.memory_bandwidth
    ema = cfg.algorithm.ema
    blend = 0.0
    if cfg.algorithm.kl.enabled and ema.decay < 1.0:
        blend = trainable * FP32 * 3 / lay.shard / device.memory_bandwidth / ema.period
    return compute + optimizer + blend


def rollout_seconds(cfg: TrainConfig, shape: ModelShape, lay: Layout, device: Device, rates: Rates) -> float:
    r = cfg.rollout
    n = shape.matmul_params
    gen = generated_tokens(cfg)
    prefill = lay.rows * (lay.prompt_tokens + lay.response_tokens - gen) * 2 * n / rates.prefill_flops
    weight_bytes = shape.params * device.compute_bytes
    concurrent = lay.rows
    if r.engine == "vllm" and not device.is_cpu:
        kv_per_seq = lay.seq_tokens * shape.num_hidden_layers * 2 * shape.kv_size * 2
        space = r.vllm_gpu_memory_utilization * device.memory_bytes - weight_bytes
        concurrent = max(1, min(lay.rows, int(space // kv_per_seq))) if space > 0 else 1
    waves = math.ceil(lay.rows / concurrent)
    return prefill + waves * gen * decode_step_seconds(shape, device, rates, concurrent)


def decode_step_seconds(shape: ModelShape, device: Device, rates: Rates, concurrent: int) -> float:
    """One decode step of ``concurrent`` sequences: the fixed latency, each decoder layer's, and the slower of reading
    the weights once and 2·N FLOPs per sequence (on this machine's transformers engine, one thread, this fits
    tiny-qwen2 at 1-8 layers and 1-32 rows and SmolLM2-135M at 1-4 rows within -9%..+9%, SmolLM2's one-row step
    -26%; see devices.yaml)."""
    weights = shape.params * device.compute_bytes / rates.decode_bandwidth
    compute = 2 * shape.matmul_params * concurrent / rates.decode_compute_flops
    fixed = rates.decode_step_latency + shape.num_hidden_layers * rates.decode_layer_latency
    return fixed + max(weights, compute)


def sync_seconds(cfg: TrainConfig, shape: ModelShape, device: Device) -> float:
    lora = cfg.model.lora
    if lora.enabled and lora.engine_weights == "adapters":
        size = shape.lora_params(lora.rank, lora.target_modules) * FP32
    else:
        size = shape.params * device.compute_bytes
    bandwidth = device.internode_bandwidth if cfg.rollout.engine == "remote" else device.sync_bandwidth
    return size / bandwidth
