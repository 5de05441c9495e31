"""The run plan: memory by component, seconds by phase, the whole run's hours and cost, what fits, what to turn.

:func:`plan_run` is the one entry: a validated ``TrainConfig``, a catalogue device, the number of devices per node
and of nodes. No weights load and torch is not imported by this module (the config's validation already imports
it); a 3B preset is planned in milliseconds. :meth:`Plan.to_json` is the contract of ``emapg plan --json``:
``memory_bytes`` (component -> bytes in the peak phase, plus ``total``), ``step_seconds`` (``rollout``, ``update``,
``sync``, ``total``), ``fits`` and ``device``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

from trainer.config import TrainConfig
from trainer.plan.catalogue import Device, ModelShape, model_shape
from trainer.plan.memory import Layout, layout, memory_phases
from trainer.plan.timing import Rates, rollout_seconds, sync_seconds, update_seconds

GIB = 2**30


@dataclass
class Plan:
    device: Device
    devices: int
    nodes: int
    shape: ModelShape
    layout: Layout
    phases: dict[str, dict[str, int]]
    step_seconds: dict[str, float]
    rates: Rates
    total_steps: int
    price_per_hour: float
    available_bytes: int
    rates_source: str = "assumed (trainer/plan/devices.yaml)"
    largest: dict[str, int | None] = field(default_factory=dict)
    knob: str | None = None
    probe: dict[str, Any] | None = None

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(self.phases[p].values()))

    @property
    def peak_bytes(self) -> int:
        return sum(self.phases[self.peak_phase].values())

    def memory_phase_text(self) -> str:
        return f"{self.peak_phase} phase (the peak of rollout / stats / update)"

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.available_bytes

    @property
    def memory_bytes(self) -> dict[str, int]:
        comps = {k: v for k, v in self.phases[self.peak_phase].items()}
        return {**comps, "total": sum(comps.values())}

    @property
    def run_hours(self) -> float:
        return self.step_seconds["total"] * self.total_steps / 3600

    @property
    def cost(self) -> float:
        return self.run_hours * self.devices * self.nodes * self.price_per_hour

    def largest_component(self) -> tuple[str, int]:
        comps = self.phases[self.peak_phase]
        name = max(comps, key=comps.__getitem__)
        return name, comps[name]

    def refusal(self) -> str:
        """One line: the component, predicted against available bytes, and the override to try."""
        name, size = self.largest_component()
        try_ = f"; try {self.knob}" if self.knob else "; no single override fits it: more devices (--devices) or a smaller model"
        return (f"the plan does not fit {self.device.name}: predicted peak {self.peak_bytes / GIB:.2f} GiB > "
                f"{self.available_bytes / GIB:.2f} GiB available ({self.peak_bytes:,} > {self.available_bytes:,} bytes, "
                f"{self.peak_phase} phase; largest component {name} {size / GIB:.2f} GiB){try_} "
                f"(or --no-plan to skip this check)")

    def to_json(self) -> dict[str, Any]:
        d = self.device
        return {
            "device": {"key": d.key, "name": d.name, "memory_bytes": d.memory_bytes, "available_bytes": self.available_bytes,
                       "devices_per_node": self.devices, "nodes": self.nodes, "peak_flops": d.bf16_flops,
                       "memory_bandwidth": d.memory_bandwidth, "update_fraction": d.update_fraction,
                       "prefill_fraction": d.prefill_fraction, "decode_fraction": d.decode_fraction,
                       "fragmentation": d.fragmentation, "sources": d.sources},
            "model": {"params": self.shape.params, "hidden_size": self.shape.hidden_size,
                      "num_hidden_layers": self.shape.num_hidden_layers, "vocab_size": self.shape.vocab_size,
                      "source": self.shape.source},
            "layout": {"rows_per_device": self.layout.rows, "micro_batch_rows": self.layout.micro_rows,
                       "micro_batches_per_mini_batch": self.layout.micro_batches_per_mini,
                       "mini_batches": self.layout.mini_batches, "sequence_tokens": self.layout.seq_tokens,
                       "fsdp_shards": self.layout.shard},
            "memory_bytes": self.memory_bytes,
            "memory_phase": self.peak_phase,
            "memory_phases": {p: {**c, "total": sum(c.values())} for p, c in self.phases.items()},
            "step_seconds": dict(self.step_seconds),
            "rates": {"update_flops": self.rates.update_flops, "prefill_flops": self.rates.prefill_flops,
                      "decode_bandwidth": self.rates.decode_bandwidth,
                      "decode_step_latency": self.rates.decode_step_latency,
                      "decode_layer_latency": self.rates.decode_layer_latency,
                      "decode_flops": self.rates.decode_compute_flops, "source": self.rates_source},
            "run": {"total_steps": self.total_steps, "hours": self.run_hours, "price_per_device_hour": self.price_per_hour,
                    "cost": self.cost, "device_hours": self.run_hours * self.devices * self.nodes},
            "fits": self.fits,
            "largest_fitting": dict(self.largest),
            "knob": self.knob,
            "probe": self.probe,
            "assumptions": ASSUMPTIONS,
        }


ASSUMPTIONS = [
    "every prompt and response at its token budget (rollout.max_prompt_tokens, rollout.max_response_tokens): a worst case",
    "achievable fractions of peak from trainer/plan/devices.yaml unless --probe measured them",
    "fp32 master weights, gradients and AdamW states; bf16 activations on a GPU, fp32 on a CPU",
    "weights sync to the engine after every step; the run's hours count steps only (no start-up, checkpoints or evaluation)",
]


def _teacher_shape(cfg: TrainConfig) -> ModelShape | None:
    d = cfg.algorithm.distill
    return model_shape(d.teacher, option="algorithm.distill.teacher") if d.enabled and d.teacher else None


def estimate(cfg: TrainConfig, device: Device, *, devices: int = 1, nodes: int = 1, rates: Rates | None = None,
             price: float | None = None, shape: ModelShape | None = None, teacher: ModelShape | None = None,
             available: int | None = None) -> Plan:
    """Memory and time of ``cfg`` on ``devices`` x ``nodes`` of ``device`` (no search for what fits)."""
    shape = shape or model_shape(cfg.model.policy)
    teacher = teacher if teacher is not None else _teacher_shape(cfg)
    lay = layout(cfg, devices * nodes, nodes)
    rates = rates or Rates.assumed(device)
    step = {
        "rollout": rollout_seconds(cfg, shape, lay, device, rates),
        "update": update_seconds(cfg, shape, lay, device, rates, teacher),
        "sync": sync_seconds(cfg, shape, device),
    }
    step["total"] = sum(step.values())
    return Plan(device=device, devices=devices, nodes=nodes, shape=shape, layout=lay,
                phases=memory_phases(cfg, shape, lay, device, teacher), step_seconds=step, rates=rates,
                total_steps=cfg.run.total_steps, price_per_hour=device.price_per_hour if price is None else price,
                available_bytes=device.usable_bytes if available is None else available)


def plan_run(cfg: TrainConfig, device: Device, *, devices: int = 1, nodes: int = 1, rates: Rates | None = None,
             price: float | None = None, available: int | None = None, search: bool = True) -> Plan:
    """:func:`estimate`, plus the largest micro-batch, rollout batch and context that fit and, when the plan does
    not fit, the first override (in the order of :data:`KNOBS`) that makes it fit."""
    shape = model_shape(cfg.model.policy)
    teacher = _teacher_shape(cfg)

    def run(c: TrainConfig) -> Plan:
        return estimate(c, device, devices=devices, nodes=nodes, rates=rates, price=price, shape=shape, teacher=teacher,
                        available=available)

    plan = run(cfg)
    if search:
        plan.largest = largest_fitting(cfg, run)
        if not plan.fits:
            plan.knob = first_knob(cfg, plan, run)
    return plan


def _with(cfg: TrainConfig, **changes: Any) -> TrainConfig:
    """A copy of ``cfg`` with dotted-key changes (``algorithm.micro_batch_size=2`` as ``algorithm__micro_batch_size``)."""
    out = copy.deepcopy(cfg)
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        obj = out
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, value)
    return out


def _largest(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    """The largest v in [lo, hi] with fits(v) (fits monotone: true up to some value)."""
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def largest_fitting(cfg: TrainConfig, run: Callable[[TrainConfig], Plan]) -> dict[str, int | None]:
    """The largest ``algorithm.micro_batch_size``, ``data.prompts_per_step`` and ``rollout.max_response_tokens``
    that fit, each with the rest of the config unchanged (None: not even the smallest)."""
    alg, r = cfg.algorithm, cfg.rollout
    world = run(cfg).layout.world
    mini_rows = max(1, alg.mini_batch_size // world)

    def micro_fits(v: int) -> bool:
        return run(_with(cfg, algorithm__micro_batch_size=v, algorithm__micro_batch_tokens=0)).fits

    def prompts_fit(v: int) -> bool:
        rows = v * world * r.n_samples
        return run(_with(cfg, data__prompts_per_step=v * world, algorithm__mini_batch_size=min(alg.mini_batch_size, rows),
                         algorithm__micro_batch_size=min(alg.micro_batch_size, rows))).fits

    def context_fits(v: int) -> bool:
        return run(_with(cfg, rollout__max_response_tokens=v,
                         rollout__max_tokens_per_turn=min(r.max_tokens_per_turn, v))).fits

    per_rank = _largest(1, 1 << 16, prompts_fit)
    return {
        "micro_batch_size": _largest(1, mini_rows, micro_fits),
        "prompts_per_step": None if per_rank is None else per_rank * world,
        "max_response_tokens": _largest(1, 1 << 20, context_fits),
    }


#: Overrides tried, in this order, when a plan does not fit: those that change no result first
#: (checkpointing, offload, smaller micro-batches, chunking), then the ones that change the run.
def _knobs(cfg: TrainConfig, plan: Plan) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    if not cfg.model.gradient_checkpointing:
        out.append(("model.gradient_checkpointing=true", {"model__gradient_checkpointing": True}))
    if cfg.rollout.engine == "vllm" and not cfg.rollout.vllm_sleep:
        out.append(("rollout.vllm_sleep=true", {"rollout__vllm_sleep": True}))
    if plan.phases[plan.peak_phase].get("anchor") and not cfg.algorithm.ema.offload and not plan.device.is_cpu:
        out.append(("algorithm.ema.offload=true", {"algorithm__ema__offload": True}))
    micro = plan.largest.get("micro_batch_size")
    if micro and micro < plan.layout.micro_rows:
        out.append((f"algorithm.micro_batch_size={micro}", {"algorithm__micro_batch_size": micro, "algorithm__micro_batch_tokens": 0}))
    if cfg.model.chunk_size > 256:
        out.append(("model.chunk_size=256", {"model__chunk_size": 256}))
    if cfg.rollout.engine == "vllm":
        for u in (0.3, 0.2):
            if u < cfg.rollout.vllm_gpu_memory_utilization:
                out.append((f"rollout.vllm_gpu_memory_utilization={u}", {"rollout__vllm_gpu_memory_utilization": u}))
    if cfg.algorithm.kl.enabled and cfg.algorithm.kl.type.startswith("exact"):
        out.append(("algorithm.kl.type=topk_reverse", {"algorithm__kl__type": "topk_reverse"}))
    if not cfg.model.lora.enabled:
        out.append(("model.lora.enabled=true", {"model__lora__enabled": True}))
    prompts = plan.largest.get("prompts_per_step")
    if prompts and prompts < cfg.data.prompts_per_step:
        out.append((f"data.prompts_per_step={prompts}", {"data__prompts_per_step": prompts}))
    context = plan.largest.get("max_response_tokens")
    if context and context < cfg.rollout.max_response_tokens:
        out.append((f"rollout.max_response_tokens={context}", {"rollout__max_response_tokens": context,
                                                               "rollout__max_tokens_per_turn": min(cfg.rollout.max_tokens_per_turn, context)}))
    return out


def first_knob(cfg: TrainConfig, plan: Plan, run: Callable[[TrainConfig], Plan]) -> str | None:
    """The first override of :func:`_knobs` after which the plan fits (None: none does alone)."""
    for text, changes in _knobs(cfg, plan):
        changed = _with(cfg, **changes)
        if "algorithm__micro_batch_size" in changes or "data__prompts_per_step" in changes:
            rows = changed.data.prompts_per_step * changed.rollout.n_samples
            changed.algorithm.mini_batch_size = min(changed.algorithm.mini_batch_size, rows)
            changed.algorithm.micro_batch_size = min(changed.algorithm.micro_batch_size, changed.algorithm.mini_batch_size)
        if run(changed).fits:
            return text
    return None
