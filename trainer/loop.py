"""The EMA-PG / GRPO training run: set-up, the step as a sequence of parts, resume, save, signals, clean-up.

One step, top to bottom (every rank does the same on its share of the prompts):

1. sample ``data.prompts_per_step`` prompts, each with a run-unique group id;
2. *produce* (:meth:`Trainer.sample_batch`): the engine session syncs new weights, ``rollout.n_samples``
   trajectories per prompt (the GRPO group) come from :func:`agent.rollout.run_rollouts`
   (search: the real retriever over HTTP), each graded once by its task (:mod:`tasks.task`) into a
   :class:`trainer.sampled_batch.SampledBatch`;
   then the batch shapers (guidance, the informative-group filter) reshape it;
3. *consume* (:meth:`Trainer.learn`): the step's plan (:meth:`Trainer.plan_step`: the batch as tensors,
   :func:`trainer.batch.trajectory_batch`; GRPO advantages per group; the stored-statistics plan; the passes
   over the batch -- π_old's and the anchor's statistics as the KL kind needs them, :mod:`trainer.stored_stats`,
   then each concern's: the teacher, ``kl/to_start``), the passes run together, once per micro-batch
   (:func:`trainer.passes.run_passes`), the PPO update
   (:mod:`trainer.step`: mini-batches of ``algorithm.mini_batch_size``, gradient accumulation,
   loss normalised over the whole mini-batch on all ranks, clipping, AdamW, NaN/inf updates
   skipped), the LR schedule, the EMA blend after steps P, 2P, ...; the step's metrics are summed
   over ranks once (:mod:`trainer.metrics`);
4. step hooks (:attr:`Trainer.step_hooks`) see the metrics: the default stops a run whose updates
   keep failing.

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
from typing import Any, Callable

import numpy as np
import torch

from emapg.config import ConfigError
from provision.engines import EngineSession, EngineSpec, RemoteOptions, VLLMOptions, build_engine
from tasks.contamination import TrainedQuestions
from tasks.task import get_task
from trainer import distributed as D
from trainer.batch import TokenBatch, pad_id_of, trajectory_batch
from trainer.checkpoint import Checkpoint, latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.config import TrainConfig
from trainer.data import PromptSampler, SampledPrompt, load_prompts
from trainer.errors import TrainingError
from trainer.entropy_control import EntropyController, controller_card
from trainer.health_signals import LengthDrift
from trainer.lora import check_engine_serves_lora, engine_lora_config, serves_adapters
from trainer.metrics import learn_sums, peak_memory, step_metrics, update_metrics
from trainer.provenance import record_files, refreshed, train_provenance, trained_questions
from trainer.policy import build_policy, set_numerics, use_bf16
from trainer.sampled_batch import SampledBatch, TrainingRows, batch_sums, produce, rank_training_rows, step_seed
from trainer.samples import sample_records
from trainer.search_health import SearchOutageGuard
from trainer.step import UpdateResult, ppo_update
from trainer.passes import BatchPass, StepConcern, run_passes
from trainer.stored_stats import StatsPlan, compute_stored_stats, step_stats_plan, stored_stat_passes
from trainer.tracking import Tracker

log = logging.getLogger(__name__)


#: A step hook sees the trainer and the step's metrics after they are logged; it may raise
#: :class:`TrainingError` to stop, or act on the trainer (roll back, reset to the anchor, lower the LR).
StepHook = Callable[["Trainer", dict[str, float]], None]


def stop_on_nonfinite_streak(trainer: "Trainer", metrics: dict[str, float]) -> None:
    limit = trainer.cfg.run.max_consecutive_nonfinite
    if trainer.nonfinite_streak >= limit:
        raise TrainingError(f"{trainer.nonfinite_streak} consecutive steps had a NaN/inf loss or gradient "
                            f"(run.max_consecutive_nonfinite={limit}); stopping. Lower optim.lr, check the data, or raise the limit.")


def engine_spec(cfg: TrainConfig, model_path: str, device: torch.device, bf16: bool) -> EngineSpec:
    """The generation engine of ``rollout.*`` for a policy at ``model_path`` trained on ``device``."""
    r = cfg.rollout
    remote = None
    if r.engine == "remote":
        backend = r.collective_backend if r.collective_backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        remote = RemoteOptions(
            tuple(r.engine_urls), api_key=os.environ.get(r.engine_api_key_env) if r.engine_api_key_env else None,
            timeout=r.engine_timeout, wait_s=r.engine_wait, weight_sync=r.weight_sync, bucket_bytes=r.weight_sync_bucket_mb << 20,
            collective_host=r.collective_host, collective_port=r.collective_port, collective_backend=backend,
        )  # fmt: skip
    return EngineSpec(
        r.engine, model_path, max_model_len=r.max_prompt_tokens + r.max_response_tokens, seed=cfg.run.seed,
        dtype="bfloat16" if bf16 and device.type == "cuda" else "float32", device=str(device), remote=remote,
        vllm=VLLMOptions(r.vllm_tensor_parallel_size, r.vllm_gpu_memory_utilization, r.vllm_sleep and device.type == "cuda"),
        max_lora_rank=cfg.model.lora.rank if serves_adapters(cfg.model.lora) else None,
    )  # fmt: skip


def open_engine_session(cfg: TrainConfig, policy: Any, model_path: str, dist: D.DistInfo, bf16: bool, *,
                        on_close: Callable[[Callable[[], Any]], None]) -> EngineSession:
    """The run's generation engine (:func:`engine_spec`; ``on_close`` gets its release) in a session that syncs the
    policy's weights (or LoRA adapters: an engine that cannot serve them fails here, before any rollout)."""
    spec = engine_spec(cfg, model_path, dist.device, bf16)
    engine = build_engine(spec)
    on_close(engine.close)
    lora = engine_lora_config(policy.model) if serves_adapters(cfg.model.lora) else None
    if lora is not None:
        check_engine_serves_lora(engine.info, cfg.model.lora)
    return EngineSession(engine, spec.kind, export_weights=policy.export_weights, is_main=dist.is_main, barrier=D.barrier,
                         lora_config=lora)


