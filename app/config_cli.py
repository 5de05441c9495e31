"""``emapg config``: print a resolved config, or the reference of every option.

    emapg config show configs/search_smollm2_cpu.yaml trainer.lr=2e-6
    emapg config reference            # markdown tables generated from the help texts (= docs/configuration.md)

An application module (the ``emapg`` command's top floor): no library module imports it.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Literal, get_args

import yaml

from emapg.config import (
    add_config_arguments,
    config_from_args,
    load_config,
    markdown_command_reference,
    markdown_reference,
    option,
    to_dict,
)

SchemaName = Literal["train", "sft", "rollout", "protocol"]

# schema name -> (module, class, what it configures)
SCHEMAS: dict[str, tuple[str, str, str]] = {
    "train": ("trainer.config", "TrainConfig", "`emapg train` — `TrainConfig` (YAML presets in `configs/`, dotted overrides)"),
    "sft": ("trainer.sft.config", "SFTConfig", "`emapg sft` — `SFTConfig` (YAML presets `configs/sft_*.yaml`, dotted overrides)"),
    "rollout": ("agent.rollout", "RolloutConfig", "Agent loop — `agent.rollout.RolloutConfig`"),
    "protocol": ("eval.protocols", "EvalProtocol", "Evaluation protocols — `eval.protocols.EvalProtocol`"),
}

# command -> (module, function returning its argparse parser); their options come from config dataclasses
COMMAND_PARSERS: dict[str, tuple[str, str]] = {
    "eval": ("eval.cli", "eval_parser"),
    "eval compare": ("eval.cli", "compare_parser"),
    "plot": ("trainer.plot", "parser"),
    "plan": ("trainer.plan.cli", "parser"),
    "export": ("trainer.cli", "export_parser"),
    "demo": ("app.demo", "parser"),
    "view": ("app.viewer.server", "parser"),
    "models": ("app.model_cli", "parser"),
    "data audit": ("app.data_cli", "audit_parser"),
    "config": ("app.config_cli", "parser"),
    "serve": ("retriever.cli", "serve_parser"),
    "index": ("retriever.cli", "index_parser"),
    "router": ("retriever.cli", "router_parser"),
    "engine serve": ("agent.engines.cli", "serve_parser"),
}


@dataclass
class ShowConfig:
    """``emapg config show``."""

    config: str = option(help="YAML file")
    overrides: list[str] = option([], help="dotted.key=value overrides")
    schema: SchemaName = option("train", help="which schema the file follows")


@dataclass
class ReferenceConfig:
    """``emapg config reference``."""

    schema: list[SchemaName] = option([], help="print only these schemas' tables (default: every schema and command)")


def _schema(name: str) -> type:
    module, cls, _ = SCHEMAS[name]
    return getattr(importlib.import_module(module), cls)


def reference_markdown(schemas: list[str] | None = None) -> str:
    """The configuration reference: every schema's keys, then (without ``schemas``) every command's options."""
    parts = [markdown_reference(_schema(name), SCHEMAS[name][2]) for name in (schemas or SCHEMAS)]
    if not schemas:
        for command, (module, func) in COMMAND_PARSERS.items():
            parts.append(markdown_command_reference(getattr(importlib.import_module(module), func)()))
    return "\n".join(parts)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="emapg config", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    add_config_arguments(sub.add_parser("show", help="load a YAML config, apply dotted overrides, validate, print the result"),
                         ShowConfig, positional=("config", "overrides"))
    add_config_arguments(sub.add_parser("reference", help="print the markdown reference of all options"), ReferenceConfig)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    action = vars(args).pop("action")
    if action == "show":
        show = config_from_args(ShowConfig, args)
        cfg = load_config(_schema(show.schema), show.config, show.overrides)
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    print(reference_markdown(config_from_args(ReferenceConfig, args).schema or None), end="")
    return 0


assert set(get_args(SchemaName)) == set(SCHEMAS), "SchemaName must list the SCHEMAS keys"
