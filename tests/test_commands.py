"""Commands whose options are generated from config dataclasses keep every established flag working."""

from __future__ import annotations

import dataclasses
from typing import get_args

import pytest

from emapg.config import ConfigError, config_from_args


def test_eval_flags_build_the_config(monkeypatch):
    from eval.cli import build_config, eval_parser
    from eval.protocols import get_protocol

    monkeypatch.setenv("EMAPG_RETRIEVER_API_KEY", "k")
    argv = ["--model", "m", "--suite", "qa", "--out", "o", "--limit", "3", "--datasets", "nq,hotpotqa", "bamboogle",
            "--data-path", "nq=a.jsonl", "--data-path", "hotpotqa=b.jsonl", "--data-seed", "4",
            "--retriever-url", "http://127.0.0.1:1", "--index", "idx", "--engine", "hf", "--protocol", "qa_quick",
            "--n", "2", "--temperature", "0.5", "--top-p", "0.9", "--max-tokens", "33", "--max-turns", "1",
            "--topk", "5", "--template", "search_r1", "--seed", "7", "--grader", "math_verify", "--grade-timeout", "2",
            "--grader-workers", "3", "--name", "run", "--batch-size", "8", "--rollout-mode", "async", "--no-progress"]
    cfg = build_config(eval_parser().parse_args(argv))
    assert cfg.protocol == get_protocol("qa_quick", n=2, temperature=0.5, top_p=0.9, max_tokens=33, max_turns=1,
                                        retrieval_topk=5, template="search_r1", seed=7, grader="math_verify",
                                        grade_timeout=2.0)
    assert (cfg.model, cfg.out, cfg.limit, cfg.data_seed, cfg.name, cfg.engine, cfg.batch_size) == ("m", "o", 3, 4, "run", "hf", 8)
    assert cfg.datasets == ["nq", "hotpotqa", "bamboogle"]
    assert cfg.data_paths == {"nq": "a.jsonl", "hotpotqa": "b.jsonl"}
    assert (cfg.retriever_url, cfg.index, cfg.retriever_api_key) == ("http://127.0.0.1:1", "idx", "k")
    assert (cfg.rollout_mode, cfg.grader_workers, cfg.progress) == ("async", 3, False)


def test_eval_defaults_come_from_the_suites_preset():
    from eval.cli import build_config, eval_parser
    from eval.protocols import PROTOCOLS

    parse = lambda *a: build_config(eval_parser().parse_args(["--model", "m", "--out", "o", *a]))
    assert parse().protocol == PROTOCOLS["qa_greedy"]
    assert parse("--suite", "math").protocol == PROTOCOLS["math_paper"]
    assert parse("--protocol", "math_quick").protocol == PROTOCOLS["math_quick"]  # the preset names its suite
    assert parse("--protocol", "math_quick", "--n", "8").protocol.n == 8
    with pytest.raises(ConfigError, match="data_paths: expected KEY=VALUE, got 'bad'"):
        parse("--data-path", "bad")
    with pytest.raises(ConfigError, match="unknown protocol 'nope'"):
        parse("--protocol", "nope")


def test_compare_plot_demo_models_config_flags():
    from app import config_cli, demo, model_cli
    from eval.cli import CompareConfig, compare_parser
    from trainer.plot import PlotConfig, parser as plot_parser

    assert config_from_args(CompareConfig, compare_parser().parse_args(["a", "b", "--out", "c", "--no-paper"])) == \
        CompareConfig(runs=["a", "b"], out="c", paper=False)
    with pytest.raises(SystemExit):
        compare_parser().parse_args(["--out", "c"])  # at least one run
    cfg = config_from_args(PlotConfig, plot_parser().parse_args(
        ["r1", "r2", "--out", "x.png", "--metrics", "a", "b", "--labels", "A", "B", "--smooth", "3", "--title", "t"]))
    assert cfg == PlotConfig(runs=["r1", "r2"], out="x.png", metrics=["a", "b"], labels=["A", "B"], smooth=3, title="t")
    with pytest.raises(ConfigError, match="labels: one label per run"):
        config_from_args(PlotConfig, plot_parser().parse_args(["r1", "--out", "x", "--labels", "A", "B"]))
    with pytest.raises(ConfigError, match="smooth must be >= 1"):
        config_from_args(PlotConfig, plot_parser().parse_args(["r1", "--out", "x", "--smooth", "0"]))
    assert config_from_args(demo.DemoConfig, demo.parser().parse_args(["--preset", "tiny", "--out", "d"])) == \
        demo.DemoConfig(preset="tiny", out="d")
    assert set(get_args(demo.PresetName)) == set(demo.PRESETS)
    assert config_from_args(model_cli.ModelsConfig, model_cli.parser().parse_args(["minilm"])).names == ["minilm"]
    args = config_cli.parser().parse_args(["reference", "--schema", "train", "--schema", "protocol"])
    vars(args).pop("action")
    assert config_from_args(config_cli.ReferenceConfig, args).schema == ["train", "protocol"]
    args = config_cli.parser().parse_args(["show", "f.yaml", "a.b=1", "c=2", "--schema", "rollout"])
    vars(args).pop("action")
    assert config_from_args(config_cli.ShowConfig, args) == config_cli.ShowConfig("f.yaml", ["a.b=1", "c=2"], "rollout")


def test_help_is_written_once_on_the_fields(capsys):
    from eval.cli import eval_parser
    from eval.runner import EvalConfig

    with pytest.raises(SystemExit):
        eval_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(EvalConfig):
        if f.name not in ("protocol", "retriever_api_key", "engine_api_key"):  # API keys come from the environment
            assert " ".join(f.metadata["help"].split()) in text, f.name
