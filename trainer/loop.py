"""The EMA-PG / GRPO training step and loop.

One step, top to bottom (every rank does the same on its share of the prompts):

1. sample ``data.prompts_per_step`` prompts, each with a run-unique group id;
2. roll out ``rollout.n_samples`` trajectories per prompt (the GRPO group) through
   :func:`agent.rollout.run_rollouts` (search: the real retriever over HTTP);
3. score them (:mod:`trainer.rewards`: QA exact match or the math grader);
4. recompute π_old's log-probs with the trainer model (plus its top-k indices for
   Top-k reverse KL), then the anchor's statistics by swapping the EMA anchor into the
   same model (log-prob of the sampled token, logits at the top-k indices, logsumexp);
5. GRPO advantages per group;
6. PPO: the batch is split into ``batch / algorithm.mini_batch_size`` optimizer steps,
   each accumulating gradients over micro-batches, loss normalised over the whole
   mini-batch (all ranks), gradient clipping, AdamW; a NaN/inf loss or gradient skips
   that update;
7. the LR scheduler steps once per training step; the EMA anchor blends after steps
   P, 2P, ...;
8. the engine gets the new weights before the next rollout (``engine.load_weights``).

Departures from the paper's code, each deliberate: the group id is unique per prompt
(the paper merged NQ and HotpotQA groups with equal row index); the loss is normalised
over the optimizer step's whole mini-batch rather than per micro-batch (set
``algorithm.loss_agg=microbatch-token-mean`` to reproduce the paper); the EMA anchor is
fp32 by default (``algorithm.ema.dtype=bf16`` is the paper's).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from emapg.config import ConfigError, to_dict
from trainer import distributed as D
from trainer.batch import MicroBatch, TokenBatch, build_token_batch
from trainer.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_optimizer_state,
    load_scheduler_state,
    save_checkpoint,
)
from trainer.config import EXACT_KL_TYPES, TOPK_KL_TYPES, TrainConfig
from trainer.data import PromptSampler, SampledPrompt, load_prompts
from trainer.tracking import Tracker

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot continue (repeated NaN/inf, a rollout that keeps failing)."""


# --------------------------------------------------------------------------------------------- pieces


def linear_warmup_constant(warmup_steps: int):
    """LR multiplier: linear from 1/(w+1) up to 1 over ``warmup_steps`` steps, then 1 (paper search §3.1)."""

    def factor(step: int) -> float:
        if warmup_steps <= 0:
            return 1.0
        return min(1.0, (step + 1) / (warmup_steps + 1))

    return factor


def step_seed(seed: int, step: int, rank: int) -> int:
    """Sampling seed of a step: fixed by (run seed, step, rank), so a resumed run samples the same."""
    return (seed * 1_000_003 + step * 10_007 + rank * 101) % (2**31 - 1)


@dataclass
class Rollouts:
    """One rank's rollout batch after scoring."""

    prompts: list[SampledPrompt]  # one per group
    trajectories: list[Any]  # agent.rollout.Trajectory, group-major
    group_ids: list[str]
    rewards: torch.Tensor  # (N,)
    reward_counts: dict[str, float]
    stats: Any  # agent.rollout.RolloutStats


# --------------------------------------------------------------------------------------------- trainer


