"""docs/own-data.md's worked example, run as written: its commands (between ``own-data-example`` markers) on the
tiny corpus and questions of examples/own_corpus/, with ``runs/own`` replaced by a temporary folder."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "own-data.md"

pytestmark = pytest.mark.slow


def example_commands() -> list[str]:
    text = PAGE.read_text()
    block = text.split("<!-- own-data-example:start -->")[1].split("<!-- own-data-example:end -->")[0]
    return [line for line in block.splitlines() if line.startswith("emapg ")]


def test_the_worked_example_runs(tmp_path):
    commands = example_commands()
    assert [c.split()[1] for c in commands] == ["index", "eval", "train", "eval"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for command in commands:
        argv = shlex.split(command.replace("runs/own", str(tmp_path)))
        proc = subprocess.run([str(REPO / ".venv" / "bin" / "emapg"), *argv[1:]], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    for name in ("eval_before", "eval_after"):
        results = json.loads((tmp_path / name / "results.json").read_text())
        assert results["datasets"]["nq"]["n_items"] == 2  # the two held-out questions
    assert (tmp_path / "train" / "metrics.jsonl").read_text().count("\n") == 2