def training_signal(cfg: TrainConfig) -> dict[str, Any]:
    """What the run learned from, beyond the algorithm: the reward's form, the random-reward control, what was done
    with groups of equal rewards (recorded in the provenance, so a result names its levers)."""
    r, ro = cfg.reward, cfg.rollout
    return {"qa_reward": r.qa_reward if ro.task == "search" else None,
            "qa_answer": r.qa_answer if ro.task == "search" else None, "no_answer_penalty": r.no_answer_penalty,
            "shuffle_control": r.shuffle_control, "uniform_groups": ro.uniform_groups, "filter_groups": ro.filter_groups,
            "guidance": cfg.algorithm.guidance, **controller_card(cfg.algorithm)}


def find_resume(resume_from: str | Path | None, run_dir: Path) -> Path | None:
    """The checkpoint to resume from: ``None`` (no ``--resume``, or ``--resume`` on a fresh run folder),
    the latest of ``run_dir`` (``--resume``) or of a given folder (``--resume DIR``)."""
    if resume_from is None:
        return None
    from trainer.checkpoint import resolve_resume

    target = Path(resume_from) if str(resume_from) else run_dir
    try:
        return resolve_resume(target)
    except FileNotFoundError:
        if str(resume_from) == "" and latest_checkpoint(run_dir) is None:
            return None  # `--resume` on a fresh run folder starts from scratch
        raise ConfigError(f"--resume: no checkpoint found in {target}") from None


def open_run_retriever(cfg: TrainConfig, dist: D.DistInfo) -> Any:
    """The search task's retriever (:func:`provision.retrievers.open_retriever`): ``retriever.urls``, or a
    server rank 0 launches on ``retriever.index_dir`` for the run, its URL broadcast to every rank."""
    if not get_task(cfg.rollout.task).searches:
        return None
    if not cfg.retriever.urls and int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size)) < dist.world_size:
        raise ConfigError("multi-node training needs retriever.urls (servers every node can reach), not index_dir")
    from provision.retrievers import open_retriever

    r = cfg.retriever
    return open_retriever(urls=r.urls, index_dir=r.index_dir, topk=cfg.rollout.topk, timeout=r.timeout, retries=r.retries,
                          api_key_env=r.api_key_env, launch=dist.is_main, share_url=D.broadcast_object, check=False,
                          wait_s=r.wait, batch_invariant=r.batch_invariant)


