"""The `emapg` entry point and package layout."""

import subprocess
import sys
from pathlib import Path

from app.cli import COMMANDS, main

REPO = Path(__file__).resolve().parent.parent


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "app.cli", "--help"], capture_output=True, text=True, check=True).stdout
    for name in ("index", "serve", "train", "eval", "demo", "plot"):
        assert name in COMMANDS and f"    {name}" in out


def test_packages_import():
    subprocess.run([sys.executable, "-c", "import agent, retriever, trainer, eval, emapg, tasks, provision"], check=True, cwd="/")


def test_unknown_command_is_a_readable_error(capsys):
    try:
        main(["frobnicate"])
    except SystemExit as e:
        assert e.code == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_config_errors_exit_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_section: 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "config", "show", str(bad)], capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 2
    assert "unknown key 'no_such_section'" in proc.stderr and "Traceback" not in proc.stderr


def test_required_layout():
    for path in ("agent", "retriever", "trainer", "eval", "tasks", "provision", "docker", "docker-compose.yml", "configs", "data",
                 "benchmarks", "studies", "tests", "README.md", "pyproject.toml", "Makefile", ".ci/run"):
        assert (REPO / path).exists(), path
    assert "make test" in (REPO / ".ci/run").read_text()


def test_user_errors_via_python_m_are_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--index", str(tmp_path / "missing")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("emapg serve: error:")
