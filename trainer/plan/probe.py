"""``emapg plan --probe``: measure real steps at the configured shapes, refit the rates, plan the run with them.

What runs is the trainer's own code on this machine, in this process: ``Trainer.setup`` (policy, optimizer, anchor,
teacher, a colocated engine), then per step a rollout phase (the engine generates ``rows`` sequences of the
configured prompt length for the response budget, ``ignore_eos``) after the weight sync of the step before
(``EngineSession.generating`` pushes the changed weights, as in a run), and the update phase: ``Trainer.learn`` itself
(the step's passes -- stored statistics, the teacher's, ``kl/to_start``'s --, the PPO update, the EMA blend) on a
synthetic graded batch of trajectories at the token budgets (every other response one token short: padded
micro-batches at the full width) in groups of ``rollout.n_samples`` -- the planner's worst case, so
measured and predicted describe the same shapes. The retriever is not needed: a search
config is probed as the math task (the update's shapes do not depend on it).

Measured peak memory: on a GPU, ``torch.cuda.max_memory_allocated()`` over setup and steps minus what was allocated
before; on a CPU, the peak of live tensor bytes over setup and the first two steps from the torch profiler's
allocation records (``profile_memory=True``: every allocation and free of torch's CPU allocator, summed in the order
they happened: :func:`live_peak`) -- the CPU counterpart of the CUDA allocator's figure; the process's RSS growth (VmHWM minus the RSS before setup) is
reported beside it. Times: four steps; the first two are profiled on a CPU (memory), the third is the probe the rates
are refitted from, the fourth is the measurement ``benchmarks/plan_accuracy.py`` compares against.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from trainer.config import TrainConfig
from trainer.plan.catalogue import Device, get_device, local_device
from trainer.plan.planner import Plan, plan_run
from trainer.plan.timing import Rates

#: Steps a probe runs: on a CPU the first two under the memory profiler (a warm-up, then a step with the optimizer's
#: states), then the probe the rates are refitted from and the measured one, both unprofiled (the profiler slows a
#: step by 10-45%: measured on the tiny configs of benchmarks/plan_accuracy.py).
PROBE_STEPS = 4
PROFILED_STEPS = 2
PEAK_DEFINITION_CPU = "peak live torch tensor bytes over setup and two steps (torch profiler allocation events)"
PEAK_DEFINITION_CUDA = "torch.cuda.max_memory_allocated over setup and steps, minus the bytes allocated before"


@dataclass
class StepTimes:
    rollout: float | None
    update: float
    sync: float | None


@dataclass
class Measurement:
    peak_bytes: int
    peak_definition: str
    rss_growth_bytes: int
    steps: list[StepTimes]
    peak_phase: str | None = None  # on a CPU: the probe phase the peak happened in


def _vm(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes (0 where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class _TensorPeak:
    """Peak of live tensor bytes: the CUDA allocator's own counter, or the profiler's CPU allocation events."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.prof, self.base = cuda, None, 0

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()

    def stop(self) -> tuple[int, str | None]:
        """(peak bytes, the probe phase it happened in: setup, rollout, update or sync; None on a GPU)."""
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base, None
        self.prof.__exit__(None, None, None)
        peak, at, phases = live_peak(self.prof, PHASE)
        self.prof = None
        at_phase = next((name for start, end, name in phases if start <= at <= end), "setup")
        gc.collect()  # the profiler's objects, now, not in the next (timed) step's garbage collections
        return peak, at_phase


def live_peak(prof: Any, marker: str = "") -> tuple[int, int, list[tuple[int, int, str]]]:
    """(peak bytes above the start, its time in ns, the ``marker``-prefixed ranges as (start, end, name without the
    prefix)) from a finished ``profile(profile_memory=True)``: the CPU allocator's allocation and free records summed
    in time order.

    Not ``prof.events()``' ``self_cpu_memory_usage`` summed in each op's start order: that is an op's net bytes placed
    at its start, so a composite op that frees what its children allocated (an autograd Function's backward releasing
    its chunk buffers, the engine's node releasing saved tensors) moves its frees before the children's allocations
    and hides the moment they were all live (on tiny-qwen2's one-pass update the fused lm_head's forward: three
    (chunk, V) buffers at once over the saved activations)."""
    from torch.autograd import DeviceType

    records: list[tuple[int, int]] = []
    ranges: list[tuple[int, int, str]] = []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name == "[memory]":
            if e.device_type() == DeviceType.CPU:
                records.append((e.start_ns(), e.nbytes()))
        elif marker and name.startswith(marker):
            ranges.append((e.start_ns(), e.start_ns() + e.duration_ns(), name.removeprefix(marker)))
    records.sort()
    live = peak = at = 0
    for t, nbytes in records:
        live += nbytes
        if live > peak:
            peak, at = live, t
    return peak, at, ranges


