"""README: the two set-up commands at the top, and a configuration reference that matches the code."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_two_commands_at_the_top():
    text = (REPO / "README.md").read_text()
    first_block = text.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]


def test_config_reference_is_generated_from_the_code():
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gen_config_reference.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_multi_node_section_names_the_launch_and_the_resume():
    """Issue #30's contract: a multi-node section naming ``--nnodes`` (and how a preempted run comes back)."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Multi-node training\n", 1)[1].split("\n## ", 1)[0]
    assert "--nnodes" in section and "--node-rank" in section and "--resume" in section and "SLURM" in section
