"""``emapg train --config FILE [dotted.key=value ...] [--resume [DIR]]`` and ``emapg export RUN --out DIR``.

The config is loaded and validated (including the dataset name and the index folder)
before any model is loaded, so mistakes cost a second, not a model load. ``--resume``
alone continues the run in ``run.output_dir`` from its latest checkpoint (or starts it
when there is none); ``--resume DIR`` continues from a run folder or a ``step_N`` folder.
Under ``torchrun`` every rank runs this same command.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from emapg.errors import UserError
from emapg.config import ConfigError, add_config_arguments, config_from_args, load_config, option

if TYPE_CHECKING:
    from trainer.config import TrainConfig


def _yaml_command_parser(prog: str, description: str, config_example: str, overrides_example: str,
                         log_name: str) -> argparse.ArgumentParser:
    """``--config FILE`` plus ``dotted.key=value`` overrides: the shape of ``emapg train`` and ``emapg sft``."""
    p = argparse.ArgumentParser(
        prog=prog,
        description=f"{description} Every option can be overridden as dotted.key=value (see `emapg config reference`). "
        f"Library output (transformers, torch, vLLM logs and warnings, subprocesses) goes to <run.output_dir>/{log_name} "
        f"(under torchrun, rank N>0 writes {log_name.replace('.log', '.rankN.log')}), appended to on each run; "
        "the console gets progress, our own messages and the final line.",
    )
    p.add_argument("--config", required=True, help=f"YAML config (e.g. {config_example})")
    p.add_argument("overrides", nargs="*", help=f"dotted.key=value overrides, e.g. {overrides_example}")
    p.add_argument("--quiet", action="store_true", help="no progress (by default a bar on a terminal, a line per step "
                   "when the output is not a terminal)")
    return p


def _check_overrides(overrides: list[str]) -> None:
    for o in overrides:
        if "=" not in o:
            raise UserError(f"override {o!r} must look like key.subkey=value")


def _parser() -> argparse.ArgumentParser:
    p = _yaml_command_parser("emapg train", "Train a policy with EMA-PG or GRPO. Presets: configs/*.yaml.",
                             "configs/search_tiny_cpu.yaml", "run.total_steps=20 optim.lr=1e-5", "train.log")
    p.add_argument(
        "--resume", nargs="?", const="", default=None, metavar="DIR",
        help="continue from the latest checkpoint of the run (or of DIR: a run folder or a step_N folder)",
    )
    p.add_argument("--no-plan", action="store_true", help="skip the memory plan (`emapg plan`) that refuses, before anything "
                   "loads, a config whose predicted peak exceeds the device's memory")
    p.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                   help="check the plan against this many GiB per device instead of the device's own memory")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    _check_overrides(args.overrides)
    from trainer.config import TrainConfig
    from trainer.data import load_prompts

    cfg = load_config(TrainConfig, args.config, [*args.overrides, *(["logging.progress=false"] if args.quiet else [])])
    load_prompts(cfg.data.train, split=cfg.data.split, limit=cfg.data.limit, seed=cfg.run.seed)  # fail fast on bad data
    if args.resume is None:  # (a resumed run loads its checkpoint's policy folder instead)
        from emapg.models import resolve_model
        from trainer.model_limits import check_model_limits

        # a model that does not exist, or settings it cannot honour (kl.topk, token budgets): one line, exit 2
        check_model_limits(cfg, resolve_model(cfg.model.policy, option="model.policy"))
    if not args.no_plan:
        _plan_or_refuse(cfg, args.device_memory)
    from emapg.console import library_output_to, rank_log_name
    from trainer.errors import TrainingError

    try:
        with library_output_to(cfg.output_path / rank_log_name("train"), title="emapg train " + " ".join(argv)):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # "Loading weights" bars: noise even in the log
            from trainer.loop import train

            history = train(cfg, resume=args.resume)
    except TrainingError as e:
        print(f"emapg train: {e}", file=sys.stderr)
        return 1
    except ConfigError:
        raise
    if history:
        last = history[-1]
        print(f"finished step {len(history)} of this session; reward/mean={last.get('reward/mean', float('nan')):.4f}; "
              f"run folder: {cfg.output_path}")
    return 0


def _plan_or_refuse(cfg: "TrainConfig", device_memory_gib: float | None) -> None:
    """The run plan (:mod:`trainer.plan`) before anything loads: a one-line refusal (UserError) when it does not
    fit; else written to ``<run.output_dir>/plan.json`` (rank 0), where ``emapg view`` and the report read it."""
    import json
    import os

    from emapg.atomic import write_text_atomic
    from trainer.plan.cli import PLAN_FILE, check_fits

    plan = check_fits(cfg, device_memory_gib=device_memory_gib)
    if plan is not None and os.environ.get("RANK", "0") == "0":
        cfg.output_path.mkdir(parents=True, exist_ok=True)
        write_text_atomic(cfg.output_path / PLAN_FILE, json.dumps(plan.to_json(), indent=2) + "\n")


def sft_parser() -> argparse.ArgumentParser:
    return _yaml_command_parser(
        "emapg sft", "Fine-tune a policy on search-agent trajectories (observation tokens masked out of the loss), "
        "tokenised exactly as rollouts are. Presets: configs/sft_*.yaml.",
        "configs/sft_smollm2_starter.yaml", "optim.lr=1e-4 model.lora.enabled=true", "sft.log")


def sft_main(argv: list[str]) -> int:
    """``emapg sft --config FILE [dotted.key=value ...]``: the config (``trainer.sft.config.SFTConfig``) is
    loaded and validated, and the model name resolved, before any data is built or model loaded."""
    args = sft_parser().parse_args(argv)
    _check_overrides(args.overrides)
    from emapg.models import resolve_model
    from trainer.model_limits import check_model_limits
    from trainer.sft.config import SFTConfig

    cfg = load_config(SFTConfig, args.config, args.overrides)
    check_model_limits(cfg, resolve_model(cfg.model.policy, option="model.policy"))
    if cfg.data.source == "file":
        from trainer.sft.data import read_trajectory_file

        read_trajectory_file(cfg.data.path)  # a bad row: one line naming file and line, before any model loads
    from emapg.console import library_output_to, rank_log_name
    from emapg.progress import StepProgress

    bar: list[StepProgress] = []

    def progress(step: int, total: int, loss: float) -> None:
        if not bar:
            bar.append(StepProgress("sft", total))
        bar[0].update(step, f"loss={loss:.4f}")

    with library_output_to(cfg.output_path / rank_log_name("sft"), title="emapg sft " + " ".join(argv)):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        from trainer.sft.train import run_sft

        try:
            result = run_sft(cfg, progress=None if args.quiet else progress)
        finally:
            for b in bar:
                b.close()
    print(f"held-out SFT loss {result.heldout_loss_before:.4f} -> {result.heldout_loss_after:.4f}; "
          f"policy folder: {result.output_dir / 'policy'}")
    return 0


@dataclass
class ExportConfig:
    """``emapg export``: a trained policy as a plain HF folder."""

    model: str = option(help="a run folder (its latest checkpoint), a step_N checkpoint, or a LoRA adapter folder")
    out: str = option(help="folder to write (config, safetensors weights, tokenizer); it must not exist yet")

    def validate(self) -> None:
        if Path(self.out).expanduser().exists():
            raise ConfigError(f"--out {self.out} exists; give a new folder")


def export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="emapg export",
        description="Write a trained policy as a plain Hugging Face folder that any transformers/vLLM loader reads: "
        "a LoRA run's adapters are merged into their base (W + alpha/r * B A), a full run's weights are copied.",
    )
    add_config_arguments(p, ExportConfig, positional=("model",))
    return p


def export_main(argv: list[str]) -> int:
    cfg = config_from_args(ExportConfig, export_parser().parse_args(argv))
    from emapg.models import resolve_model
    from trainer.lora import merge_adapter_folder

    source = resolve_model(cfg.model, option="model")
    out = merge_adapter_folder(source, Path(cfg.out).expanduser())
    print(f"wrote {out} (from {source})")
    return 0