@dataclass
class StepPlan:
    """One step's batch and what runs over it (:meth:`Trainer.plan_step`)."""

    rows: TrainingRows  # the update's rows: trajectories, their extra segments, filler rows
    batch: TokenBatch  # those rows as tensors; ``stored`` gets the advantages, then the passes' statistics
    stats: StatsPlan  # what π_old's and the anchor's passes store and the update reads
    advantages: torch.Tensor  # (trajectories,) GRPO advantages
    passes: list[BatchPass]  # the no-grad passes before the update, in order (trainer.passes)
    sums: dict[str, float]  # the batch's own sums beside the rollout's (trainer.sampled_batch.batch_sums: sessions, tools)


def attach_concerns(trainer: "Trainer") -> None:
    """Give ``trainer`` (set up up to its policy) the concerns its config asks for: ``algorithm.distill``'s teacher
    and ``logging.kl_to_start``'s start policy (passes over each batch: :attr:`Trainer.concerns`), the stability guard
    (a step hook with state in the checkpoints)."""
    cfg = trainer.cfg
    if cfg.algorithm.distill.enabled:  # refused here when its tokenizer differs from the policy's
        from trainer.teacher import Distillation

        trainer.teacher = Distillation(cfg, trainer.dist.device, policy_model=trainer.model_path, policy_tokenizer=trainer.tokenizer)
        trainer._on_close(trainer.teacher.close)
        trainer.concerns.append(trainer.teacher)
    if cfg.logging.kl_to_start:
        from trainer.start_kl import StartPolicy

        trainer.start_policy = StartPolicy(trainer.policy, cfg)
        trainer.concerns.append(trainer.start_policy)
    if cfg.guard.enabled:
        from trainer.recovery import GuardHook

        trainer.guard = GuardHook(cfg.guard, fsdp=trainer.fsdp, has_anchor=trainer.anchor is not None)
        trainer.step_hooks.insert(0, trainer.guard)  # before the non-finite streak stop: it may recover first
        trainer.stateful["guard"] = trainer.guard


def batch_shapers(cfg: TrainConfig) -> list[Callable[[Any, SampledBatch], SampledBatch]]:
    """The step's batch shapers, in order: ``algorithm.guidance`` (:class:`trainer.guidance.Guidance`; before the
    filter: a guided group is informative), then the informative filter (:class:`trainer.group_filter.InformativeFilling`)."""
    from trainer.group_filter import InformativeFilling
    from trainer.guidance import Guidance

    return [*([Guidance()] if cfg.algorithm.guidance != "none" else []),
            *([InformativeFilling()] if cfg.rollout.filter_groups or cfg.rollout.uniform_groups == "drop" else [])]


def budget_spent(budget_s: float, elapsed_s: float, steps: int) -> bool:
    """Whether one more step, as long as the mean of the ``steps`` taken in ``elapsed_s``, would end past
    ``budget_s`` (0: no budget; nothing is judged before the first step)."""
    return budget_s > 0 and steps > 0 and elapsed_s + elapsed_s / steps > budget_s


