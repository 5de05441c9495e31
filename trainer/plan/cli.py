"""``emapg plan CONFIG [overrides] [--device NAME --devices N --nodes M] [--json] [--probe]``, and the check
``emapg train`` runs before it loads anything (:func:`check_fits`).

The plan is printed (a table, or one JSON object with ``--json``) and written as JSON to ``--out`` (default
``<run.output_dir>/plan.json``, where ``emapg view`` and the demo report read it beside the run's measured figures).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from emapg.config import load_config
from emapg.errors import ConfigError, UserError
from trainer.plan.catalogue import Device, device_names, get_device, local_device
from trainer.plan.compare import PLAN_FILE
from trainer.plan.planner import GIB, Plan, plan_run


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="emapg plan",
        description="Predict a training config's per-device memory by component, step time by phase, the whole run's "
        "hours and cost, the largest micro-batch / rollout batch / context that fit and the override to try first -- "
        "before any weights load (the model's config.json only). Devices: trainer/plan/devices.yaml.",
    )
    p.add_argument("config", help="YAML training config (e.g. configs/search_qwen2.5-3b_emapg.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, as for emapg train")
    p.add_argument("--device", default=None, choices=device_names(),
                   help="device to plan for (default: cpu when run.device=cpu, else h100-80gb)")
    p.add_argument("--devices", type=int, default=1, help="devices per node (processes under torchrun; FSDP2 shards over all)")
    p.add_argument("--nodes", type=int, default=1, help="nodes")
    p.add_argument("--price", type=float, default=None, help="USD per device-hour (default: the catalogue's assumed price)")
    p.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                   help="plan against this many GiB per device instead of the catalogue's usable memory")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--probe", action="store_true",
                   help="run four real steps at the configured shapes on this machine (synthetic rollouts at the token budgets, no "
                   "retriever), measure peak memory and each phase's time, refit the achievable rates and plan the run with "
                   "them (--device is then this machine's)")
    p.add_argument("--out", default=None, help=f"write the plan's JSON here (default <run.output_dir>/{PLAN_FILE}; '-': nowhere)")
    return p


def _device(cfg: Any, name: str | None) -> Device:
    return get_device(name or ("cpu" if cfg.run.device == "cpu" else "h100-80gb"))


def _check_counts(devices: int, nodes: int) -> None:
    if devices < 1 or nodes < 1:
        raise UserError(f"--devices and --nodes must be >= 1, got {devices} and {nodes}")


def available_bytes(device_memory_gib: float | None) -> int | None:
    """``--device-memory GIB`` in bytes (None: the device's own); a readable error for a value that is not > 0."""
    if device_memory_gib is None:
        return None
    if not (math.isfinite(device_memory_gib) and device_memory_gib > 0):
        raise UserError(f"--device-memory must be a finite number of GiB > 0, got {device_memory_gib}")
    return int(device_memory_gib * GIB)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    _check_counts(args.devices, args.nodes)
    for o in args.overrides:
        if "=" not in o:
            raise UserError(f"override {o!r} must look like key.subkey=value")
    from trainer.config import TrainConfig

    cfg = load_config(TrainConfig, args.config, args.overrides)
    available = available_bytes(args.device_memory)
    if args.price is not None and not (math.isfinite(args.price) and args.price >= 0):
        raise UserError(f"--price must be a finite number >= 0, got {args.price}")
    if args.probe:
        from trainer.plan.probe import probe_plan

        plan = probe_plan(cfg, price=args.price, available=available, progress=not args.json)
    else:
        plan = plan_run(cfg, _device(cfg, args.device), devices=args.devices, nodes=args.nodes, price=args.price,
                        available=available)
    data = plan.to_json()
    out = Path(args.out) if args.out else cfg.output_path / PLAN_FILE
    if args.out != "-":
        from emapg.atomic import write_text_atomic

        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=2) if args.json else render(plan, cfg))
    if not args.json and args.out != "-":
        print(f"wrote {out}")
    return 0


def _gib(b: float) -> str:
    return f"{b / GIB:8.2f} GiB"


def _seconds(s: float) -> str:
    return f"{s:10.2f} s" if s < 600 else f"{s / 60:10.1f} min"


def render(plan: Plan, cfg: Any) -> str:
    """The plan as text: memory by component (peak phase), step time by phase, run, what fits, the knob."""
    d = plan.device
    lines = [f"plan for {cfg.model.policy} on {plan.devices * plan.nodes} x {d.name} "
             f"({plan.devices} per node, {plan.nodes} node{'s' if plan.nodes > 1 else ''}; rates {plan.rates_source})",
             f"memory per device, {plan.memory_phase_text()}:"]
    for name, size in plan.memory_bytes.items():
        if size or name == "total":
            lines.append(f"  {name:<18}{_gib(size)}")
    lines.append(f"  {'available':<18}{_gib(plan.available_bytes)}   -> {'fits' if plan.fits else 'DOES NOT FIT'}")
    lines.append("step time:")
    for name, s in plan.step_seconds.items():
        lines.append(f"  {name:<18}{_seconds(s)}")
    lines.append(f"run: {plan.total_steps} steps = {plan.run_hours:.2f} h, {plan.run_hours * plan.devices * plan.nodes:.1f} "
                 f"device-hours, ${plan.cost:,.0f} at ${plan.price_per_hour:.2f}/device-hour")
    big = plan.largest
    lines.append(f"largest that fit: algorithm.micro_batch_size={big.get('micro_batch_size')}, "
                 f"data.prompts_per_step={big.get('prompts_per_step')}, rollout.max_response_tokens={big.get('max_response_tokens')}")
    if not plan.fits:
        lines.append(f"turn first: {plan.knob or 'no single override fits: more devices (--devices/--nodes) or a smaller model'}")
    if plan.probe:
        p = plan.probe
        measured = ", ".join(f"{k} {v:.3f} s" for k, v in p["measured_step_seconds"].items() if v is not None)
        lines.append(f"probe: measured peak {_gib(p['measured_peak_bytes']).strip()} against {_gib(p['unprobed']['memory_bytes']['total']).strip()} "
                     f"predicted before the probe ({p['memory_error']:+.1%}; {p['peak_definition']}); measured step: {measured}")
    lines.append("assumptions: " + "; ".join(plan.to_json()["assumptions"]))
    return "\n".join(lines)


def check_fits(cfg: Any, *, device_memory_gib: float | None = None) -> Plan | None:
    """``emapg train``'s check before anything loads: a :class:`UserError` (one line: the component, predicted and
    available bytes, the override to try) when the plan's peak exceeds the device's memory; the plan otherwise
    (None, with a warning, when the model's shape cannot be read from its config)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    device = get_device("cpu") if cfg.run.device == "cpu" else local_device()
    available = available_bytes(device_memory_gib)
    try:
        plan = plan_run(cfg, device, devices=local, nodes=max(1, world // max(1, local)), available=available)
    except (ConfigError, UserError) as e:  # a shape the planner cannot read, or a policy name that no longer resolves
        print(f"emapg train: warning: no memory plan ({e}); starting without the check", file=sys.stderr)
        return None
    if not plan.fits:
        raise UserError(plan.refusal())
    return plan
