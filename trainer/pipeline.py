"""Staleness-bounded asynchronous rollouts (``rollout.max_staleness = s ≥ 1``).

A producer thread generates rollout batches on the remote generation servers
(``rollout.engine=remote``, one or more replicas) while the trainer's main thread updates on the
current batch. The schedule is fixed, not timing-dependent:

* batch k (the batch step k trains on) is generated with the weights after step
  v(k) = max(k₀, k − 1 − s), where k₀ is the step the run (or the resume) started from; its
  staleness when trained is k − 1 − v(k) ≤ s versions. The trainer requests batch k + s + 1 as soon as
  step k is done and its weights are published, so at most s + 1 batches are ahead of the update;
* weight sync happens between batches: the producer loads version v(k) before generating batch k
  (nothing is in flight then). With the http transport the upload itself is off that path: the trainer
  stages each version on the servers (:meth:`agent.engines.remote.RemoteEngine.stage_weights`) as soon as it
  publishes it, while the current batch generates, and the producer only commits it (one sync is transferred
  at a time, always the version the producer loads next; a version that was not staged, or whose commit fails, is
  uploaded by the producer as before). Requests in flight when the trainer publishes new weights finish on the
  old ones, so a batch has exactly one version, recorded on the batch and on each of its
  trajectories (:attr:`agent.rollout.Trajectory.weights_version`);
* a batch found older than s versions when its step comes (it cannot happen with this schedule, but
  the bound is checked, not assumed) is dropped, counted in ``async/dropped_batches`` and regenerated
  with the current weights on the same prompts.

**Retriever outages** (the search task): the producer applies :class:`trainer.search_health.SearchOutageGuard`
to each batch as soon as it is generated, before it is queued: a batch with too many failed searches is
never queued, it is generated again at once (same prompts, same weights version v(k), same seed, as the
synchronous loop does) and counted; the ``retriever.failure_patience``-th rejection in a row pauses the
producer until the retriever answers ``/health`` (up to ``retriever.wait``) and a retriever that does not
come back stops the run with the guard's error. The trainer keeps training on the batches already
accepted and waits, idle, for the one being regenerated, so no step ever trains on failed searches.
Why the producer side and not the consumer's: (1) the producer generates in step order, so a pause stops
generation itself and the batch after it is generated once the retriever is back; screened on the
consumer side, the up to s + 1 batches generated during an outage would all be rejected one after
another when their steps came, after the retriever had come back, and exhaust the patience (stopping a
run whose retriever recovered); (2) rank 0's producer holds the global batch, so the decision needs no
collective (a producer thread cannot join one) and every rank receives the same decision with the batch;
(3) regeneration starts as soon as a batch fails, not when the trainer reaches its step.

Because v(k) is fixed and each step's sampling seed is fixed (:func:`trainer.sampled_batch.step_seed`), a run
is deterministic for a given s. **Resume**: the queue is not checkpointed; a run resumed at step r
regenerates batches r + 1 … r + 1 + s from the checkpoint's weights (k₀ = r) and continues the
schedule, so two resumes of one checkpoint produce the same run; it is not bit-identical to the
uninterrupted run, whose batches r + 1 … r + s came from versions r − s … r − 1 that no checkpoint
holds. With s = 0 the loop is the synchronous one and resume is bit-exact.

**Stop** (SIGINT/SIGTERM): the main thread finishes the step it is in, checkpoints, and :meth:`close`
abandons the batches in flight or queued (never trained on, so nothing trained is lost; the queue is
regenerated on resume). A server dying mid-batch: :class:`agent.engines.remote.RemoteEngine` sends its
requests to the other replicas; a batch that still fails is regenerated (``run.rollout_retries``).

**torchrun**: rank 0 is the only producer: it samples the global batch of the step, generates it on the
shared servers and pushes every weight version to them; every rank is a consumer: rank 0 broadcasts
the scored batch and each rank trains on its share of the groups; every rank joins the weight export
(a collective under FSDP2), which rank 0 publishes.

Metrics per step: ``async/staleness`` and the cumulative histogram ``async/staleness_count_{i}``,
``async/queue_depth`` (batches ready when the step began), ``async/trainer_wait_s`` (the trainer idle,
waiting for its batch), ``async/producer_busy_s`` / ``async/producer_idle_s`` (since the previous
step; ``async/producer_load_s`` of the busy time loaded weights), ``async/trainer_stage_s`` (the trainer's
seconds uploading staged weights), ``async/dropped_batches`` (stale batches dropped, cumulative), ``async/search_dropped_batches``
(batches the outage guard rejected, cumulative) and ``async/weights_version``; with a retriever also
the synchronous loop's ``search/failure_rate`` (of the trained batch), ``search/rejected_batches`` and
``search/rejected_failures`` (the rejected generations of this step's batch).
"""

