"""``emapg models``: prepare the offline default models once (so the first train/eval is fast)."""

from __future__ import annotations

import argparse

from emapg.models import ALIASES, resolve_model


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="emapg models",
        description="Resolve model aliases to local folders, converting packaged models on first use. "
        f"Aliases: {', '.join(ALIASES)}. Local folders and hub names are printed unchanged.",
    )
    p.add_argument("names", nargs="*", default=list(ALIASES), help="aliases or paths to prepare (default: all aliases)")
    args = p.parse_args(argv)
    for name in args.names:
        print(f"{name}\t{resolve_model(name)}")
    return 0
