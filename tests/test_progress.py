"""emapg.progress: a line per step when the output is not a terminal, nothing when off; emapg train/sft/eval --quiet."""

from __future__ import annotations

import io

from emapg.progress import StepProgress, resolve_mode


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_file_gets_one_line_per_step():
    out = io.StringIO()
    p = StepProgress("train", 3, stream=out)
    assert p.mode == "lines"
    for step in (1, 2, 3):
        p.update(step, f"reward={step / 10:.3f}")
    p.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" [")[0] for line in lines] == ["train 1/3 steps", "train 2/3 steps", "train 3/3 steps"]
    assert lines[-1].endswith("reward=0.300")


def test_lines_can_be_spaced_but_the_last_always_prints():
    out = io.StringIO()
    p = StepProgress("eval nq", 100, stream=out, unit="question", min_interval_s=3600)
    for _ in range(100):
        p.advance()
    assert [line.split(" [")[0] for line in out.getvalue().splitlines()] == ["eval nq 1/100 questions", "eval nq 100/100 questions"]


def test_off_prints_nothing_and_a_terminal_gets_a_bar():
    out = io.StringIO()
    p = StepProgress("train", 2, stream=out, mode="off")
    p.update(1, "x")
    p.close()
    assert out.getvalue() == ""
    assert resolve_mode("auto", Terminal()) == "bar" and resolve_mode("auto", io.StringIO()) == "lines"
    term = Terminal()
    bar = StepProgress("train", 2, stream=term)
    bar.update(2, "reward=1")
    bar.close()
    assert bar.mode == "bar" and "2/2" in term.getvalue()


def test_quiet_flags():
    from eval.cli import build_config, eval_parser
    from trainer.cli import _parser as train_parser
    from trainer.cli import sft_parser

    assert train_parser().parse_args(["--config", "c.yaml", "--quiet"]).quiet
    assert sft_parser().parse_args(["--config", "c.yaml", "--quiet"]).quiet
    base = ["--model", "tiny-qwen2", "--out", "o"]
    assert build_config(eval_parser().parse_args(base)).progress
    assert not build_config(eval_parser().parse_args([*base, "--quiet"])).progress