from __future__ import annotations

import collections
import copy
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trainer import distributed as D
from trainer.data import PromptSampler, SampledPrompt
from trainer.errors import TrainingError
from trainer.sampled_batch import SampledBatch, step_seed
from trainer.search_health import SearchOutageGuard

if TYPE_CHECKING:
    from agent.engines.base import Engine
    from trainer.config import TrainConfig
    from trainer.policy import Policy

__all__ = ["PipelineTrainer", "RolloutPipeline", "batch_version", "is_stale"]


class PipelineTrainer(Protocol):
    """What the pipeline uses of the run (:class:`trainer.loop.Trainer` is one): its settings and place, the
    prompt sampler it copies for the producer, and the produce / learn halves of a step."""

    cfg: TrainConfig
    step: int
    dist: D.DistInfo
    sampler: PromptSampler
    retriever: Any  # retriever.client.RetrieverClient, or None for a task without search
    engine: Engine
    policy: Policy

    def sample_prompts(self) -> list[SampledPrompt]: ...

    def produce(self, engine: Engine, prompts: list[SampledPrompt], seed: int) -> SampledBatch: ...

    def learn(self, sampled: SampledBatch) -> tuple[dict[str, float], dict[str, float]]: ...

    def message(self, text: str) -> None: ...


def batch_version(step: int, start_step: int, max_staleness: int) -> int:
    """v(k): the weights version batch ``step`` is generated with (0-based versions = steps done)."""
    return max(start_step, step - 1 - max_staleness)


def is_stale(step: int, version: int, max_staleness: int) -> bool:
    """A batch of weights ``version`` is too old for ``step`` (trained with the weights after step − 1)."""
    return step - 1 - version > max_staleness


@dataclass
class _Request:
    step: int
    version: int
    prompts: list[SampledPrompt]


@dataclass
class _Produced:
    step: int
    version: int
    prompts: list[SampledPrompt]
    batch: SampledBatch | None = None
    error: BaseException | None = None
    search: dict[str, float] = field(default_factory=dict)  # the outage guard's metrics of this batch


@dataclass
class _Clock:
    """Busy/idle seconds of the producer, read and reset by each step."""

    busy: float = 0.0
    idle: float = 0.0
    load: float = 0.0  # of busy: loading weights into the servers
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, busy: float = 0.0, idle: float = 0.0, load: float = 0.0) -> None:
        with self.lock:
            self.busy += busy
            self.idle += idle
            self.load += load

    def take(self) -> tuple[float, float, float]:
        with self.lock:
            out, self.busy, self.idle, self.load = (self.busy, self.idle, self.load), 0.0, 0.0, 0.0
        return out