@contextlib.contextmanager
def stop_on_signals(on_signal: Callable[[int], None]):
    """Route SIGINT/SIGTERM to ``on_signal`` inside the block (main thread only), then restore the handlers."""
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread
            previous[sig] = signal.signal(sig, lambda signum, frame: on_signal(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Trainer:
    """One training run: the policy (:class:`trainer.policy.Policy`), its engine session, retriever,
    data and tracker, and the step that ties them together."""

    def __init__(self, cfg: TrainConfig, *, resume: str | Path | None = None) -> None:
        self.cfg, self.run_dir, self.resume_from = cfg, cfg.output_path, resume
        self.step = 0
        self.nonfinite_streak = 0
        self.stop_signal: int | None = None
        self.step_hooks: list[StepHook] = [stop_on_nonfinite_streak]
        self.fuse_on_policy_topk = True  # the on-policy Top-k reverse shortcut (tests compare it with the stored path)
        self.last_samples: list[dict[str, Any]] = []
        self.guard = None  # trainer.recovery.GuardHook when guard.enabled
        self.provenance: dict[str, Any] = {}  # index fingerprints and protocol card, saved in every checkpoint
        self.trained_questions: TrainedQuestions | None = None  # set by setup(): eval's contamination record
        self.engine_session: EngineSession | None = None
        self.engine = self.retriever = self.tracker = None
        self.search_guard: SearchOutageGuard | None = None
        self.teacher = None  # trainer.teacher.Distillation: algorithm.distill's teacher (in process or remote)
        self.length_drift = LengthDrift(cfg.logging.length_drift_steps)  # response/length_drift against the run's start
        self.entropy_control = EntropyController.from_config(cfg.algorithm)  # algorithm.entropy_target (else None)
        # The concerns with state in trainer_state.json (state_dict/load_state_dict), by their key there.
        self.stateful: dict[str, Any] = {"length_drift": self.length_drift, "entropy_control": self.entropy_control}
        self.start_policy = None  # trainer.start_kl.StartPolicy when logging.kl_to_start
        self.concerns: list[StepConcern] = []  # the step's concerns with passes over its batch (trainer.passes)
        self.shapers = batch_shapers(cfg)  # what reshapes a sampled batch before it is learned from
        self.probe: Callable[[Trainer], dict[str, float]] | None = None  # trainer.probe.Probe when logging.probe_size
        self._resources = contextlib.ExitStack()

    # ------------------------------------------------------------------ set-up
    def setup(self, *, with_engine: bool = True) -> "Trainer":
        """Build everything; ``with_engine=False`` skips the engine (callers that feed batches to
        :meth:`compute_stored_stats`/:meth:`update` themselves, e.g. ``benchmarks/gpu_step.py``)."""
        cfg = self.cfg
        self.dist = D.init_distributed(cfg.run.device, cfg.distributed.backend)
        if cfg.rollout.uniform_groups == "drop" and self.dist.world_size > 1:
            raise ConfigError("rollout.uniform_groups=drop trains a different number of rows on each rank; use topup "
                              f"with {self.dist.world_size} processes")
        bf16 = use_bf16(cfg, self.dist.device)
        self._on_close(set_numerics(cfg, self.dist.device))  # run.deterministic, run.flush_denormal (put back on close)
        ckpt_path = find_resume(self.resume_from, self.run_dir)
        for seed in (random.seed, np.random.seed, torch.manual_seed):
            seed(cfg.run.seed + self.dist.rank)
        # Data first: a bad dataset name fails before any model loads.
        examples = load_prompts(cfg.data.train, split=cfg.data.split, limit=cfg.data.limit, seed=cfg.run.seed)
        self.sampler = PromptSampler(examples, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        if cfg.logging.probe_size:
            from trainer.probe import Probe

            self.probe = Probe(cfg, examples)
        # Then the retriever: one that is down or refuses the key fails within retriever.wait, before any model loads.
        self.retriever = open_run_retriever(cfg, self.dist)
        if self.retriever is not None:
            self._on_close(self.retriever.close)
            self.search_guard = SearchOutageGuard(self.retriever, cfg.retriever, warn=self._warn)
        from transformers import AutoTokenizer

        from emapg.models import resolve_model

        self.model_path = str(ckpt_path / "policy") if ckpt_path else resolve_model(cfg.model.policy)
        # What the run can train on (+ what the initial policy was trained on): saved beside every checkpoint's
        # weights for `emapg eval`'s contamination guard. Before the model loads: a damaged record fails fast.
        self.trained_questions = trained_questions(cfg, examples, self.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.policy = build_policy(cfg, self.dist, self.model_path, bf16=bf16)
        self.model, self.anchor, self.fsdp = self.policy.model, self.policy.anchor, self.policy.fsdp
        attach_concerns(self)  # the teacher, kl/to_start, the stability guard
        if ckpt_path is not None:
            self._restore(ckpt_path)
        if self.dist.is_main:
            self.provenance = {**train_provenance(cfg, self.retriever, examples, self.model_path),
                               "trained_questions": self.trained_questions.summary(), "training_signal": training_signal(cfg),
                               "compute_precision": "bf16" if bf16 else "fp32"}  # what ran (run.precision=bf16 may fall back)
        if with_engine:
            self.engine_session = open_engine_session(cfg, self.policy, self.model_path, self.dist, bf16, on_close=self._on_close)
            self.engine = self.engine_session.engine
        self.tracker = Tracker.for_run(cfg, start_step=self.step, enabled=self.dist.is_main)
        self._on_close(self.tracker.close)
        return self

    def _on_close(self, release: Callable[[], Any]) -> None:
        def quietly() -> None:
            with contextlib.suppress(Exception):
                release()

        self._resources.callback(quietly)

    def _restore(self, path: Path) -> None:
        ckpt = load_checkpoint(path, rank=self.dist.rank, world_size=self.dist.world_size, seed=self.cfg.run.seed)
        self.step, state = ckpt.step, ckpt.trainer_state
        self.sampler.load_state_dict(state["data"])
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        for key, concern in self.stateful.items():
            if concern is not None and state.get(key):
                concern.load_state_dict(state[key])
        self.policy.restore(path, ckpt.anchor_state, state.get("anchor", {}))
        if self.dist.is_main:
            log.info("resumed from %s at step %d", path, self.step)

    # ------------------------------------------------------------------ recoveries (trainer.recovery.GuardHook)
    def lower_lr(self, factor: float) -> float:
        """Scale the learning rate by ``factor`` for the rest of the run; the new rate."""
        return self.policy.lower_lr(factor)

    def reset_to_anchor(self) -> None:
        """Continue from the EMA anchor's weights, with fresh optimizer moments."""
        self.policy.reset_to_anchor()
        self._weights_changed()

    def roll_back(self, path: Path) -> Checkpoint:
        """Continue from checkpoint ``path``'s weights, optimizer, schedule and anchor (not its data position:
        the sampler stays past the batches that led here); the checkpoint, for its step and trainer state."""
        ckpt = load_checkpoint(path, rank=self.dist.rank, restore_rng=False)
        self.policy.load_weights(path)
        self.policy.restore(path, ckpt.anchor_state, ckpt.trainer_state.get("anchor", {}))
        self._weights_changed()
        return ckpt

    def _weights_changed(self) -> None:
        self.nonfinite_streak = 0
        if self.engine_session is not None:
            self.engine_session.weights_changed()

    # ------------------------------------------------------------------ the step
    def sample_prompts(self) -> list[SampledPrompt]:
        """The global batch of prompts of this step (the same on every rank), then this rank's share."""
        return self.sampler.next_share(self.cfg.data.prompts_per_step, self.step + 1, self.dist.rank, self.dist.world_size)

    def sample_batch(self, prompts: list[SampledPrompt]) -> SampledBatch:
        """Produce: ``n_samples`` trajectories per prompt with the current weights, graded; retried on failure."""
        with self.engine_session.generating(tag=f"step-{self.step}") as engine:
            return self.produce(engine, prompts, step_seed(self.cfg.run.seed, self.step + 1, self.dist.rank))

    def produce(self, engine: Any, prompts: list[SampledPrompt], seed: int) -> SampledBatch:
        """Generate on ``engine`` with ``seed`` (retried on failure: weights and prompts unchanged) and grade.
        The synchronous step calls it in :meth:`sample_batch`; the pipeline's producer thread (:mod:`trainer.pipeline`) too."""
        return produce(engine, self.tokenizer, prompts, self.retriever, self.cfg, seed=seed, warn=self._warn)

    def stats_plan(self, n: int) -> StatsPlan:
        """The stored-statistics plan for ``n`` rows on this rank."""
        return step_stats_plan(self.cfg, n, self.dist.world_size, fuse=self.fuse_on_policy_topk and not self.fsdp)

    def compute_stored_stats(self, batch: TokenBatch, plan: StatsPlan | None = None) -> dict[str, float]:
        """π_old's and the anchor's statistics into ``batch.stored`` (``plan``: the step's, default
        :meth:`stats_plan`); returns their wall times."""
        return compute_stored_stats(batch, plan or self.stats_plan(batch.size), self.policy, self.cfg, self.dist.device)

    def update(self, batch: TokenBatch, plan: StatsPlan | None = None) -> dict[str, float]:
        """The PPO update on ``batch`` (stored statistics and ``advantages`` in ``batch.stored``) and the
        LR schedule's step; its metrics, reduced over ranks."""
        result, summary = self._update(batch, plan or self.stats_plan(batch.size))
        return update_metrics(result.sums.reduce(), **summary)

    def _update(self, batch: TokenBatch, plan: StatsPlan) -> tuple[UpdateResult, dict[str, Any]]:
        """The update and the schedule's step: what it did, and the keyword arguments of its metrics (:func:`update_metrics`)."""
        cfg = self.cfg if self.entropy_control is None else self.entropy_control.step_config(self.cfg)  # its coefficient
        result = ppo_update(batch, self.policy, plan, cfg, self.dist, warn=self._warn)
        with warnings.catch_warnings():  # the schedule advances per step even when every update was skipped
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            self.policy.scheduler.step()
        return result, dict(world_size=self.dist.world_size, grad_norms=result.grad_norms, updates=result.updates, skipped=result.skipped,
                            lr=self.policy.optimizer.param_groups[0]["lr"], kl_enabled=self.cfg.algorithm.kl.enabled)

    def plan_step(self, sampled: SampledBatch) -> StepPlan:
        """What the step runs over ``sampled``: its rows as tensors with their GRPO advantages, the stored-statistics
        plan (once per step: the passes and the update follow it), the passes (π_old's and the anchor's, then each concern's)."""
        from trainer.algo.grpo import broadcast_advantages, grpo_advantages

        cfg, alg, pad_id = self.cfg, self.cfg.algorithm, self.pad_id  # the Trainer's own part first: no call back into it below
        adv = grpo_advantages(sampled.rewards, sampled.group_ids, norm_by_std=alg.adv_std != "none",
                              unbiased_std=alg.adv_std != "biased", eps=alg.adv_eps)
        # Each trajectory, then its extra segments (a recorded session that split), then filler rows (trainer.sampled_batch).
        rows = rank_training_rows(sampled.trajectories, pad_id=pad_id, cfg=cfg, world_size=self.dist.world_size)
        row_adv, sums = rows.per_row(adv), batch_sums(sampled, rows, cfg)
        batch = trajectory_batch(rows.rows, pad_id=pad_id)  # ids, masks, behaviour log-probs
        batch.stored["advantages"] = broadcast_advantages(row_adv, batch.loss_mask)  # a segment: its episode's
        stats = step_stats_plan(cfg, batch.size, self.dist.world_size, fuse=self.fuse_on_policy_topk and not self.fsdp)
        passes = stored_stat_passes(batch, stats, self.policy, cfg)
        for concern in self.concerns:
            passes += concern.passes(batch, sampled, rows)
        return StepPlan(rows, batch, stats, adv, passes, sums)

    def learn(self, sampled: SampledBatch) -> tuple[dict[str, float], dict[str, float]]:
        """Consume a rollout batch: its plan's passes (stored statistics and the concerns'), the update, the EMA blend;
        returns the step's metrics (timings included) and the rank-summed sums they came from."""
        cfg, step = self.cfg, self.plan_step(sampled)
        t0 = time.perf_counter()
        done = run_passes(step.batch, step.passes, cfg.algorithm, self.dist.device, share_prompts=cfg.model.share_prompt)
        result, summary = self._update(step.batch, step.stats)
        t_train = time.perf_counter() - t0
        self.step += 1
        ema_updated = self.anchor.maybe_update(self.step) if self.anchor is not None else False
        if result.updates > 0 and self.engine_session is not None:
            self.engine_session.weights_changed()
        extra = {**done.sums, **step.sums}  # beside the rollout's: kl/to_start, sessions, tools
        totals = learn_sums(sampled, step.batch, result.sums, extra, group_size=cfg.rollout.n_samples).reduce()
        metrics = {**step_metrics(totals, **summary), **done.timings, "ema/updated": float(ema_updated),
                   "time/generation": totals["rollout/generation_s"] / self.dist.world_size,
                   "time/retrieval": totals["rollout/retrieval_s"] / self.dist.world_size, "time/training": t_train,
                   "response/length_drift": self.length_drift(totals["rollout/response_tokens"] / totals["rollout/trajectories"])}
        self.last_samples = sample_records(sampled, cfg.logging.log_samples, tokenizer=self.tokenizer, advantages=step.advantages)
        finite = math.isfinite(metrics["loss/pg"]) and result.skipped == 0
        self.nonfinite_streak = 0 if finite else self.nonfinite_streak + 1
        metrics["actor/nonfinite_streak"] = float(self.nonfinite_streak)
        if self.entropy_control is not None:  # the coefficient this update used; then the next step's
            self.entropy_control.after_step(metrics)
        return metrics, totals

    def train_step(self) -> dict[str, float]:
        """One full step (produce, then consume); returns its metrics (already reduced over ranks)."""
        t_step = time.perf_counter()
        prompts = self.sample_prompts()
        sampled = self.sample_batch(prompts)
        while self.search_guard is not None and not self.search_guard.accept(sampled.trajectories):
            sampled = self.sample_batch(prompts)  # its searches failed: never trained on (the guard pauses or stops on an outage)
        for shape in self.shapers:  # guidance, then the informative filter
            sampled = shape(self, sampled)
        t_rollout = time.perf_counter() - t_step
        metrics, totals = self.learn(sampled)
        if self.search_guard is not None:
            metrics.update(self.search_guard.step_metrics())
        if self.probe is not None:
            metrics.update(self.probe(self))
        t_total = time.perf_counter() - t_step
        metrics.update({"time/rollout": t_rollout, "time/step": t_total,
                        "perf/tokens_per_s": totals["rollout/tokens"] / max(t_total, 1e-9), **peak_memory(self.dist.device)})
        return metrics

    @property
    def pad_id(self) -> int:
        return pad_id_of(self.tokenizer)

    # ------------------------------------------------------------------ the loop
    def train(self) -> list[dict[str, float]]:
        """Run to ``run.total_steps``; checkpoints and signals handled here. Returns the step metrics."""
        cfg = self.cfg
        history: list[dict[str, float]] = []
        step_fn = self.train_step
        if cfg.rollout.max_staleness and self.step < cfg.run.total_steps:
            from trainer.pipeline import RolloutPipeline  # s >= 1: generation overlaps the update

            pipeline = RolloutPipeline.start(self)
            self._on_close(pipeline.close)
            step_fn = pipeline.train_step
        t_loop, steps_here = time.perf_counter(), 0
        with stop_on_signals(self._on_signal):
            while self.step < cfg.run.total_steps:
                metrics = step_fn()
                steps_here += 1
                history.append(metrics)
                self.tracker.log(self.step, metrics)
                self.tracker.log_samples(self.step, self.last_samples)
                for hook in self.step_hooks:
                    hook(self, metrics)
                out_of_time = budget_spent(cfg.run.time_budget_s, time.perf_counter() - t_loop, steps_here)
                flags = D.all_reduce_max(torch.tensor([float(self.stop_signal is not None), float(out_of_time)]))
                by_signal, by_budget = bool(flags[0] > 0), bool(flags[1] > 0)  # one rank out of time stops them all
                stop = (by_signal or by_budget) and self.step < cfg.run.total_steps
                if stop or self.step == cfg.run.total_steps or (cfg.run.save_every and self.step % cfg.run.save_every == 0):
                    self.save()
                if stop:
                    why = "by signal" if by_signal else f"by the time budget (run.time_budget_s={cfg.run.time_budget_s:g})"
                    self.message(f"stopped {why} after step {self.step}; checkpoint saved to {self.run_dir}")
                    break
        if self.guard is not None:
            self.guard.finish(self)
        return history

    def save(self) -> Path:
        cfg = self.cfg
        return save_checkpoint(
            self.run_dir, self.step, tokenizer=self.tokenizer, **self.policy.checkpoint_state(is_main=self.dist.is_main),
            trainer_state={"data": self.sampler.state_dict(), "nonfinite_streak": self.nonfinite_streak,
                           **{key: c.state_dict() for key, c in self.stateful.items() if c is not None},
                           "anchor": self.policy.anchor_schedule(),
                           "provenance": refreshed(self.provenance, self.retriever) if self.dist.is_main else {}},
            config=cfg, keep_last=cfg.run.keep_last, rank=self.dist.rank, world_size=self.dist.world_size, barrier=D.barrier,
            files=record_files(self.trained_questions),
        )

    def _on_signal(self, signum: int) -> None:
        if self.stop_signal is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self.stop_signal = signum
        self.message(f"received {signal.Signals(signum).name}: finishing step {self.step + 1}, then saving")

    def _warn(self, text: str) -> None:
        self.message(f"[warn] step {self.step + 1}: {text}")

    def message(self, text: str) -> None:
        """One line for the user: into the tracker's console/log when it runs, else a warning (main rank only)."""
        if self.tracker is not None and self.tracker.enabled:
            self.tracker.message(text)
        elif getattr(self, "dist", None) is None or self.dist.is_main:
            log.warning(text)

    def close(self) -> None:
        """Release what :meth:`setup` started (tracker, engine, retriever client and server), last first."""
        self._resources.close()


def train(cfg: TrainConfig, *, resume: str | Path | None = None) -> list[dict[str, float]]:
    """Build a :class:`Trainer`, run it, and release everything it started."""
    trainer = Trainer(cfg, resume=resume)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.close()
