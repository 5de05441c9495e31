"""The config system: schemas, YAML, dotted overrides, readable errors."""

from dataclasses import dataclass, field
from typing import Literal

import pytest

from emapg.config import ConfigError, describe, dump_yaml, from_dict, load_config, markdown_reference, option


@dataclass
class Optim:
    lr: float = option(1e-6, help="learning rate")
    betas: list[float] = option([0.9, 0.95], help="AdamW betas")
    warmup_steps: int = option(0, help="linear warm-up steps")


@dataclass
class Run:
    name: str = option("run", help="run name")
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = option("token-mean", help="aggregation")
    topk: int | None = option(None, help="top-k; null for the full vocabulary")
    use_ema: bool = option(True, help="EMA anchor")
    optim: Optim = field(default_factory=Optim, metadata={"help": "optimizer"})

    def validate(self):
        if self.topk is not None and self.topk < 0:
            raise ConfigError("topk must be >= 0")


def test_defaults_and_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: a\noptim:\n  lr: 1e-5\n")
    cfg = load_config(Run, path, ["optim.warmup_steps=10", "topk=32", "use_ema=false", "optim.betas=[0.9, 0.999]"])
    assert cfg.name == "a" and cfg.optim.lr == 1e-5 and cfg.optim.warmup_steps == 10
    assert cfg.topk == 32 and cfg.use_ema is False and cfg.optim.betas == [0.9, 0.999]
    # "1e-5" without a dot is a string to YAML 1.1; it must still become a float
    assert isinstance(cfg.optim.lr, float)


def test_yaml_boolean_words_reach_literal_choices(tmp_path):
    """YAML 1.1 reads on/off/yes/no as booleans; a Literal["auto", "on", "off"] field must still take them."""

    @dataclass
    class Dist:
        fsdp: Literal["auto", "on", "off"] = option("auto", help="sharding")
        mode: Literal["yes", "true"] = option("yes", help="ambiguous spellings stay an error")

    assert load_config(Dist, None, ["fsdp=off"]).fsdp == "off"
    assert load_config(Dist, None, ["fsdp=on"]).fsdp == "on"
    path = tmp_path / "d.yaml"
    path.write_text("fsdp: off\n")
    assert load_config(Dist, path).fsdp == "off"
    with pytest.raises(ConfigError, match="mode: True is not one of"):
        load_config(Dist, None, ["mode=yes"])


