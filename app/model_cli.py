"""``emapg models``: prepare the offline default models once (so the first train/eval is fast).

An application module (the ``emapg`` command's top floor): no library module imports it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from emapg.config import add_config_arguments, config_from_args, option
from emapg.models import ALIASES, resolve_model


@dataclass
class ModelsConfig:
    """``emapg models``: which models to prepare."""

    names: list[str] = option(list(ALIASES), help="aliases or paths to prepare")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="emapg models",
        description="Resolve model aliases to local folders, converting packaged models on first use. "
        f"Aliases: {', '.join(ALIASES)}. Local folders and hub names are printed unchanged.",
    )
    add_config_arguments(p, ModelsConfig, positional=("names",))
    return p


def main(argv: list[str]) -> int:
    cfg = config_from_args(ModelsConfig, parser().parse_args(argv))
    for name in cfg.names:
        print(f"{name}\t{resolve_model(name)}")
    return 0
