"""``emapg config``: print a resolved config, or the reference of every option.

    emapg config show configs/search_smollm2_cpu.yaml trainer.lr=2e-6
    emapg config reference            # markdown tables generated from the help texts
"""

from __future__ import annotations

import argparse
import importlib

import yaml

from emapg.config import load_config, markdown_reference, to_dict

# schema name -> (module, class, what it configures)
SCHEMAS: dict[str, tuple[str, str, str]] = {
    "train": ("trainer.config", "TrainConfig", "`emapg train --config FILE` (YAML presets in `configs/`)"),
}


def _schema(name: str) -> type:
    module, cls, _ = SCHEMAS[name]
    return getattr(importlib.import_module(module), cls)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="emapg config", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="load a YAML config, apply dotted overrides, validate, print the result")
    show.add_argument("config", help="YAML file")
    show.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    show.add_argument("--schema", choices=sorted(SCHEMAS), default="train", help="which schema the file follows")
    ref = sub.add_parser("reference", help="print the markdown reference of all options")
    ref.add_argument("--schema", choices=sorted(SCHEMAS), action="append", help="limit to these schemas")
    args = p.parse_args(argv)
    if args.action == "show":
        cfg = load_config(_schema(args.schema), args.config, args.overrides)
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    for name in args.schema or SCHEMAS:
        print(markdown_reference(_schema(name), f"{name}: {SCHEMAS[name][2]}"))
    return 0