def test_round_trip(tmp_path):
    cfg = load_config(Run, None, ["topk=4"])
    dump_yaml(cfg, tmp_path / "out.yaml")
    assert load_config(Run, tmp_path / "out.yaml") == cfg


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=1", "unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
        ("optim.warmup_steps=abc", "optim.warmup_steps: expected int, got 'abc'"),
        ("loss_agg=token_mean", "loss_agg: 'token_mean' is not one of"),
        ("use_ema=maybe", "use_ema: expected true/false"),
        ("topk=-1", "topk must be >= 0"),
        ("optim.betas=0.9", "optim.betas: expected a list"),
        ("name.sub=1", "name: expected a string"),
        ("noequals", "must look like key.subkey=value"),
    ],
)
def test_readable_errors(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(Run, None, [override])
    assert message in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Run, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(Run, bad)
    bad.write_text("a: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Run, bad)


def test_every_field_documented():
    rows = describe(Run)
    assert [r[0] for r in rows] == ["name", "loss_agg", "topk", "use_ema", "optim.lr", "optim.betas", "optim.warmup_steps"]
    assert all(r[3] for r in rows)
    assert "| `optim.lr` | float | `1e-06` | learning rate |" in markdown_reference(Run, "run")


def test_option_requires_help():
    with pytest.raises(TypeError):
        option(1)


def test_nested_section_type_error():
    with pytest.raises(ConfigError, match="optim: expected a mapping of Optim fields"):
        from_dict(Run, {"optim": 3})


def test_argparse_options_are_generated_from_the_config_schema(capsys):
    import argparse
    from dataclasses import dataclass
    from typing import Literal

    from emapg.config import add_config_arguments, config_from_args, option

    @dataclass
    class Inner:
        depth: int = option(2, help="how deep")

    @dataclass
    class Cmd:
        index: str = option(help="index folder")
        port: int | None = option(None, help="TCP port")
        mode: Literal["fast", "exact"] = option("fast", help="how to search")
        fp16: bool = option(False, help="half precision")
        urls: list[str] = option([], help="replica URLs")
        rate: float = option(0.5, help="a rate in %")
        inner: Inner = option(default_factory=Inner, help="nested")

        def validate(self):
            if self.rate > 1:
                raise ConfigError("rate must be <= 1")

    p = argparse.ArgumentParser(prog="cmd")
    add_config_arguments(p, Cmd, positional=("index",))
    cfg = config_from_args(Cmd, p.parse_args(["idx", "--port", "80", "--mode", "exact", "--fp16", "--urls", "a", "b",
                                             "--inner-depth", "5"]))
    assert cfg == Cmd(index="idx", port=80, mode="exact", fp16=True, urls=["a", "b"], rate=0.5, inner=Inner(5))
    assert config_from_args(Cmd, p.parse_args(["idx"])) == Cmd(index="idx")
    assert config_from_args(Cmd, p.parse_args(["idx", "--port", "none", "--no-fp16"])).port is None
    with pytest.raises(ConfigError, match="rate must be <= 1"):
        config_from_args(Cmd, p.parse_args(["idx", "--rate", "2"]))
    with pytest.raises(SystemExit):
        p.parse_args(["idx", "--mode", "slow"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "how to search (default: 'fast')" in text and "--inner-depth" in text and "a rate in %" in text


def test_argparse_flags_renames_key_values_repeats_and_the_command_reference(capsys):
    import argparse

    from emapg.config import add_config_arguments, config_from_args, markdown_command_reference

    @dataclass
    class Proto:
        retrieval_topk: int = option(3, help="passages per search")
        n: int = option(1, help="samples")

    @dataclass
    class Cmd:
        runs: list[str] = option(help="run folders")
        paths: dict[str, str] = option({}, help="name -> file")
        kinds: list[Literal["a", "b"]] = option([], help="kinds")
        proto: Proto = option(default_factory=Proto, help="protocol")

    p = argparse.ArgumentParser(prog="cmd")
    add_config_arguments(p, Cmd, positional=("runs",), flags={"proto.retrieval_topk": "--topk", "proto.n": "--n",
                                                                 "paths": "--path"}, hide_defaults=("proto.",))
    cfg = config_from_args(Cmd, p.parse_args(["r1", "r2", "--path", "x=1", "--path", "y=a=b", "--kinds", "a", "--kinds", "b",
                                              "--topk", "5", "--n", "2"]))
    assert cfg == Cmd(runs=["r1", "r2"], paths={"x": "1", "y": "a=b"}, kinds=["a", "b"], proto=Proto(5, 2))
    with pytest.raises(ConfigError, match="paths: expected KEY=VALUE, got 'x'"):
        config_from_args(Cmd, p.parse_args(["r", "--path", "x"]))
    for bad in ([], ["r", "--kinds", "c"]):  # a required positional list needs one value; choices are checked
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    capsys.readouterr()
    table = markdown_command_reference(p)
    assert table.startswith("#### `cmd` options")
    assert "| `RUNS`… | run folders (required) |" in table
    assert "| `--topk` `RETRIEVAL_TOPK` | passages per search |" in table  # the preset's default is not shown
    assert "| `--kinds` | kinds; one of: a, b |" in table and "| `--path` `KEY=VALUE` | name -> file |" in table


@dataclass
class Ranged:
    rate: float = option(0.1, help="a rate", gt=0)
    prob: float = option(0.5, help="a probability", ge=0, le=1)
    betas: list[float] = option([0.9, 0.99], help="each in [0, 1)", ge=0, lt=1)
    budget: float | None = option(None, help="seconds; inf: no budget", ge=0, inf="no budget")
    free: float = option(0.0, help="any finite number")
    workers: int = option(2, help="worker count", ge=1, le=64)


@pytest.mark.parametrize("override, message", [
    ("rate=nan", "rate: expected a finite number > 0, got nan"),
    ("rate=.inf", "rate: expected a finite number > 0, got inf"),
    ("rate=0", "rate: expected a finite number > 0, got 0.0"),
    ("prob=1.5", "prob: expected a finite number in [0, 1], got 1.5"),
    ("prob=-inf", "prob: expected a finite number in [0, 1], got -inf"),
    ("betas=[0.9, 1]", "betas[1]: expected a finite number in [0, 1), got 1.0"),
    ("budget=nan", "budget: expected a number >= 0 (inf: no budget), got nan"),
    ("budget=-inf", "budget: expected a number >= 0 (inf: no budget), got -inf"),
    ("free=nan", "free: expected a finite number, got nan"),
    ("free=1e400", "free: expected a finite number, got inf"),
    ("workers=0", "workers: expected an integer in [1, 64], got 0"),
])
def test_declared_ranges_are_checked_in_one_place(override, message):
    """The checks written `x <= 0` let NaN through (issue 31); the declared range does not."""
    with pytest.raises(ConfigError) as e:
        load_config(Ranged, None, [override])
    assert str(e.value) == message


def test_declared_ranges_accept_their_bounds_and_the_infinity_they_give_a_meaning():
    cfg = load_config(Ranged, None, ["prob=0", "betas=[0, 0.5]", "budget=inf", "free=-3", "workers=64"])
    assert (cfg.prob, cfg.betas, cfg.budget, cfg.free, cfg.workers) == (0.0, [0.0, 0.5], float("inf"), -3.0, 64)
    types = {key: tp for key, tp, _, _ in describe(Ranged)}
    assert types == {"rate": "float > 0", "prob": "float in [0, 1]", "betas": "list (each in [0, 1))",
                     "budget": "float >= 0 (inf: no budget) | None", "free": "float", "workers": "int in [1, 64]"}


def test_a_flag_out_of_range_is_named_as_typed(capsys):
    import argparse

    from emapg.config import add_config_arguments, config_from_args

    p = argparse.ArgumentParser(prog="x")
    add_config_arguments(p, Ranged)
    with pytest.raises(ConfigError, match=r"^--prob: expected a finite number in \[0, 1\], got nan$"):
        config_from_args(Ranged, p.parse_args(["--prob", "nan"]))
    p.print_help()
    assert "(> 0; default: 0.1)" in capsys.readouterr().out
