"""Every number option of every command keeps to its declared range, generated from the schemas.

For each float option of ``train``, ``sft`` (YAML + dotted overrides), ``eval``, ``serve``, ``index build`` and
``engine serve`` (flags), NaN, +inf, -inf and a value just outside each declared bound must end the command
with exit code 2 and one line naming the option, no traceback, before anything loads. The options are read
off the config dataclasses and the commands' parsers, so an option added tomorrow is covered by this test
the day it is added. Most cases run the ``emapg`` entry point in this process (thousands of cases in
seconds); a few go through a real subprocess, as a user would type them (the contract of issue 31).
"""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
import types
import typing
from typing import Any, Union, get_args, get_origin

import pytest

from app.cli import main as emapg_main
from emapg.config import Bounds, bounds_of
from emapg.paths import CONFIG_DIR, REPO_ROOT

ENTRY = "import sys; from app.cli import main; sys.exit(main(sys.argv[1:]))"


def _float_kind(tp: Any) -> str | None:
    """'float' / 'list' for a float or list-of-float annotation (None allowed around it), else None."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        tp = args[0] if len(args) == 1 else tp
    if tp is float:
        return "float"
    if get_origin(tp) in (list, tuple) and get_args(tp)[:1] == (float,):
        return "list"
    return None


def float_options(cls: type, prefix: str = "") -> dict[str, tuple[dataclasses.Field, str]]:
    """Dotted key -> (field, 'float' | 'list') for every float option of a config schema, nested ones included."""
    out: dict[str, tuple[dataclasses.Field, str]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(float_options(tp, f"{prefix}{f.name}."))
        elif _float_kind(tp):
            out[f"{prefix}{f.name}"] = (f, _float_kind(tp))
    return out


def bad_values(bounds: Bounds) -> list[float]:
    """NaN, the infinities the option does not give a meaning, and a value just past each declared bound."""
    values = [math.nan] + ([math.inf, -math.inf] if bounds.inf is None else [-math.inf] if bounds.ge is not None or bounds.gt is not None else [])
    for bound, step in ((bounds.ge, -1), (bounds.gt, 0), (bounds.le, 1), (bounds.lt, 0)):
        if bound is not None:
            values.append(bound + step * max(1e-3, abs(bound) * 1e-3))
    return values


def _spelled(value: float) -> str:
    return {math.inf: "inf", -math.inf: "-inf"}.get(value, "nan" if math.isnan(value) else repr(value))


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


# ----------------------------------------------------------------------------- the commands


def _yaml_schema(name: str) -> type:
    from app.config_cli import _schema

    return _schema(name)


# command -> (schema, argv before the override, how an override is spelled)
YAML_COMMANDS = {
    "train": ("train", ["train", "--config", str(CONFIG_DIR / "math_tiny_cpu.yaml")]),
    "sft": ("sft", ["sft", "--config", str(CONFIG_DIR / "sft_tiny_cpu.yaml")]),
}


def _flag_commands() -> dict[str, tuple[Any, list[type], list[str]]]:
    """command -> (its parser, the schemas its flags come from, argv giving the required options harmless values)."""
    from agent.engines.cli import serve_parser as engine_parser
    from agent.engines.server import EngineServeConfig
    from eval.cli import ProtocolPreset, eval_parser
    from eval.runner import EvalConfig
    from retriever.cli import index_parser, serve_parser
    from retriever.index_builder import BuildConfig
    from retriever.server import ServeConfig

    build = next(a for a in index_parser()._actions if isinstance(getattr(a, "choices", None), dict)).choices["build"]
    missing = "/nonexistent/issue31"
    return {
        "eval": (eval_parser(), [ProtocolPreset, EvalConfig], ["eval", "--model", missing, "--out", missing]),
        "serve": (serve_parser(), [ServeConfig], ["serve", "--index", missing]),
        "index build": (build, [BuildConfig], ["index", "build", "--corpus", missing, "--out", missing]),
        "engine serve": (engine_parser(), [EngineServeConfig], ["engine", "serve", "--model", missing]),
    }


def cases() -> list[tuple[str, str, list[str], tuple[str, ...]]]:
    """(command, option as the user names it, argv, how the error line may name it), for every bad value of
    every float option of every command."""
    out = []
    for command, (schema, argv) in YAML_COMMANDS.items():
        for key, (f, kind) in float_options(_yaml_schema(schema)).items():
            for v in bad_values(bounds_of(f)):
                value = _spelled(v) if kind == "float" else f"[{', '.join([_spelled(v), *map(repr, (_default(f) or [0.0, 1.0])[1:])])}]"
                out.append((command, key, [*argv, f"{key}={value}"], (key,)))
    for command, (parser, schemas, argv) in _flag_commands().items():
        flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
        for schema in schemas:
            for key, (f, kind) in float_options(schema).items():
                if key not in flags:
                    continue
                assert kind == "float", f"{command} {flags[key]}: list-of-float flags need a case here"
                for v in bad_values(bounds_of(f)):
                    # eval's protocol flags are named by their field (`--temperature` -> "temperature: ...")
                    names = (flags[key], key.rsplit(".", 1)[-1])
                    out.append((command, flags[key], [*argv, f"{flags[key]}={_spelled(v)}"], names))
    return out


CASES = cases()


def test_every_command_has_its_float_options_covered():
    covered = {(c, o) for c, o, _, _ in CASES}
    per_command = {c: sum(1 for cc, _ in covered if cc == c) for c in ("train", "sft", "eval", "serve", "engine serve")}
    assert all(per_command.values()), per_command
    for key in ("optim.lr", "algorithm.kl.coef", "algorithm.adv_eps", "retriever.wait", "rollout.temperature", "model.lora.alpha",
                "guard.kl_spike.ratio", "optim.betas"):
        assert ("train", key) in covered, key
    assert ("serve", "--header-timeout") in covered and ("engine serve", "--header-timeout") in covered
    assert len(CASES) > 250


def test_every_default_is_in_its_declared_range():
    from agent.engines.server import EngineServeConfig
    from retriever.index_builder import BuildConfig
    from retriever.server import ServeConfig

    for cls in (_yaml_schema("train"), _yaml_schema("sft"), _yaml_schema("protocol"), ServeConfig, EngineServeConfig, BuildConfig):
        for key, (f, kind) in float_options(cls).items():
            default = _default(f)
            for v in ([] if default is None else default if kind == "list" else [default]):
                assert bounds_of(f).allows(v), (cls.__name__, key, v)


def test_every_bad_float_setting_exits_2_with_one_line_naming_the_option(capsys):
    failures = []
    for command, option, argv, named in CASES:
        try:
            code = emapg_main(list(argv))
        except SystemExit as e:  # argparse refused the value itself
            code = e.code
        out, err = capsys.readouterr()
        line = err.strip()
        if not (code == 2 and "\n" not in line and any(re.search(re.escape(n) + r"(\[\d+\])?: ", line) for n in named) and "expected" in line
                and "Traceback" not in err):
            failures.append((command, option, argv[-1], code, line[:300]))
    assert not failures, f"{len(failures)} of {len(CASES)} cases:\n" + "\n".join(map(str, failures[:20]))


@pytest.mark.parametrize("argv, named", [
    (["config", "show", str(CONFIG_DIR / "math_tiny_cpu.yaml"), "optim.lr=nan"], "optim.lr"),
    (["config", "show", str(CONFIG_DIR / "math_tiny_cpu.yaml"), "algorithm.kl.coef=inf"], "algorithm.kl.coef"),
    (["serve", "--index", "/nonexistent", "--header-timeout=-inf"], "--header-timeout"),
    (["engine", "serve", "--model", "/nonexistent", "--body-timeout", "nan"], "--body-timeout"),
], ids=["config-lr-nan", "config-kl-coef-inf", "serve", "engine-serve"])
def test_real_commands_refuse_a_bad_number_in_one_line(argv, named):
    p = subprocess.run([sys.executable, "-c", ENTRY, *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    line = p.stderr.strip()
    assert "\n" not in line and named in line and "Traceback" not in line, line
    assert p.stdout == ""


def test_model_bounds_are_checked_before_anything_loads(tmp_path, capsys):
    """Before: algorithm.kl.topk beyond the vocabulary loaded the model, rolled out a step, then stopped in a 49-line
    traceback. Now the model's config.json is read as soon as the name is resolved (tiny-qwen2: 2,048 tokens of
    vocabulary, a 4,096-token context)."""
    config = str(CONFIG_DIR / "math_tiny_cpu.yaml")
    cases = [
        (["algorithm.kl.type=topk_reverse", "algorithm.kl.topk=1000000"], "algorithm.kl.topk: 1000000 exceeds the vocabulary size 2048"),
        (["rollout.max_response_tokens=5000"], "rollout.max_response_tokens: 5000 tokens exceed the context"),
        (["rollout.max_prompt_tokens=4096"], "rollout.max_prompt_tokens: 4096 tokens leave no room for a response"),
    ]
    for overrides, message in cases:
        code = emapg_main(["train", "--config", config, f"run.output_dir={tmp_path / 'run'}", *overrides])
        line = capsys.readouterr().err.strip()
        assert code == 2 and message in line and "\n" not in line, (overrides, line)
        assert not (tmp_path / "run").exists()


def test_server_help_lists_the_header_timeout():
    from agent.engines.cli import serve_parser as engine_parser
    from retriever.cli import serve_parser

    for parser in (serve_parser(), engine_parser()):
        text = parser.format_help()
        assert "--header-timeout" in text and "--max-idle-connections" in text