class Trainer:
    """Owns the model, optimizer, anchor, engine, retriever and data for one run."""

    def __init__(self, cfg: TrainConfig, *, resume: str | Path | None = None) -> None:
        self.cfg = cfg
        self.run_dir = cfg.output_path
        self.resume_from = resume
        self.step = 0
        self.nonfinite_streak = 0
        self._stop_signal: int | None = None
        self._weights_dirty = False
        self._closers: list[Any] = []
        self._last_samples: list[dict[str, Any]] = []
        self._anchor_params: dict[str, tuple[torch.Tensor, torch.dtype, torch.device]] | None = None

    # ------------------------------------------------------------------ setup
    def setup(self) -> "Trainer":
        cfg = self.cfg
        self.dist = D.init_distributed(cfg.run.device, cfg.distributed.backend)
        dev = self.dist.device
        if cfg.run.device == "cuda" and dev.type != "cuda":
            raise ConfigError("run.device=cuda but no CUDA device is available")
        self.bf16 = cfg.run.precision == "bf16" or (cfg.run.precision == "auto" and dev.type == "cuda")
        if self.bf16 and dev.type != "cuda":
            raise ConfigError("run.precision=bf16 needs a CUDA device (CPU training runs in fp32)")
        if cfg.run.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
            if dev.type == "cuda":
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        ckpt_path = self._find_resume()
        random.seed(cfg.run.seed + self.dist.rank)
        np.random.seed(cfg.run.seed + self.dist.rank)
        torch.manual_seed(cfg.run.seed + self.dist.rank)

        # Data first: a bad dataset name fails before any model loads.
        examples = load_prompts(cfg.data.train, split=cfg.data.split, limit=cfg.data.limit, seed=cfg.run.seed)
        self.sampler = PromptSampler(examples, seed=cfg.run.seed, shuffle=cfg.data.shuffle)

        from transformers import AutoModelForCausalLM, AutoTokenizer

        from emapg.models import resolve_model

        self.model_path = str(ckpt_path / "policy") if ckpt_path else resolve_model(cfg.model.policy)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        kwargs: dict[str, Any] = {"dtype": torch.float32}
        if cfg.model.attn_implementation:
            kwargs["attn_implementation"] = cfg.model.attn_implementation
        model = AutoModelForCausalLM.from_pretrained(self.model_path, **kwargs)
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        self.fsdp = cfg.distributed.fsdp == "on" or (cfg.distributed.fsdp == "auto" and self.dist.distributed)
        if self.dist.distributed and not self.fsdp:
            raise ConfigError("multi-process training needs distributed.fsdp=on or auto")
        world = self.dist.world_size
        if cfg.data.prompts_per_step % world or cfg.algorithm.mini_batch_size % world:
            raise ConfigError(
                f"data.prompts_per_step ({cfg.data.prompts_per_step}) and algorithm.mini_batch_size "
                f"({cfg.algorithm.mini_batch_size}) are global and must be multiples of the {world} processes"
            )
        model.to(dev)
        self.forward = D.PolicyForward(model)
        if self.fsdp:
            D.apply_fsdp2(self.forward, bf16=self.bf16, cpu_offload=cfg.distributed.cpu_offload)
        model.train()
        self.model = model

        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.forward.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
            foreach=dev.type == "cuda" or None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, linear_warmup_constant(cfg.warmup_steps))

        kl = cfg.algorithm.kl
        self.anchor = None
        if kl.enabled:
            from trainer.ema import EMAAnchor

            ema = cfg.algorithm.ema
            self.anchor = EMAAnchor(
                model,
                anchor_decay=ema.decay,
                update_period=ema.period,
                dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[ema.dtype],
                device="cpu" if ema.offload else None,
                # The FSDP2 root is the forward wrapper (it owns embeddings/lm_head): resharding it around
                # swap_into keeps anchor passes from reading the policy's unsharded weights.
                fsdp_root=self.forward if self.fsdp else None,
            )

        if ckpt_path is not None:
            self._restore(ckpt_path)

        self._setup_retriever()
        self._setup_engine()
        self.tracker = Tracker(
            self.run_dir,
            total_steps=cfg.run.total_steps,
            start_step=self.step,
            tensorboard=cfg.logging.tensorboard,
            wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project,
            run_name=cfg.run.name,
            config=to_dict(cfg),
            progress=cfg.logging.progress,
            enabled=self.dist.is_main,
        )
        self._closers.append(self.tracker)
        return self

    def _find_resume(self) -> Path | None:
        if self.resume_from is None:
            return None
        from trainer.checkpoint import resolve_resume

        target = Path(self.resume_from) if str(self.resume_from) else self.run_dir
        try:
            return resolve_resume(target)
        except FileNotFoundError:
            if str(self.resume_from) == "" and latest_checkpoint(self.run_dir) is None:
                return None  # `--resume` on a fresh run folder starts from scratch
            raise ConfigError(f"--resume: no checkpoint found in {target}") from None

    def _restore(self, path: Path) -> None:
        ckpt = load_checkpoint(path, rank=self.dist.rank)
        self.step = ckpt.step
        state = ckpt.trainer_state
        self.sampler.load_state_dict(state["data"])
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        opt = load_optimizer_state(path)
        if opt is not None or self.fsdp:
            D.load_optimizer_state(self.forward, self.optimizer, opt or {})
        sched = load_scheduler_state(path)
        if sched is not None:
            self.scheduler.load_state_dict(sched)
        if self.anchor is not None:
            if ckpt.anchor_state is None:
                raise ConfigError(f"{path} has no anchor.safetensors but algorithm.kl is enabled")
            self._load_anchor(ckpt.anchor_state, state.get("anchor", {}))
        if self.dist.is_main:
            log.info("resumed from %s at step %d", path, self.step)

    def _load_anchor(self, full: dict[str, torch.Tensor], schedule: dict[str, Any]) -> None:
        """Load a full (unsharded) anchor; under FSDP each rank keeps only its own shards."""
        self.anchor.load_full_state_dict(
            full, num_updates=schedule.get("num_updates", 0), last_update_step=schedule.get("last_update_step")
        )

    def _setup_retriever(self) -> None:
        cfg = self.cfg
        self.retriever = None
        if cfg.rollout.task != "search":
            return
        api_key = os.environ.get(cfg.retriever.api_key_env) if cfg.retriever.api_key_env else None
        if cfg.retriever.api_key_env and not api_key:
            raise ConfigError(f"retriever.api_key_env: ${cfg.retriever.api_key_env} is not set")
        urls = list(cfg.retriever.urls)
        if not urls:
            if int(os.environ.get("LOCAL_WORLD_SIZE", self.dist.world_size)) < self.dist.world_size:
                raise ConfigError("multi-node training needs retriever.urls (servers every node can reach), not index_dir")
            url = None
            if self.dist.is_main:
                from retriever.launch import RetrieverServer

                server = RetrieverServer(cfg.retriever.index_dir, topk=cfg.rollout.topk, api_key=api_key).start()
                self._closers.append(server)
                url = server.url
            urls = [D.broadcast_object(url)]
        from retriever.client import RetrieverClient

        self.retriever = RetrieverClient(urls, timeout=cfg.retriever.timeout, retries=cfg.retriever.retries, api_key=api_key)
        self._closers.append(self.retriever)

    def _setup_engine(self) -> None:
        from agent.engines import make_engine

        r = self.cfg.rollout
        dev = self.dist.device
        max_len = r.max_prompt_tokens + r.max_response_tokens
        if r.engine == "remote":
            from agent.engines.remote import RemoteEngine

            self.engine = RemoteEngine(
                r.engine_urls, model_path=self.model_path, api_key=os.environ.get(r.engine_api_key_env) if r.engine_api_key_env else None,
                timeout=r.engine_timeout, wait_s=r.engine_wait, weight_sync=r.weight_sync, bucket_bytes=r.weight_sync_bucket_mb << 20,
                collective_host=r.collective_host, collective_port=r.collective_port,
                collective_backend=r.collective_backend if r.collective_backend != "auto" else ("nccl" if dev.type == "cuda" else "gloo"),
            )  # fmt: skip
            # The servers hold whatever they were started with (another run, an older checkpoint): sync first.
            self._weights_dirty = True
        elif r.engine == "hf":
            self.engine = make_engine(
                "hf", self.model_path, dtype="bfloat16" if self.bf16 else "float32", device=str(dev),
                max_model_len=max_len, seed=self.cfg.run.seed,
            )
        else:
            self.engine = make_engine(
                "vllm", self.model_path, max_model_len=max_len, seed=self.cfg.run.seed,
                tensor_parallel_size=r.vllm_tensor_parallel_size, gpu_memory_utilization=r.vllm_gpu_memory_utilization,
                enable_sleep_mode=r.vllm_sleep and dev.type == "cuda",
            )
        self._closers.append(self.engine)
        # On resume or with a sharded policy the engine loaded the same HF folder: no sync needed.

    # ------------------------------------------------------------------ the step
    def _autocast(self):
        if self.bf16 and not self.fsdp:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def sample_prompts(self) -> list[SampledPrompt]:
        """The global batch of prompts of this step (the same on every rank), then this rank's share."""
        n = self.cfg.data.prompts_per_step
        prompts = self.sampler.next(n, self.step + 1)
        return prompts[D.shard_slice(n, self.dist.rank, self.dist.world_size)]

    def rollout(self, prompts: list[SampledPrompt]) -> Rollouts:
        """Generate and score ``n_samples`` trajectories per prompt; retried on failure."""
        from trainer.rollouts import generate, score

        cfg = self.cfg
        remote = cfg.rollout.engine == "remote"
        if self._weights_dirty:
            if remote:  # shared servers: rank 0 wakes them and pushes once, the other ranks wait for it
                state = self._policy_state(all_ranks=False)
                if self.dist.is_main:
                    self.engine.wake()
                    self.engine.load_weights(state, tag=f"step-{self.step}")
                D.barrier()
            else:
                self.engine.wake()
                self.engine.load_weights(self._policy_state(all_ranks=True))
            self._weights_dirty = False
        # Not on shared servers (the trainer never puts them to sleep): a server's /wake is a barrier that
        # waits out every rank's in-flight generations and holds back the ones submitted after it.
        if not remote:
            self.engine.wake()
        seed = step_seed(cfg.run.seed, self.step + 1, self.dist.rank)
        last: Exception | None = None
        for attempt in range(cfg.run.rollout_retries + 1):
            try:
                trajectories, stats = generate(self.engine, self.tokenizer, prompts, self.retriever, cfg, seed=seed + attempt)
                break
            except Exception as e:  # a crashed rollout batch is retried (weights and prompts unchanged)
                last = e
                self._message(f"[warn] step {self.step + 1}: rollout attempt {attempt + 1} failed: {type(e).__name__}: {e}")
        else:
            raise TrainingError(f"rollout failed {cfg.run.rollout_retries + 1} times; last error: {last}") from last
        if cfg.rollout.engine == "vllm":
            self.engine.sleep()
        group_ids = [p.group_id for p in prompts for _ in range(cfg.rollout.n_samples)]
        rewards, counts = score(trajectories, prompts, cfg, self.engine.tokenizer)
        return Rollouts(prompts, trajectories, group_ids, torch.tensor(rewards, dtype=torch.float32), counts, stats)

    @torch.no_grad()
    def _anchor_stats(self, mb: MicroBatch, **kwargs: Any):
        """The anchor's statistics on a micro-batch.

        Unsharded: ``torch.func.functional_call`` runs the policy module with the anchor's
        tensors in place of its parameters, without touching the parameters, so it is safe
        while the policy's autograd graph is alive and costs no weight copies (fp32 anchor on
        the same device). Under FSDP the anchor holds local shards, which only the module's
        own sharded parameters can carry: the anchor is swapped in and out.
        """
        from trainer.logprobs import TokenStats

        args = (mb.input_ids, mb.attention_mask, mb.response_width)
        kwargs["share_prompt"] = self.cfg.model.share_prompt
        if self.fsdp:
            with self.anchor.swap_into(self.model), self._autocast():
                return TokenStats(*self.forward(*args, **kwargs))
        if self._anchor_params is None:  # (anchor tensor, dtype, device) per policy tensor; EMA updates them in place
            own = {**dict(self.forward.named_parameters()), **dict(self.forward.named_buffers())}
            self._anchor_params = {
                f"lm.{name}": (t, own[f"lm.{name}"].dtype, own[f"lm.{name}"].device) for name, t in self.anchor.tensors.items()
            }
        tensors = {
            key: t if (t.dtype == dtype and t.device == device) else t.to(dtype=dtype, device=device)
            for key, (t, dtype, device) in self._anchor_params.items()
        }
        with self._autocast():
            return TokenStats(*torch.func.functional_call(self.forward, tensors, args, kwargs))

    def _fused_topk_reverse(self, n: int) -> bool:
        """On-policy Top-k reverse KL without stored statistics: the training pass takes its own
        top-k (= π_old's, the same weights) and the anchor is gathered there right away."""
        return self._on_policy_single_update(n) and not self.fsdp

    def _on_policy_single_update(self, n: int) -> bool:
        """One PPO epoch and one optimizer step: π_old is the policy being differentiated.

        Then its log-probs equal the training pass's own (detached), so the separate π_old
        pass is skipped (as TRL does); Top-k reverse KL still needs it, for the indices.
        """
        alg = self.cfg.algorithm
        return alg.ppo_epochs == 1 and n <= max(1, alg.mini_batch_size // self.dist.world_size)

    def _stats(self, mb: MicroBatch, **kwargs: Any):
        from trainer.logprobs import TokenStats

        return TokenStats(*self.forward(mb.input_ids, mb.attention_mask, mb.response_width, **kwargs))

    def _micro_rows(self, n: int) -> list[slice]:
        mb = self.cfg.algorithm.micro_batch_size
        return [slice(i, min(i + mb, n)) for i in range(0, n, mb)]

    @torch.no_grad()
    def compute_stored_stats(self, batch: TokenBatch) -> dict[str, float]:
        """π_old log-probs (+ its top-k indices, entropy) and the anchor's statistics, stored per token."""
        cfg = self.cfg
        kl = cfg.algorithm.kl
        temp = cfg.rollout.temperature
        chunk = cfg.model.chunk_size
        need_old_topk = kl.enabled and kl.type == "topk_reverse" and kl.topk > 0
        n, t = batch.size, batch.response_width
        if need_old_topk and self._fused_topk_reverse(n):
            return {}  # old = current policy: indices and anchor statistics come inside the training pass
        k = kl.topk if kl.enabled and kl.type in TOPK_KL_TYPES else 0
        topk_idx = torch.zeros(n, t, k, dtype=torch.long) if k else None
        timings = {}
        t0 = time.perf_counter()
        if not self._on_policy_single_update(n) or need_old_topk:
            old_logp = torch.zeros(n, t)
            entropy = torch.zeros(n, t)
            for rows in self._micro_rows(n):
                mb = batch.micro(rows, self.dist.device)
                with self._autocast():
                    st = self._stats(
                        mb, topk=k if need_old_topk else 0, entropy=True, temperature=temp, chunk_size=chunk,
                        share_prompt=cfg.model.share_prompt,
                    )
                w = mb.response_width
                old_logp[rows, :w] = st.logp.float().cpu()
                entropy[rows, :w] = st.entropy.float().cpu()
                if need_old_topk:
                    topk_idx[rows, :w] = st.topk_indices.cpu()
            batch.stored["old_logp"] = old_logp
            batch.stored["entropy"] = entropy
        timings["time/old_logprobs"] = time.perf_counter() - t0
        if self.anchor is None or kl.type in EXACT_KL_TYPES:
            return timings  # exact KL recomputes the anchor's full logits per micro-batch
        t0 = time.perf_counter()
        ref_logp = torch.zeros(n, t)
        ref_lse = torch.zeros(n, t)
        ref_vals = torch.zeros(n, t, k) if k else None
        for rows in self._micro_rows(n):
            mb = batch.micro(rows, self.dist.device)
            w = mb.response_width
            gather = topk_idx[rows, :w].to(self.dist.device) if need_old_topk else None
            st = self._anchor_stats(
                mb, topk=k if (k and kl.type == "topk_forward") else 0, gather_indices=gather,
                temperature=temp, chunk_size=chunk,
            )
            ref_logp[rows, :w] = st.logp.float().cpu()
            ref_lse[rows, :w] = st.logsumexp.float().cpu()
            if k:
                ref_vals[rows, :w] = st.topk_logits.float().cpu()
                if kl.type == "topk_forward":
                    topk_idx[rows, :w] = st.topk_indices.cpu()
        batch.stored["ref_logp"] = ref_logp
        batch.stored["ref_logsumexp"] = ref_lse
        if k:
            batch.stored["ref_topk_logits"] = ref_vals
            batch.stored["topk_indices"] = topk_idx
        timings["time/anchor"] = time.perf_counter() - t0
        return timings

    def _micro_loss(self, mb: MicroBatch, agg, sums: dict[str, float]) -> torch.Tensor:
        """Loss of one micro-batch (already normalised for the whole mini-batch)."""
        from trainer.grpo import compute_policy_loss, kl_loss
        from trainer.logprobs import TokenStats, token_stats_from_logits

        cfg = self.cfg
        alg = cfg.algorithm
        kl = alg.kl
        temp = cfg.rollout.temperature
        s = mb.stored
        labels = mb.labels
        on_policy = "old_logp" not in s
        want_entropy = alg.entropy_coef != 0.0 or on_policy
        policy_logits = anchor_logits = None
        with self._autocast():
            if kl.enabled and kl.type in EXACT_KL_TYPES:
                with torch.no_grad(), self.anchor.swap_into(self.model):
                    (ref,) = self.forward(mb.input_ids, mb.attention_mask, mb.response_width, logits=True)
                anchor_logits = ref.float() / temp
                (full,) = self.forward(mb.input_ids, mb.attention_mask, mb.response_width, logits=True)
                policy_logits = full.float() / temp
                stats = token_stats_from_logits(policy_logits, labels, entropy=want_entropy, chunk_size=cfg.model.chunk_size)
            elif kl.enabled and kl.type == "topk_reverse" and kl.topk > 0 and "topk_indices" not in s:
                stats = self._stats(mb, topk=kl.topk, entropy=want_entropy, temperature=temp, chunk_size=cfg.model.chunk_size)
                stats.topk_indices = stats.topk_indices.detach()
                ref = self._anchor_stats(mb, gather_indices=stats.topk_indices, temperature=temp, chunk_size=cfg.model.chunk_size)
                s = {**s, "ref_logp": ref.logp, "ref_logsumexp": ref.logsumexp, "ref_topk_logits": ref.topk_logits,
                     "topk_indices": stats.topk_indices}
            else:
                stats = self._stats(
                    mb, gather_indices=s.get("topk_indices"), entropy=want_entropy, temperature=temp,
                    chunk_size=cfg.model.chunk_size,
                )
        old_logp = stats.logp.detach() if on_policy else s["old_logp"]
        if on_policy:
            sums["entropy_sum"] = sums.get("entropy_sum", 0.0) + float((stats.entropy.detach() * mb.loss_mask).sum())
        loss, m = compute_policy_loss(
            stats.logp, old_logp, s["advantages"], mb.loss_mask, agg,
            clip_low=alg.clip_low, clip_high=alg.clip_high, dual_clip_c=alg.dual_clip,
            log_ratio_clamp=20.0 if alg.dual_clip is not None else None,
            entropy=stats.entropy, entropy_coef=alg.entropy_coef,
        )
        tokens = float(m["tokens"])
        for key in ("pg_clipfrac", "ppo_kl", "ratio_mean"):
            sums[key] = sums.get(key, 0.0) + float(m[key]) * tokens
        sums["pg_loss"] = sums.get("pg_loss", 0.0) + float(m["pg_loss"])
        sums["tokens"] = sums.get("tokens", 0.0) + tokens
        if kl.enabled:
            anchor = TokenStats(
                logp=s["ref_logp"] if "ref_logp" in s else stats.logp.detach(),
                logsumexp=s.get("ref_logsumexp", stats.logsumexp.detach()),
                topk_logits=s.get("ref_topk_logits"),
                topk_indices=s.get("topk_indices"),
            )
            kloss, km = kl_loss(
                kl.type, policy=stats, anchor=anchor, labels=labels, loss_mask=mb.loss_mask, agg=agg,
                old_logp=old_logp, use_iw=kl.importance_weight,
                iw_clip=tuple(kl.iw_clip) if kl.iw_clip else None,
                tail_sampling=kl.tail_sampling, tail_grad=kl.tail_grad,
                policy_logits=policy_logits, anchor_logits=anchor_logits,
            )
            loss = loss + kl.coef * kloss
            sums["kl_token_sum"] = sums.get("kl_token_sum", 0.0) + float(km["kl_token_mean"]) * tokens
            sums["kl_loss"] = sums.get("kl_loss", 0.0) + float(km["kl"])
        return loss

    def update(self, batch: TokenBatch) -> dict[str, float]:
        """PPO epochs over mini-batches with gradient accumulation; returns training metrics."""
        from trainer.grpo import LossAggregation

        cfg = self.cfg
        alg = cfg.algorithm
        n = batch.size
        mini = max(1, alg.mini_batch_size // self.dist.world_size)
        sums: dict[str, float] = {}
        grad_norms: list[float] = []
        skipped = 0
        updates = 0
        for _ in range(alg.ppo_epochs):
            for start in range(0, n, mini):
                rows = list(range(start, min(start + mini, n)))
                micro = [slice(rows[i], rows[min(i + alg.micro_batch_size, len(rows)) - 1] + 1)
                         for i in range(0, len(rows), alg.micro_batch_size)]
                masks = [batch.loss_mask[r] for r in micro]
                agg = LossAggregation.for_batch(
                    alg.loss_agg, masks, num_micro_batches=len(micro), all_reduce=self.dist.distributed,
                    norm_length=float(cfg.rollout.max_response_tokens),
                )
                self.optimizer.zero_grad(set_to_none=True)
                finite = True
                for r in micro:
                    loss = self._micro_loss(batch.micro(r, self.dist.device), agg, sums)
                    if not torch.isfinite(loss.detach()).all():
                        finite = False
                    loss.backward()
                if cfg.optim.grad_clip > 0:
                    gn = torch.nn.utils.clip_grad_norm_(self.forward.parameters(), cfg.optim.grad_clip)
                else:
                    gn = torch.nn.utils.get_total_norm([p.grad for p in self.forward.parameters() if p.grad is not None])
                gn = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
                flag = torch.tensor([0.0 if (finite and math.isfinite(gn)) else 1.0])
                if D.all_reduce_max(flag).item() > 0:
                    skipped += 1
                    self.optimizer.zero_grad(set_to_none=True)
                    self._message(f"[warn] step {self.step + 1}: non-finite loss or gradient (norm {gn}); update skipped")
                    continue
                grad_norms.append(gn)
                self.optimizer.step()
                updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # the schedule advances per step even when every update was skipped
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            self.scheduler.step()
        tot = torch.tensor([sums.get(k, 0.0) for k in ("tokens", "pg_clipfrac", "ppo_kl", "ratio_mean", "kl_token_sum")],
                           dtype=torch.float64)
        tot = D.all_reduce_sum(tot)
        tokens = max(float(tot[0]), 1.0)
        out = {
            "loss/clip_frac": float(tot[1]) / tokens,
            "loss/ppo_kl": float(tot[2]) / tokens,
            "loss/ratio_mean": float(tot[3]) / tokens,
            "loss/pg": sums.get("pg_loss", 0.0) / max(updates + skipped, 1),
            "actor/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            "actor/lr": self.optimizer.param_groups[0]["lr"],
            "actor/updates": float(updates),
            "actor/skipped_updates": float(skipped),
        }
        if "entropy_sum" in sums:
            out["_entropy_sum"] = sums["entropy_sum"]
        if alg.kl.enabled:
            out["kl/mean"] = float(tot[4]) / tokens
            out["kl/loss"] = sums.get("kl_loss", 0.0) / max(updates + skipped, 1)
        return out

    def train_step(self) -> dict[str, float]:
        """One full step; returns its metrics (already reduced over ranks)."""
        from trainer.grpo import grpo_advantages

        cfg = self.cfg
        t_step = time.perf_counter()
        prompts = self.sample_prompts()
        t0 = time.perf_counter()
        ro = self.rollout(prompts)
        t_rollout = time.perf_counter() - t0
        trajs = ro.trajectories
        batch = build_token_batch(
            [list(t.prompt_ids) for t in trajs], [list(t.response_ids) for t in trajs],
            [list(t.loss_mask) for t in trajs], pad_id=self._pad_id(),
        )
        t0 = time.perf_counter()
        timings = self.compute_stored_stats(batch)
        alg = cfg.algorithm
        adv = grpo_advantages(
            ro.rewards, ro.group_ids, norm_by_std=alg.adv_std != "none", unbiased_std=alg.adv_std != "biased", eps=alg.adv_eps
        )
        batch.stored["advantages"] = adv[:, None].expand(-1, batch.response_width).contiguous()
        train = self.update(batch)
        t_train = time.perf_counter() - t0
        self.step += 1
        ema_updated = self.anchor.maybe_update(self.step) if self.anchor is not None else False
        if train["actor/updates"] > 0:
            self._weights_dirty = True
        entropy_sum = train.pop("_entropy_sum", None)
        if entropy_sum is None:
            entropy_sum = float((batch.stored["entropy"] * batch.loss_mask).sum())
        metrics = self._rollout_metrics(ro, batch, entropy_sum)
        self._last_samples = [
            {"group_id": g, "reward": float(r), "stop_reason": t.stop_reason, "searches": t.num_searches,
             "question": t.question, "response": t.response_text}
            for t, g, r in list(zip(ro.trajectories, ro.group_ids, ro.rewards.tolist()))[: cfg.logging.log_samples]
        ]
        metrics.update(train)
        metrics.update(timings)
        metrics["ema/updated"] = float(ema_updated)
        t_total = time.perf_counter() - t_step
        gen_time = metrics.pop("_gen_time")
        ret_time = metrics.pop("_ret_time")
        metrics.update({
            "time/rollout": t_rollout,
            "time/generation": gen_time,
            "time/retrieval": ret_time,
            "time/training": t_train,
            "time/step": t_total,
            "perf/tokens_per_s": metrics["_tokens"] / max(t_total, 1e-9),
        })
        metrics.pop("_tokens")
        finite = math.isfinite(metrics.get("loss/pg", 0.0)) and metrics["actor/skipped_updates"] == 0
        self.nonfinite_streak = 0 if finite else self.nonfinite_streak + 1
        metrics["actor/nonfinite_streak"] = float(self.nonfinite_streak)
        return metrics

    def _pad_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    def _rollout_metrics(self, ro: Rollouts, batch: TokenBatch, entropy_sum: float) -> dict[str, float]:
        """Reward, length, search and time statistics, summed over ranks."""
        from trainer.rollouts import trajectory_stats

        r = ro.rewards
        stats = trajectory_stats(ro.trajectories, ro.stats)
        n = float(len(r))
        ent_mask = batch.loss_mask
        g = self.cfg.rollout.n_samples
        grouped = r.view(-1, g)
        solved_all = float((grouped.min(1).values == grouped.max(1).values).sum())
        local = torch.tensor([
            n, float(r.sum()), float((r * r).sum()),
            float(batch.response_lens.sum()), float(ent_mask.sum()),
            entropy_sum,
            stats["searches"], stats["search_failures"], stats["turns"], stats["truncated"],
            stats["generation_time"], stats["retrieval_time"], solved_all, float(grouped.shape[0]),
            float(batch.response_lens.sum() + batch.prompt_lens.sum()),
        ], dtype=torch.float64)
        tot = D.all_reduce_sum(local)
        (n, rs, rs2, resp, model_tok, ent, searches, fails, turns, trunc, gen_t, ret_t, flat, groups, tokens) = tot.tolist()
        world = self.dist.world_size
        mean = rs / n
        out = {
            "reward/mean": mean,
            "reward/std": math.sqrt(max(rs2 / n - mean * mean, 0.0)),
            "reward/zero_variance_groups": flat / max(groups, 1.0),
            "response/length_mean": resp / n,
            "response/model_tokens_mean": model_tok / n,
            "response/truncated_frac": trunc / n,
            "actor/entropy": ent / max(model_tok, 1.0),
            "search/per_traj": searches / n,
            "search/failures": fails,
            "search/turns_per_traj": turns / n,
            "_gen_time": gen_t / world,
            "_ret_time": ret_t / world,
            "_tokens": tokens,
        }
        for key, value in ro.reward_counts.items():
            out[f"reward/{key}"] = float(D.all_reduce_sum(torch.tensor([value], dtype=torch.float64))[0])
        return out

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict[str, float]]:
        """Run to ``run.total_steps``; checkpoints and signals handled here. Returns the step metrics."""
        cfg = self.cfg
        history: list[dict[str, float]] = []
        previous = self._install_signal_handlers()
        try:
            while self.step < cfg.run.total_steps:
                metrics = self.train_step()
                history.append(metrics)
                self.tracker.log(self.step, metrics)
                self.tracker.log_samples(self.step, self._last_samples)
                if self.nonfinite_streak >= cfg.run.max_consecutive_nonfinite:
                    raise TrainingError(
                        f"{self.nonfinite_streak} consecutive steps had a NaN/inf loss or gradient "
                        f"(run.max_consecutive_nonfinite={cfg.run.max_consecutive_nonfinite}); stopping. "
                        "Lower optim.lr, check the data, or raise the limit."
                    )
                stop = D.all_reduce_max(torch.tensor([float(self._stop_signal is not None)])).item() > 0
                last = self.step == cfg.run.total_steps
                periodic = cfg.run.save_every and self.step % cfg.run.save_every == 0
                if stop or last or periodic:
                    self.save()
                if stop:
                    self._message(f"stopped by signal after step {self.step}; checkpoint saved to {self.run_dir}")
                    break
        finally:
            self._restore_signal_handlers(previous)
        return history

    def _policy_state(self, *, all_ranks: bool) -> dict[str, torch.Tensor]:
        """The policy's full HF-named state dict (gathered from the shards under FSDP)."""
        sd = D.full_state_dict(self.forward, all_ranks=all_ranks)
        return {k.removeprefix("lm."): v for k, v in sd.items()}

    def save(self) -> Path:
        cfg = self.cfg
        policy_state = self._policy_state(all_ranks=False) if self.fsdp else None
        anchor_full = self.anchor.full_state_dict() if self.anchor is not None else None
        anchor_sched = {}
        if self.anchor is not None:
            anchor_sched = {"num_updates": self.anchor.num_updates, "last_update_step": self.anchor.last_update_step}
        return save_checkpoint(
            self.run_dir,
            self.step,
            policy_state=policy_state,
            model=self.model,
            tokenizer=self.tokenizer,
            anchor_state=anchor_full if self.dist.is_main else None,
            optimizer_state=D.optimizer_state(self.forward, self.optimizer),
            scheduler_state=self.scheduler.state_dict(),
            trainer_state={"data": self.sampler.state_dict(), "nonfinite_streak": self.nonfinite_streak, "anchor": anchor_sched},
            config=cfg,
            keep_last=cfg.run.keep_last,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            barrier=D.barrier,
        )

    def _install_signal_handlers(self) -> dict[int, Any]:
        previous = {}

        def handler(signum, frame):
            if self._stop_signal is not None:  # second signal: stop now
                raise KeyboardInterrupt
            self._stop_signal = signum
            self._message(f"received {signal.Signals(signum).name}: finishing step {self.step + 1}, then saving")

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread
                pass
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, Any]) -> None:
        for sig, h in previous.items():
            signal.signal(sig, h)

    def _message(self, text: str) -> None:
        tracker = getattr(self, "tracker", None)
        if tracker is not None and tracker.enabled:
            tracker.message(text)
        elif self.dist.is_main if hasattr(self, "dist") else True:
            log.warning(text)

    def close(self) -> None:
        for c in reversed(self._closers):
            with contextlib.suppress(Exception):
                (getattr(c, "stop", None) if hasattr(c, "proc") else c.close)()
        self._closers.clear()


def train(cfg: TrainConfig, *, resume: str | Path | None = None) -> list[dict[str, float]]:
    """Build a :class:`Trainer`, run it, and release everything it started."""
    trainer = Trainer(cfg, resume=resume)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.close()