PHASE = "emapg_plan::"


def _phase(name: str) -> Any:
    """A profiler range naming the probe phase (where the CPU peak happened)."""
    return torch.profiler.record_function(PHASE + name)


def probe_config(cfg: TrainConfig, workdir: str) -> TrainConfig:
    """The config the probe runs: the same shapes, no retriever, no checkpoints, logs or progress."""
    c = copy.deepcopy(cfg)
    if c.rollout.task == "search":
        c.rollout.task = "math"
    c.run.output_dir = workdir
    c.run.save_every = 0
    c.logging.tensorboard = c.logging.wandb = c.logging.progress = False
    c.logging.log_samples = 0
    c.guard.enabled = False
    return c


def synthetic_sampled(cfg: TrainConfig, rows: int, vocab: int, examples: list[Any], seed: int = 0) -> Any:
    """A :class:`~trainer.sampled_batch.SampledBatch` of ``rows`` graded trajectories at the token budgets, in groups
    of ``n_samples`` sharing a prompt (every response token sampled and trained; rewards 0 or 1): what the engine and
    the grader hand ``Trainer.learn`` in a run, at the planner's worst-case shapes. Every other row's response stops
    one token short, so each micro-batch of two or more consecutive rows is a padded one at the full width -- as in a
    run, where responses end at different lengths: its attention mask is materialised (and on a CPU saved by the
    attention kernel, with the keys and values repeated to every query head), which a batch of rows that all fill the
    budget does not need (tiny-qwen2, 8 rows x 256 tokens: 74.1 MiB saved without padding, 82.1 MiB with one padded
    row; the planner counts the padded batch)."""
    from agent.rollout import RolloutStats, Trajectory
    from tasks.task import Outcome
    from trainer.data import SampledPrompt
    from trainer.sampled_batch import SampledBatch

    g = torch.Generator().manual_seed(seed)
    r = cfg.rollout
    n = r.n_samples
    prompts = [SampledPrompt(examples[i % len(examples)], f"probe-{i}") for i in range(max(1, rows // n))]
    logp = -math.log(vocab)  # the engine's sampling log-prob of a token of a uniform distribution
    trajectories = []
    for i in range(len(prompts) * n):
        if i % n == 0:
            prompt_ids = torch.randint(10, vocab, (r.max_prompt_tokens,), generator=g).tolist()
        length = r.max_response_tokens - (i % 2 if r.max_response_tokens > 1 else 0)
        trajectories.append(Trajectory(
            uid=f"probe-{i}", group_id=prompts[i // n].group_id, prompt_index=i // n, sample_index=i % n, question="",
            example_id=None, prompt_ids=prompt_ids, response_ids=torch.randint(10, vocab, (length,), generator=g).tolist(),
            loss_mask=[1] * length, sampling_logprobs=[logp] * length,
            stop_reason="length" if length == r.max_response_tokens else "stop"))
    rewards = torch.randint(0, 2, (len(trajectories),), generator=g).tolist()
    return SampledBatch(prompts, trajectories, [Outcome(float(x)) for x in rewards], {}, RolloutStats())


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _rollout(trainer: Any, cfg: TrainConfig, rows: int, cuda: bool) -> tuple[float, float]:
    """(sync seconds, rollout seconds): the engine session pushes the changed weights (wakes a sleeping vLLM), then
    generates ``rows`` sequences at the configured prompt length for the generated-token budget."""
    from agent.engines.base import SamplingParams
    from trainer.plan.memory import generated_tokens

    vocab = trainer.model.config.vocab_size
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(10, vocab, (cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens
                                         - generated_tokens(cfg),), generator=g).tolist() for _ in range(rows)]
    params = SamplingParams(temperature=cfg.rollout.temperature, max_tokens=generated_tokens(cfg), seed=0, ignore_eos=True)
    _sync(cuda)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as session:
        with _phase("sync"):  # entering pushes the changed weights
            engine = session.enter_context(trainer.engine_session.generating("probe"))
            _sync(cuda)
        t1 = time.perf_counter()
        with _phase("rollout"):
            engine.generate(prompts, params)
            _sync(cuda)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def _learn(trainer: Any, sampled: Any, cuda: bool) -> float:
    """The update phase: ``Trainer.learn`` on ``sampled`` (the step's rows as tensors, its passes -- stored statistics,
    the teacher's and ``kl/to_start``'s --, the PPO update, the EMA blend, the step's metrics), timed."""
    _sync(cuda)
    t0 = time.perf_counter()
    trainer.learn(sampled)
    _sync(cuda)
    return time.perf_counter() - t0


@contextlib.contextmanager
def _trainer(cfg: TrainConfig, with_engine: bool) -> Iterator[Any]:
    from trainer.loop import Trainer

    trainer = Trainer(cfg)
    try:
        yield trainer.setup(with_engine=with_engine)
    finally:
        trainer.close()


def measure(cfg: TrainConfig, *, steps: int = PROBE_STEPS) -> Measurement:
    """Run ``steps`` real steps of ``cfg`` (see the module docstring) and measure them."""
    cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    colocated = cfg.rollout.engine != "remote"
    with tempfile.TemporaryDirectory(prefix="emapg-probe-") as tmp:
        c = probe_config(cfg, tmp)
        rss_before = _vm("VmRSS")
        peak = _TensorPeak(cuda)
        peak.start()
        stopped = False
        times: list[StepTimes] = []
        try:
            with _trainer(c, colocated) as trainer:
                world = trainer.dist.world_size
                rows = max(1, c.data.prompts_per_step * c.rollout.n_samples // world)
                sampled = synthetic_sampled(c, rows, trainer.model.config.vocab_size, trainer.sampler.examples)
                for step in range(1, steps + 1):
                    if step == PROFILED_STEPS + 1 and not cuda:  # the rest run unprofiled: the timings
                        (peak_bytes, peak_phase), stopped = peak.stop(), True
                    sync, rollout = _rollout(trainer, c, rows, cuda) if colocated else (None, None)
                    with _phase("update"):
                        update = _learn(trainer, sampled, cuda)  # marks the weights changed: the next rollout pushes them
                    times.append(StepTimes(rollout, update, None if step == 1 else sync))
        finally:
            if not stopped:
                peak_bytes, peak_phase = peak.stop()
        return Measurement(peak_bytes=peak_bytes, peak_definition=PEAK_DEFINITION_CUDA if cuda else PEAK_DEFINITION_CPU,
                           rss_growth_bytes=max(0, _vm("VmHWM") - rss_before), steps=times, peak_phase=peak_phase)


def refit(plan: Plan, measured: StepTimes) -> Rates:
    """Rates under which ``plan``'s phases take the ``measured`` seconds (a phase not measured keeps its rates): the
    update's FLOP rate, and the rollout's rates and fixed decode latencies (per step, per layer) scaled together (the rollout's seconds
    are their sum: scaling only the rates would leave the assumed latencies in the refitted time)."""
    r, s = plan.rates, plan.step_seconds
    update = r.update_flops * s["update"] / measured.update if measured.update > 0 else r.update_flops
    factor = s["rollout"] / measured.rollout if measured.rollout and s["rollout"] > 0 else 1.0
    return Rates(update_flops=update, prefill_flops=r.prefill_flops * factor, decode_bandwidth=r.decode_bandwidth * factor,
                 decode_step_latency=r.decode_step_latency / factor, decode_layer_latency=r.decode_layer_latency / factor,
                 decode_flops=r.decode_compute_flops * factor)


def probe_device(cfg: TrainConfig) -> Device:
    cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    if cuda:
        return local_device()
    return get_device("cpu")


def probe_plan(cfg: TrainConfig, *, price: float | None = None, available: int | None = None,
               progress: bool = True) -> Plan:
    """Measure (:func:`measure`), refit the rates from the probe step, and plan ``cfg`` on this machine with them.

    The plan's ``probe`` holds the measurement, the unprobed prediction and the errors of both predictions
    against the last (measured, unprofiled) step.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars: noise beside the plan
    device = probe_device(cfg)
    before = plan_run(cfg, device, price=price, available=available)
    if progress:
        print(f"probing {PROBE_STEPS} steps of {cfg.model.policy} on {device.name}...", flush=True)
    m = measure(cfg)
    probe_step, last = m.steps[-2] if len(m.steps) > 1 else m.steps[0], m.steps[-1]
    plan = plan_run(cfg, device, rates=refit(before, probe_step), price=price, available=available)
    plan.rates_source = "refitted from a probe step on this machine (emapg plan --probe)"

    def err(pred: float, meas: float | None) -> float | None:
        return None if not meas else (pred - meas) / meas

    measured = {"rollout": last.rollout, "update": last.update, "sync": last.sync}
    plan.probe = {
        "measured_peak_bytes": m.peak_bytes,
        "peak_definition": m.peak_definition,
        "measured_peak_phase": m.peak_phase,
        "rss_growth_bytes": m.rss_growth_bytes,
        "measured_step_seconds": measured,
        "steps": [vars(s) for s in m.steps],
        "unprobed": {"memory_bytes": before.memory_bytes, "step_seconds": before.step_seconds},
        "memory_error": err(before.peak_bytes, m.peak_bytes),
        "step_error_unprobed": {k: err(before.step_seconds[k], v) for k, v in measured.items()},
        "step_error_probed": {k: err(plan.step_seconds[k], v) for k, v in measured.items()},
    }
    return plan
