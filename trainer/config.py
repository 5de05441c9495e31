"""``TrainConfig``: the schema of ``emapg train`` configs (``configs/*.yaml``).

Every field has a help text (``emapg config reference``). Numbers in the paper
presets are traced to ``docs/ALGORITHM.md`` in comments next to them. Cross-field
checks live in ``validate`` methods so that a bad config fails with a one-line
:class:`~emapg.config.ConfigError` before any model is loaded.

Coefficient convention: ``ema.decay`` is η, the weight on the *old* anchor
(θ_ema ← η·θ_ema + (1−η)·θ), as in the paper's ``ref_policy_ema_tau``. TRL's
``ref_model_mixup_alpha`` is the weight on the *policy*, i.e. α = 1 − η.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agent.engines import EngineKind, check_engine_urls
from agent.rollout import RolloutConfig as AgentRolloutConfig
from emapg.config import ConfigError, option
from tasks.task import get_task
from trainer.guard import GuardConfig
from trainer.algo import DEFAULT_CHUNK_SIZE


@dataclass
class RunConfig:
    name: str = option("run", help="run name; the default output folder is runs/<name>")
    output_dir: str | None = option(None, help="folder for checkpoints, metrics.jsonl and TensorBoard logs (default runs/<name>)")
    seed: int = option(0, help="seed for data order, sampling and initialisation")
    total_steps: int = option(10, help="number of training steps (one rollout batch each)")
    save_every: int = option(50, help="write a checkpoint every N steps (0: only at the end and on SIGINT/SIGTERM)")
    keep_last: int = option(3, help="keep the last N checkpoints (0: keep all)")
    time_budget_s: float = option(
        0.0, ge=0, help="stop at a step boundary when one more step would end past this many seconds after the training loop "
        "started (judged by the mean step time so far; the first step always runs), with a checkpoint as on SIGINT; "
        "0: no budget, run.total_steps only")
    device: Literal["auto", "cpu", "cuda"] = option("auto", help="training device; auto picks cuda when available")
    precision: Literal["auto", "bf16", "fp32"] = option(
        "auto", help="compute precision: bf16 autocast over fp32 master weights (bf16), or fp32; auto: bf16 on GPU, fp32 on CPU. "
        "On a CPU, bf16 runs only where the CPU multiplies bf16 natively (avx512_bf16/amx_bf16; 1.5-2.6x faster passes on "
        "the CI machines), else fp32 with a warning; provenance and metrics record which ran (train/bf16)"
    )
    max_consecutive_nonfinite: int = option(
        3, help="stop with an error after this many consecutive steps whose loss or gradient is NaN/inf (each is skipped)"
    )
    rollout_retries: int = option(2, help="retry a rollout batch that raised this many times before giving up")
    deterministic: bool = option(
        True, help="use deterministic torch algorithms where available (needed for bit-for-bit resume on GPU)"
    )
    flush_denormal: bool = option(
        True, help="flush subnormal floats (below 1.2e-38 in fp32) to zero in CPU arithmetic: x86 computes with them about "
        "100x slower, and a model with near-zero weights (a fresh zero-initialised layer after one AdamW step) can fill its "
        "backward with them; false keeps IEEE gradual underflow"
    )

    def validate(self) -> None:
        if self.total_steps < 1:
            raise ConfigError(f"run.total_steps must be >= 1, got {self.total_steps}")
        if self.save_every < 0 or self.keep_last < 0:
            raise ConfigError("run.save_every and run.keep_last must be >= 0")
        if self.max_consecutive_nonfinite < 1:
            raise ConfigError("run.max_consecutive_nonfinite must be >= 1")
        if self.rollout_retries < 0:
            raise ConfigError("run.rollout_retries must be >= 0")


#: What ``model.lora.target_modules`` adapts by default: every linear layer of a Qwen2/Llama decoder block.
LORA_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    """LoRA adapters on the policy (``peft``): W + (alpha/rank)·B·A on each targeted linear layer.

    Only the adapters train (the optimizer holds only them); the EMA anchor is an fp32 EMA of
    the adapters over the shared frozen base (see :mod:`trainer.lora`)."""

    enabled: bool = option(False, help="train LoRA adapters instead of every weight (the base stays frozen)")
    rank: int = option(16, help="LoRA rank r (the inner dimension of B·A)")
    alpha: float = option(32.0, gt=0, help="LoRA alpha: the update is scaled by alpha / rank")
    dropout: float = option(0.0, ge=0, lt=1, help="dropout on the adapters' input during training (0 keeps training passes deterministic)")
    target_modules: list[str] = option(
        list(LORA_DEFAULT_TARGETS), help="module names (suffixes, e.g. q_proj) to adapt, or ['all-linear']"
    )
    init: Literal["default", "gaussian"] = option(
        "default", help="adapter initialisation: B = 0 (the first step is the base model) with A Kaiming-uniform (default) or Gaussian"
    )
    engine_weights: Literal["adapters", "merged"] = option(
        "adapters",
        help="what the generation engine gets: adapters (base + LoRA, each sync sends adapter tensors only) or "
        "merged (base + adapters merged into full weights, for an engine that cannot serve LoRA)",
    )

    def validate(self) -> None:
        if self.rank <= 0:
            raise ConfigError(f"model.lora.rank must be >= 1, got {self.rank}")
        if not self.target_modules or any(not t for t in self.target_modules):
            raise ConfigError("model.lora.target_modules must name at least one module (e.g. q_proj)")

    @property
    def scaling(self) -> float:
        """alpha / rank, the factor on B·A."""
        return self.alpha / self.rank


@dataclass
class ModelConfig:
    policy: str = option(
        "tiny-qwen2", help="policy to train: a hub name, a local HF folder, or an alias (tiny-qwen2, smollm2-135m-instruct)"
    )
    gradient_checkpointing: bool = option(False, help="recompute activations in the backward pass (less memory, ~30% slower)")
    attn_implementation: str | None = option(None, help="transformers attention implementation (e.g. sdpa, flash_attention_2)")
    chunk_size: int = option(DEFAULT_CHUNK_SIZE, help="tokens per chunk when computing log-probs/top-k/entropy from the LM head")
    share_prompt: bool = option(
        True,
        help="no-grad passes (EMA anchor / reference, recomputed old log-probs) run each distinct prompt of a "
        "micro-batch once and continue every group member from its KV cache; same values up to float rounding, "
        "fewer FLOPs; token-budget micro-batches keep a group together where that costs no extra forward",
    )
    share_prompt_training: bool = option(
        True,
        help="with model.share_prompt, the differentiable training pass shares each distinct prompt too (gradients "
        "flow back through the shared prompt activations; equal to one pass per row up to float rounding); it "
        "runs one pass per row under model.gradient_checkpointing",
    )
    lora: LoraConfig = option(default_factory=LoraConfig, help="LoRA adapters (off by default: full fine-tuning)")

    def validate(self) -> None:
        if not self.policy:
            raise ConfigError("model.policy must name a model")
        if self.chunk_size < 1:
            raise ConfigError("model.chunk_size must be >= 1")


@dataclass
class DataConfig:
    train: str = option(
        "nq", help="training prompts: a dataset name of tasks.datasets (nq, hotpotqa, aime2024, math500, ...) or a .jsonl/.json/.parquet file"
    )
    split: str = option("train", help="dataset split to train on")
    limit: int | None = option(None, help="use only the first N examples (after loading, before shuffling)")
    shuffle: bool = option(True, help="reshuffle the prompts every epoch (seeded by run.seed and the epoch)")
    prompts_per_step: int = option(
        8, help="prompts per training step over all processes (each expanded to rollout.n_samples trajectories)"
    )

    def validate(self) -> None:
        if self.prompts_per_step < 1:
            raise ConfigError("data.prompts_per_step must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ConfigError("data.limit must be >= 1 when set")


@dataclass
class SamplingConfig(AgentRolloutConfig):
    """How the trainer samples its batch (the ``rollout:`` section): the agent loop's settings
    (:class:`agent.rollout.RolloutConfig`; ``n_samples`` is the GRPO group size, ``task`` picks search or math),
    the generation engine the trainer runs, and the generation schedule (dynamic sampling, staleness)."""

    engine: EngineKind = option(
        "hf", help="generation engine: vllm (colocated with the trainer), hf (transformers), or remote (`emapg engine serve` servers at engine_urls)"
    )
    vllm_gpu_memory_utilization: float = option(0.4, gt=0, le=1, help="fraction of GPU memory vLLM may take when colocated")
    vllm_sleep: bool = option(True, help="put the colocated vLLM engine to sleep during training (frees weights and KV cache)")
    vllm_tensor_parallel_size: int = option(1, help="vLLM tensor parallel size")
    engine_urls: list[str] = option([], help="remote: base URLs of running generation servers (several = data-parallel replicas of the same model)")
    engine_api_key_env: str | None = option(None, help="remote: name of an environment variable holding the generation servers' API key")
    engine_timeout: float = option(600.0, gt=0, help="remote: seconds per HTTP request to a generation server (a whole generation included)")
    engine_wait: float = option(600.0, ge=0, help="remote: seconds to wait at start-up for the servers' /health (they may still be loading)")
    weight_sync: Literal["http", "collective"] = option(
        "http", help="remote: how new weights reach the servers: http (safetensors buckets, works everywhere) or collective (a gloo/NCCL broadcast group)"
    )
    weight_sync_bucket_mb: int = option(256, help="remote: MiB of weights per bucket (one HTTP request, or one broadcast)")
    collective_host: str = option("127.0.0.1", help="collective: this trainer's address as the servers reach it (rank 0 hosts the group's TCPStore)")
    collective_port: int = option(0, help="collective: TCPStore port on the trainer (0: a free port)")
    collective_backend: Literal["auto", "gloo", "nccl"] = option("auto", help="collective: nccl (GPUs on both sides), gloo (CPU tensors, any network); auto: nccl when training on CUDA")
    filter_groups: bool = option(
        False, help="dynamic sampling (DAPO): train only on groups whose rewards differ, generating up to "
        "rollout.filter_max_rounds more batches of data.prompts_per_step prompts per step to fill the batch with them "
        "(trainer.group_filter; synchronous training only)")
    filter_max_rounds: int = option(
        3, help="rollout.filter_groups: extra prompt batches generated per step at most; a batch still short of informative "
        "groups is topped up with uninformative ones (same size every step)")
    uniform_groups: Literal["topup", "drop"] = option(
        "topup", help="what a step does with groups whose rewards are all equal (GRPO advantage 0): topup trains on them "
        "(their KL term only; with rollout.filter_groups they top up a batch short of informative groups, so every step "
        "has the same size); drop leaves them out, KL term included, so the update's cost goes only to groups with a "
        "policy gradient -- with rollout.filter_groups extra rounds run until data.prompts_per_step informative groups "
        "are kept, without it an extra round (at most rollout.filter_max_rounds) runs only while no group of the step is "
        "informative (a step with none after them trains on one uniform group). Synchronous, one process")
    max_staleness: int = option(
        0, help="0: synchronous (generate, then train). s >= 1: a producer thread generates the next batches on the remote "
        "servers while the trainer updates; batch k is generated with the weights after step max(k0, k-1-s), k0 the step the run started at (trainer.pipeline)",
    )
    stage_weights: bool = option(
        True, help="asynchronous runs (max_staleness >= 1) over the http weight transport: the trainer uploads each new "
        "weights version to the servers as soon as it has it, while the current batch generates, and the producer only "
        "loads it between batches; false: the producer uploads and loads between batches (the batches are the same)",
    )

    def validate(self) -> None:
        super().validate()
        if self.temperature <= 0:
            raise ConfigError("rollout.temperature must be > 0 for training (sampling); greedy decoding is for eval")
        if self.vllm_tensor_parallel_size < 1:
            raise ConfigError("rollout.vllm_tensor_parallel_size must be >= 1")
        check_engine_urls(self.engine, self.engine_urls, engine_key="rollout.engine", urls_key="rollout.engine_urls")
        if self.weight_sync_bucket_mb < 1:
            raise ConfigError("rollout.weight_sync_bucket_mb must be >= 1")
        if self.max_staleness < 0:
            raise ConfigError(f"rollout.max_staleness must be >= 0, got {self.max_staleness}")
        if self.filter_max_rounds < 0:
            raise ConfigError(f"rollout.filter_max_rounds must be >= 0, got {self.filter_max_rounds}")
        if self.filter_groups and self.max_staleness:
            raise ConfigError("rollout.filter_groups works with synchronous training only (rollout.max_staleness=0)")
        if self.filter_groups and self.n_samples < 2:
            raise ConfigError("rollout.filter_groups needs rollout.n_samples >= 2 (a group of one never has differing rewards)")
        if self.uniform_groups == "drop" and self.max_staleness:
            raise ConfigError("rollout.uniform_groups=drop works with synchronous training only (rollout.max_staleness=0)")
        if self.uniform_groups == "drop" and self.n_samples < 2:
            raise ConfigError("rollout.uniform_groups=drop needs rollout.n_samples >= 2 (a group of one is always uniform)")
        if self.max_staleness and self.engine != "remote":
            raise ConfigError("rollout.max_staleness >= 1 needs rollout.engine=remote (generation servers the producer "
                              "keeps busy while the trainer updates)")
        if not 0 <= self.collective_port < 65536:
            raise ConfigError(f"rollout.collective_port {self.collective_port} is not a TCP port (0: pick a free one)")


@dataclass
class RetrieverConfig:
    urls: list[str] = option([], help="base URLs of running retriever servers (several = replicas, load-balanced)")
    index_dir: str | None = option(None, help="launch a retriever server on this index for the run (when urls is empty)")
    timeout: float = option(30.0, gt=0, help="seconds per retrieval request")
    retries: int = option(3, help="retries per retrieval request before the search counts as failed")
    api_key_env: str | None = option(None, help="name of an environment variable holding the retriever API key")
    wait: float = option(
        60.0, ge=0, help="seconds to wait at start-up for every server of retriever.urls to answer /health and accept the API key "
        "(a one-query search); also how long training pauses for retrievers that went away mid-run"
    )
    max_failure_rate: float = option(
        0.5, ge=0, le=1, help="a rollout batch whose fraction of failed searches exceeds this is not trained on: it is rolled out again"
    )
    batch_invariant: bool = option(
        False, help="a query's passages never depend on the queries served beside it (repeatable runs from a seed): the "
        "server launched on retriever.index_dir runs `emapg serve --batch-invariant` (about a quarter of the throughput on "
        "CPU); servers at retriever.urls must say so in /health"
    )
    failure_patience: int = option(
        2, help="after this many consecutive rejected rollout batches training pauses, waiting up to retriever.wait for the "
        "retrievers' /health; it stops with an error if they do not come back or searches still fail afterwards"
    )

    def validate(self) -> None:
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"retriever.urls: {url!r} is not an http(s) URL")
        if self.index_dir and not Path(self.index_dir).expanduser().exists():
            raise ConfigError(f"retriever.index_dir: {self.index_dir} does not exist")
        if self.failure_patience < 1:
            raise ConfigError(f"retriever.failure_patience must be >= 1, got {self.failure_patience}")


@dataclass
class KLConfig:
    enabled: bool = option(True, help="add beta * KL(policy, anchor) to the loss (never to the reward)")
    type: str = option(
        "topk_reverse",
        help="estimator: topk_reverse/topk_forward (Top-k KL), exact_reverse/exact_forward (full vocabulary), "
        "or a sampled estimator of trainer.algo.kl (k1, k2, k3 = low_var_kl, k3_ratio, k4 = reverse_reinforce, k5, '+' variants)",
    )
    coef: float = option(0.001, ge=0, help="beta, the KL loss coefficient")
    topk: int = option(32, help="k for Top-k KL (topk_reverse/topk_forward); 0 is the sampled K4 (reverse) / K5 (forward) estimator")
    tail_sampling: bool = option(True, help="add the sampled tail term to Top-k KL (false: truncated KL)")
    importance_weight: bool = option(True, help="multiply the sampled (tail) part by s = pi_theta/pi_old")
    iw_clip: list[float] | None = option(None, ge=0, help="optional [low, high] clip of the importance weight")
    tail_grad: Literal["paper", "exact"] = option(
        "paper", help="Top-k gradient: 'paper' reproduces the release (bias +-grad pi(q)); 'exact' is unbiased. At a large "
        "coef the bias matters: at beta 1 the paper gradient sent token entropy to 1-4.5 nats after one update and 3 of 5 "
        "toy runs collapsed, exact 1 of 5 (studies/stability.py, amendment 3): use exact there"
    )

    def validate(self) -> None:
        from trainer.algo.kl_kinds import get_kl_kind, kl_kind_names

        try:
            kind = get_kl_kind(self.type)
        except KeyError:
            import difflib

            types = kl_kind_names()
            hint = difflib.get_close_matches(self.type, types, n=1)
            raise ConfigError(
                f"kl.type: {self.type!r} is not one of {', '.join(types)}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
            ) from None
        kind.validate(self)
        if self.iw_clip is not None and (len(self.iw_clip) != 2 or not 0 <= self.iw_clip[0] <= self.iw_clip[1]):
            raise ConfigError(f"kl.iw_clip must be [low, high] with 0 <= low <= high, got {self.iw_clip}")


@dataclass
class EMAConfig:
    decay: float = option(
        1.0, ge=0, le=1, help="eta: anchor <- eta*anchor + (1-eta)*policy every `period` steps; 1.0 keeps a frozen reference (GRPO)"
    )
    period: int = option(10, help="P: update the anchor after steps P, 2P, 3P, ...")
    dtype: Literal["fp32", "bf16"] = option("fp32", help="anchor dtype: fp32 (exact blend) or bf16 (as the paper's release)")
    offload: bool = option(False, help="keep the anchor on CPU between uses (GPU runs)")

    def validate(self) -> None:
        if self.period < 1:
            raise ConfigError("ema.period must be >= 1")


@dataclass
class DistillConfig:
    enabled: bool = option(False, help="on-policy distillation (trainer.algo.distill): a teacher scores every sampled "
                           "response token and the policy minimises the per-token reverse KL(policy || teacher)")
    coef: float = option(1.0, ge=0, help="coefficient of the distillation loss")
    teacher: str = option("", help="the teacher in process: a model path or alias, loaded on the trainer's device "
                          "(it must share the policy's tokenizer)")
    teacher_urls: list[str] = option([], help="or remote teachers: URLs of `emapg engine serve --model TEACHER` servers, "
                                     "scored through their POST /score route (rows spread over them)")
    estimator: Literal["sampled_reverse_kl", "topk_reverse_kl", "topk_forward_kl"] = option(
        "sampled_reverse_kl", help="sampled_reverse_kl: per-token advantage -(log pi - log pi_teacher) on the sampled "
        "token; topk_reverse_kl: the Top-k reverse KL over the teacher's top-k (exact head, sampled tail, unbiased gradient); "
        "topk_forward_kl: the forward KL(teacher || policy) over the teacher's top-k plus one bucket for the rest, exact "
        "at each sampled prefix (its gradient does not vanish where the policy is sure of a token the teacher rules out; "
        "on the SmolLM2 search benchmark, 2 seeds, 82% of the teacher's sampled EM against 44% with topk_reverse_kl)")
    topk: int = option(16, ge=1, help="topk_reverse_kl / topk_forward_kl: k, the teacher's top-k tokens per position")
    mode: Literal["alone", "added", "below_best"] = option(
        "added", help="alone: distillation only (the task reward's policy loss is dropped); added: the task's policy "
        "loss + coef * distillation; below_best: added, only on trajectories whose reward is below their group's best (DGPO)")
    teacher_api_key_env: str = option("EMAPG_ENGINE_API_KEY", help="environment variable holding the teacher servers' API key "
                                      "(empty: none)")
    timeout: float = option(120.0, gt=0, help="seconds allowed for one remote scoring request")

    def validate(self) -> None:
        if not self.enabled:
            return
        if bool(self.teacher) == bool(self.teacher_urls):
            raise ConfigError("algorithm.distill needs exactly one of distill.teacher (in process) and distill.teacher_urls (remote)")


@dataclass
class AlgorithmConfig:
    name: Literal["emapg", "grpo"] = option("emapg", help="label for logs and plots (the behaviour is set by kl/ema fields)")
    clip_low: float = option(0.2, ge=0, help="PPO clip epsilon below 1")
    clip_high: float = option(0.28, ge=0, help="PPO clip epsilon above 1 (clip-higher)")
    dual_clip: float | None = option(None, gt=1, help="dual-clip constant c for negative advantages (math: 3.0); null disables")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "microbatch-token-mean"] = option(
        "token-mean", help="loss aggregation, normalised over the whole rollout mini-batch (microbatch-token-mean: Search-R1 legacy)"
    )
    adv_std: Literal["unbiased", "biased", "none"] = option(
        "unbiased", help="group std used to normalise advantages (none = Dr.GRPO, mean-centred only)"
    )
    adv_eps: float = option(1e-6, gt=0, help="epsilon added to the group std (> 0: a group of equal rewards has std 0)")
    entropy_coef: float = option(0.0, help="entropy bonus coefficient (with entropy_target: the controller's first value, "
                                 "clamped into entropy_coef_range)")
    entropy_target: float | None = option(
        None, gt=0, help="target-entropy control (trainer.entropy_control): after each step the entropy coefficient moves "
        "in log space by rate * clip((target - H)/target, -1, 1), H the step's mean token entropy (actor/entropy), to "
        "hold H near this target (nats per token); logged as actor/entropy_coef; null: the fixed entropy_coef")
    entropy_rate: float = option(0.2, gt=0, help="entropy_target: the controller's log-space step (the coefficient changes "
                                 "by at most a factor exp(rate) per step)")
    entropy_coef_range: list[float] = option([1e-4, 0.1], gt=0, help="entropy_target: [min, max] of the adapted coefficient")
    mini_batch_size: int = option(
        256, help="trajectories per optimizer step over all processes; the rollout batch gives batch/mini_batch_size PPO updates"
    )
    micro_batch_size: int = option(
        8, help="trajectories per forward/backward on each process (gradient accumulation inside a mini-batch)"
    )
    micro_batch_tokens: int = option(
        0, help="token budget per forward/backward on each process: rows sorted by length are packed into micro-batches "
        "of at most this many padded (prompt + response) tokens, less padding, same loss (0: micro_batch_size rows each)"
    )
    ppo_epochs: int = option(1, help="passes over the rollout batch")
    guidance: Literal["none", "gold_answer"] = option(
        "none", help="search task, tags format: a group whose every trajectory scored 0 gets one correct trajectory, the "
        "model's own searches with the gold answer written in as its last turn (replayed through the rollout loop, "
        "token-exact); on-policy its ratio is 1, so it adds the advantage-weighted log-likelihood of that trajectory "
        "(LUFFY's off-policy guidance without policy shaping; trainer.guidance). Needs behavior_correction=none")
    behavior_correction: Literal["none", "tis", "mis"] = option(
        "none", help="correct for the engine (behaviour policy) sampling with other probabilities than the trainer's pi_old "
        "(decoupled PPO, trainer.algo.behavior): none, tis (truncated importance weight min(rho, behavior_cap)) or "
        "mis (tokens/sequences with rho outside behavior_band dropped); rho = pi_old / engine sampling prob",
    )
    behavior_level: Literal["token", "sequence", "geometric"] = option(
        "token", help="behaviour ratio rho per token, per sequence (product over its tokens) or geometric (exp of the mean log ratio)"
    )
    behavior_cap: float = option(2.0, ge=1, help="tis: cap C of the truncated importance weight min(rho, C) (a cap below 1 down-weights every token)")
    behavior_band: list[float] = option([0.5, 2.0], ge=0, help="mis: [low, high]; tokens (or sequences) with rho outside are dropped")
    kl: KLConfig = option(default_factory=KLConfig, help="KL loss term")
    ema: EMAConfig = option(default_factory=EMAConfig, help="EMA anchor")
    distill: DistillConfig = option(default_factory=DistillConfig, help="on-policy distillation from a teacher (off by default)")

    def validate(self) -> None:
        if self.mini_batch_size < 1 or self.micro_batch_size < 1 or self.ppo_epochs < 1:
            raise ConfigError("algorithm.mini_batch_size, micro_batch_size and ppo_epochs must be >= 1")
        if self.micro_batch_size > self.mini_batch_size:
            raise ConfigError("algorithm.micro_batch_size must be <= algorithm.mini_batch_size")
        if self.mini_batch_size % self.micro_batch_size:
            raise ConfigError("algorithm.mini_batch_size must be a multiple of algorithm.micro_batch_size")
        if len(self.entropy_coef_range) != 2 or self.entropy_coef_range[0] > self.entropy_coef_range[1]:
            raise ConfigError(f"algorithm.entropy_coef_range must be [min, max] with 0 < min <= max, got {self.entropy_coef_range}")
        band = self.behavior_band
        if len(band) != 2 or not 0 <= band[0] <= 1 <= band[1]:
            raise ConfigError(f"algorithm.behavior_band must be [low, high] with 0 <= low <= 1 <= high, got {band}")
        if self.micro_batch_tokens < 0:
            raise ConfigError(f"algorithm.micro_batch_tokens must be >= 0 (0: fixed micro_batch_size rows), got {self.micro_batch_tokens}")
        if self.micro_batch_tokens and self.loss_agg == "microbatch-token-mean":
            raise ConfigError("algorithm.micro_batch_tokens needs a loss normalised over the mini-batch: "
                              "loss_agg=microbatch-token-mean depends on which rows share a micro-batch")


@dataclass
class OptimConfig:
    lr: float = option(1e-6, gt=0, help="AdamW learning rate")
    betas: list[float] = option([0.9, 0.999], ge=0, lt=1, help="AdamW betas")
    eps: float = option(1e-8, gt=0, help="AdamW epsilon")
    weight_decay: float = option(0.01, ge=0, help="AdamW weight decay")
    grad_clip: float = option(1.0, ge=0, help="clip the global gradient norm to this value (0: off)")
    warmup_ratio: float = option(0.0, ge=0, lt=1, help="linear warm-up over int(warmup_ratio * run.total_steps) steps, then constant")

    def validate(self) -> None:
        if len(self.betas) != 2:
            raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {self.betas}")


@dataclass
class RewardConfig:
    shuffle_control: bool = option(
        False, help="a random-reward control for learning claims: each batch's rewards are permuted across its "
        "trajectories (seeded by the step) before advantages and group filtering, so the run trains on rewards "
        "unrelated to its answers at the same reward rate; a learning gain must beat this run's")
    qa_reward: Literal["em", "f1", "em_f1"] = option(
        "em", help="search task: the training reward of an answer -- em (exact match, the paper's), f1 (token F1: partial "
        "credit, a denser signal), or em_f1 (their mean); evaluation always reports EM and F1")
    qa_answer: Literal["search_r1", "last_complete"] = option(
        "search_r1", help="search task: which answer the training reward reads -- search_r1 (the paper's pattern, "
        "also what evaluation always uses: the model's turns joined, the first <answer> to the next </answer>, so "
        "an answer cut off inside <answer> by the turn's token cap swallows the next, complete one and scores 0) or "
        "last_complete (the text after the last <answer> that a </answer> closes: a cut-off answer no longer hides a "
        "right one; tasks.qa.extract_answer)")
    no_answer_penalty: float = option(
        0.0, ge=0, le=1, help="search task: subtracted from the reward of a trajectory that gives no answer (no <answer> "
        "tag), so answering wrongly is never worse than not answering; 0: off")
    math_timeout: float = option(10.0, gt=0, help="seconds allowed to grade one math answer (in a worker process)")
    math_workers: int = option(2, help="worker processes for math grading")
    math_grader: Literal["math_verify", "mathd_or_math_verify"] = option(
        "mathd_or_math_verify", help="math equivalence check (the paper: MATH-style string normalisation OR a symbolic check)"
    )

    def validate(self) -> None:
        if self.math_workers < 1:
            raise ConfigError("reward.math_workers must be >= 1")


@dataclass
class LoggingConfig:
    tensorboard: bool = option(True, help="write TensorBoard event files to <output_dir>/tensorboard")
    wandb: bool = option(False, help="also log to Weights & Biases (when the wandb package is installed)")
    wandb_project: str = option("ema-pg", help="wandb project name")
    progress: bool = option(True, help="show a rich progress bar with the step's metrics")
    log_samples: int = option(2, help="decoded trajectories appended to samples.jsonl per step (0: none)")
    length_drift_steps: int = option(3, ge=1, help="response/length_drift = the step's mean response length / the mean "
                                     "over the run's first N steps - 1")
    kl_to_start: bool = option(False, help="log kl/to_start, the exact KL(policy || the run's starting policy) per response "
                               "token (trainer.start_kl): free of memory with a frozen reference (ema.decay=1) or LoRA, else "
                               "a frozen copy of the initial weights; two no-grad passes per step")
    probe_size: int = option(0, ge=0, help="answer flips: every logging.probe_every steps, answer this many fixed training "
                             "questions greedily with the run's engine and log probe/accuracy, probe/flip_rate (answers changed "
                             "since the last probe), probe/lost_rate, probe/gained_rate (0: off; synchronous runs only)")
    probe_every: int = option(5, ge=1, help="steps between two probes (logging.probe_size)")


@dataclass
class DistributedConfig:
    fsdp: Literal["auto", "on", "off"] = option("auto", help="FSDP2 sharding under torchrun: auto = on when world size > 1")
    cpu_offload: bool = option(False, help="FSDP2 CPU offload of parameters, gradients and optimizer state")
    backend: Literal["auto", "nccl", "gloo"] = option("auto", help="process group backend (auto: nccl on GPU, gloo on CPU)")


@dataclass
class TrainConfig:
    """Everything ``emapg train`` needs; see ``configs/`` for presets."""

    run: RunConfig = option(default_factory=RunConfig, help="run bookkeeping")
    model: ModelConfig = option(default_factory=ModelConfig, help="the policy")
    data: DataConfig = option(default_factory=DataConfig, help="training prompts")
    rollout: SamplingConfig = option(default_factory=SamplingConfig, help="generation and the agent loop")
    retriever: RetrieverConfig = option(default_factory=RetrieverConfig, help="search backend (search task)")
    algorithm: AlgorithmConfig = option(default_factory=AlgorithmConfig, help="loss, advantages, KL and EMA anchor")
    optim: OptimConfig = option(default_factory=OptimConfig, help="optimizer and schedule")
    reward: RewardConfig = option(default_factory=RewardConfig, help="reward computation")
    logging: LoggingConfig = option(default_factory=LoggingConfig, help="metrics and progress")
    distributed: DistributedConfig = option(default_factory=DistributedConfig, help="torchrun / FSDP2")
    guard: GuardConfig = option(default_factory=GuardConfig, help="stability guard: collapse detectors and automatic recovery")

    def validate(self) -> None:
        batch = self.data.prompts_per_step * self.rollout.n_samples
        mini = self.algorithm.mini_batch_size
        if batch % mini:
            raise ConfigError(
                f"algorithm.mini_batch_size ({mini}) must divide the rollout batch "
                f"data.prompts_per_step * rollout.n_samples = {batch}"
            )
        if get_task(self.rollout.task).searches and not self.retriever.urls and not self.retriever.index_dir:
            raise ConfigError("the search task needs retriever.urls or retriever.index_dir")
        if self.algorithm.guidance != "none":
            if self.rollout.task != "search" or self.rollout.format != "tags" or self.rollout.agent:
                raise ConfigError("algorithm.guidance works with the built-in search task in the tags format "
                                  "(rollout.task=search, rollout.format=tags, no rollout.agent)")
            if self.algorithm.behavior_correction != "none":
                raise ConfigError("algorithm.guidance needs algorithm.behavior_correction=none: a guided trajectory was "
                                  "not sampled by the engine, so it has no sampling log-probabilities")
            if self.rollout.max_staleness:
                raise ConfigError("algorithm.guidance works with synchronous training only (rollout.max_staleness=0)")

    @property
    def output_path(self) -> Path:
        return Path(self.run.output_dir or Path("runs") / self.run.name)

    @property
    def warmup_steps(self) -> int:
        return int(self.optim.warmup_ratio * self.run.total_steps)