class RolloutPipeline:
    """The producer thread (rank 0) and the consumer step (every rank) of an asynchronous run."""

    def __init__(self, trainer: PipelineTrainer) -> None:
        self.trainer = trainer
        self.s = trainer.cfg.rollout.max_staleness
        self.start_step = trainer.step
        self.total = trainer.cfg.run.total_steps
        self.producer_rank = trainer.dist.is_main
        self.dropped = 0
        self.search_dropped = 0  # batches the outage guard rejected (regenerated by the producer)
        self.staleness_counts = [0] * (self.s + 1)
        self.clock = _Clock()
        self._cond = threading.Condition()
        self._requests: collections.deque[_Request] = collections.deque()
        self._results: dict[int, _Produced] = {}
        self._weights: dict[int, dict[str, torch.Tensor]] = {}
        self._engine_version: int | None = None  # what the servers hold (they start on weights of their own)
        # Staged sync (the http transport): the trainer uploads each new version while the producer generates, and
        # the producer only commits it between batches. One sync is transferred at a time (a server keeps one
        # staged sync; a new one discards it): ``_uploading`` is held by whichever thread transfers.
        self._staging_on = bool(trainer.cfg.rollout.stage_weights and getattr(trainer.engine, "weight_sync", None) == "http"
                                and hasattr(trainer.engine, "stage_weights"))
        self._staged: dict[int, Any] = {}  # version -> agent.engines.remote.StagedWeights
        self._uploading = False
        self._stage_s = 0.0  # the trainer's seconds staging since the previous step
        self._stop = False
        self._thread: threading.Thread | None = None
        # The producer samples ahead with its own copy; the trainer's sampler advances as steps are trained,
        # so a checkpoint holds the data position of the last trained step.
        self._sampler = copy.deepcopy(trainer.sampler)
        # The producer screens each batch for failed searches before queueing it (see the module doc):
        # rank 0 holds the global batch, so the guard decides alone.
        self.search_guard = (SearchOutageGuard(trainer.retriever, trainer.cfg.retriever, warn=self._warn_producing, collective=False)
                             if trainer.retriever is not None and self.producer_rank else None)
        self._producing = 0  # the step of the batch the producer is generating (its warnings name it)

    @classmethod
    def start(cls, trainer: PipelineTrainer) -> "RolloutPipeline":
        """Publish the starting weights and request the first s + 1 batches."""
        pipe = cls(trainer)
        pipe._publish(trainer.step)
        if pipe.producer_rank:
            pipe._thread = threading.Thread(target=pipe._produce_loop, name="emapg-rollout-producer", daemon=True)
            pipe._thread.start()
            for k in range(trainer.step + 1, min(trainer.step + 1 + pipe.s, pipe.total) + 1):
                pipe._request(k)
        return pipe

    # ------------------------------------------------------------------ the producer (rank 0)
    def _request(self, step: int, prompts: list[SampledPrompt] | None = None, version: int | None = None) -> None:
        if prompts is None:
            prompts = self._sampler.next(self.trainer.cfg.data.prompts_per_step, step)
        v = batch_version(step, self.start_step, self.s) if version is None else version
        with self._cond:
            self._requests.append(_Request(step, v, prompts))
            self._cond.notify_all()

    def _produce_loop(self) -> None:
        trainer = self.trainer
        engine = trainer.engine
        while True:
            t0 = time.perf_counter()
            with self._cond:
                while not self._requests and not self._stop:
                    self._cond.wait(0.5)
                if self._stop:
                    return
                req = self._requests.popleft()
                state = self._weights.get(req.version)
            self.clock.add(idle=time.perf_counter() - t0)
            t0 = time.perf_counter()
            item = _Produced(req.step, req.version, req.prompts)
            self._producing = req.step
            try:
                if self._engine_version != req.version:
                    if state is None:
                        raise RuntimeError(f"weights version {req.version} was never published")
                    t_load = time.perf_counter()
                    self._load_version(engine, req.version, state)  # sets _engine_version
                    self.clock.add(load=time.perf_counter() - t_load)
                    self._forget_weights_before(req.version)
                # the global batch's seed is rank 0's: one producer generates every rank's share
                seed = _seed(trainer, req.step)
                sampled = trainer.produce(engine, req.prompts, seed)
                while self.search_guard is not None and not self._stop and not self.search_guard.accept(sampled.trajectories):
                    self.search_dropped += 1  # its searches failed: never queued; the guard pauses or stops on an outage
                    sampled = trainer.produce(engine, req.prompts, seed)
                if self.search_guard is not None:
                    item.search = {**self.search_guard.step_metrics(), "async/search_dropped_batches": float(self.search_dropped)}
                for t in sampled.trajectories:
                    t.weights_version = req.version
                item.batch = sampled
            except BaseException as e:  # handed to the consumer, which stops the run with it
                item.error = e
            self.clock.add(busy=time.perf_counter() - t0)
            with self._cond:
                self._results[req.step] = item
                self._cond.notify_all()

    def _load_version(self, engine: Engine, version: int, state: dict[str, torch.Tensor]) -> None:
        """Load weights ``version`` into the servers (nothing in flight): commit its staged upload if the trainer
        staged it, else (or if the commit fails) upload and load it now."""
        with self._cond:
            while self._uploading:
                self._cond.wait(0.5)
            staged = self._staged.pop(version, None)
            older = [self._staged.pop(v) for v in sorted(self._staged) if v < version]
            self._uploading = True
        loaded = False
        try:
            for o in older:
                engine.discard_weights(o)
            if staged is not None:
                try:
                    engine.commit_weights(staged)
                    loaded = True
                except Exception as e:  # e.g. a replica restarted and lost it: the whole upload, now
                    self._warn_producing(f"staged weights {version} did not load ({type(e).__name__}: {e}); uploading them again")
            if not loaded:
                engine.load_weights(state, tag=f"step-{version}")
                loaded = True
        finally:
            with self._cond:
                if loaded:
                    self._engine_version = version
                self._uploading = False
                self._cond.notify_all()

    def _stage_next(self) -> None:
        """Upload, without loading, the version the producer loads next (the one after what the servers hold, once
        published), while generation goes on; skipped while another sync is transferred or waits to be loaded (a
        server keeps one staged sync), so a staged sync is never replaced before its commit. The trainer's thread,
        when it publishes (the producer never uploads ahead: its time is the step's)."""
        if not self._staging_on:
            return
        with self._cond:
            if self._uploading or self._staged or self._stop:
                return
            version = (self._engine_version + 1) if self._engine_version is not None else min(self._weights, default=None)
            state = self._weights.get(version) if version is not None else None
            if state is None:
                return
            self._uploading = True
        t0 = time.perf_counter()
        staged = None
        try:
            staged = self.trainer.engine.stage_weights(state, tag=f"step-{version}")
        except Exception as e:  # the producer uploads it at load time instead
            self.trainer.message(f"[warn] staging weights {version} failed ({type(e).__name__}: {e}); the producer uploads them")
        finally:
            with self._cond:
                if staged is not None:
                    self._staged[version] = staged
                self._uploading = False
                self._cond.notify_all()
            self._stage_s += time.perf_counter() - t0

    def _warn_producing(self, text: str) -> None:
        self.trainer.message(f"[warn] producer, batch {self._producing}: {text}")

    def _forget_weights_before(self, version: int) -> None:
        with self._cond:
            for v in [v for v in self._weights if v < version]:
                del self._weights[v]

    def _publish(self, version: int) -> None:
        """Every rank joins the export (FSDP2: a collective); rank 0 keeps a CPU copy for the producer."""
        state = self.trainer.policy.export_weights(all_ranks=False)
        if self.producer_rank:
            copy_ = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
            with self._cond:
                self._weights[version] = copy_
                self._cond.notify_all()
            self._stage_next()

    # ------------------------------------------------------------------ the consumer (every rank)
    def _wait(self, step: int) -> tuple[_Produced, int]:
        with self._cond:
            depth = sum(1 for k in self._results if k >= step)
            while step not in self._results:
                if self._thread is not None and not self._thread.is_alive():
                    raise RuntimeError("the rollout producer thread stopped")
                self._cond.wait(0.5)
            return self._results.pop(step), depth

    def _next_batch(self, step: int) -> tuple[SampledBatch, int, int, float, dict[str, float]]:
        """Rank 0: the batch of ``step`` (regenerated while too stale); every rank: its share. Returns
        (the sampled batch, version, queue depth, seconds waited, the outage guard's metrics)."""
        t0 = time.perf_counter()
        payload = None
        if self.producer_rank:
            while True:
                item, depth = self._wait(step)
                if item.error is not None:
                    payload = ("error", f"{type(item.error).__name__}: {item.error}")
                    break
                if not is_stale(step, item.version, self.s):
                    payload = ("ok", item.batch, item.version, depth, item.search)
                    break
                self.dropped += 1  # too old to train on: the same prompts again, with the newest published weights
                with self._cond:
                    newest = max(self._weights)
                self._request(step, item.prompts, version=newest)
        payload = D.broadcast_object(payload)
        waited = time.perf_counter() - t0
        if payload[0] == "error":
            raise TrainingError(f"the rollout producer failed on step {step}: {payload[1]}")
        _, sampled, version, depth, search = payload
        return _share(sampled, self.trainer), version, depth, waited, search

    def train_step(self) -> dict[str, float]:
        """One step of an asynchronous run: wait for this step's batch, train on it, publish the new weights,
        request the batch s + 1 steps ahead. Returns the step's metrics (:meth:`Trainer.train_step`'s, plus ``async/*``)."""
        trainer = self.trainer
        t_step = time.perf_counter()
        step = trainer.step + 1
        sampled, version, depth, waited, search = self._next_batch(step)
        prompts = trainer.sample_prompts()  # advances the checkpointed sampler: the same prompts the producer drew
        if [p.group_id for p in prompts] != [p.group_id for p in sampled.prompts]:
            raise RuntimeError(f"step {step}: the producer's prompts are not the step's ({sampled.prompts[0].group_id} ...)")
        metrics, totals = trainer.learn(sampled)
        if trainer.step + 1 + self.s <= self.total:  # these weights generate batch step + 1 + s
            self._publish(trainer.step)
            if self.producer_rank:
                self._request(trainer.step + 1 + self.s)
        staleness = step - 1 - version
        self.staleness_counts[staleness] += 1
        busy, idle, load = self.clock.take()
        stage_s, self._stage_s = self._stage_s, 0.0
        t_total = time.perf_counter() - t_step
        metrics.update({
            "time/rollout": waited, "time/step": t_total, "perf/tokens_per_s": totals["rollout/tokens"] / max(t_total, 1e-9),
            "async/staleness": float(staleness), "async/weights_version": float(version), "async/queue_depth": float(depth),
            "async/trainer_wait_s": waited, "async/producer_busy_s": busy, "async/producer_idle_s": idle,
            "async/producer_load_s": load, "async/trainer_stage_s": stage_s,
            "async/dropped_batches": float(self.dropped), **search,
            **{f"async/staleness_count_{i}": float(c) for i, c in enumerate(self.staleness_counts)},
        })  # fmt: skip
        return metrics

    def close(self) -> None:
        """Stop the producer; a generation in flight is abandoned (its batch was never trained on)."""
        with self._cond:
            self._stop = True
            self._requests.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        with self._cond:
            staged, self._staged = list(self._staged.values()), {}
        for st in staged:  # uploaded, never loaded: free the servers' copies
            try:
                self.trainer.engine.discard_weights(st)
            except Exception:
                pass


def _seed(trainer: PipelineTrainer, step: int) -> int:
    return step_seed(trainer.cfg.run.seed, step, 0)


def _share(sampled: SampledBatch, trainer: PipelineTrainer) -> SampledBatch:
    """This rank's groups of the global batch ``sampled``; the reward counts stay on rank 0 (they are summed over
    ranks), the batch's wall times go to every rank (they are averaged over ranks)."""
    world = trainer.dist.world_size
    if world == 1:
        return sampled
    n = trainer.cfg.rollout.n_samples
    groups = D.shard_slice(len(sampled.prompts), trainer.dist.rank, world)
    rows = slice(groups.start * n, groups.stop * n)
    first = trainer.dist.rank == 0
    return replace(sampled.take(range(rows.start, rows.stop), range(groups.start, groups.stop)),
                   reward_counts={k: (v if first else 0.0) for k, v in sampled.reward_counts.items()})
