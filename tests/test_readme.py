"""README (the product page) and the documentation pages it leads to: the two set-up commands at the top, a short
README, a configuration reference that matches the code, and the sections other issues' contracts name."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


def test_two_commands_at_the_top():
    text = (REPO / "README.md").read_text()
    first_block = text.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    assert text.index("```bash") < 1200  # near the top, after the one-paragraph description


def test_the_readme_is_a_product_page():
    """Issue #43: at most 300 lines; the rest lives in docs/, and every docs page it links to exists."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    linked = {part.split(")", 1)[0].split("#", 1)[0] for part in text.split("](docs/")[1:]}
    assert {"learning.md", "performance.md", "configuration.md", "training.md", "retriever.md"} <= linked
    assert all((DOCS / name).is_file() for name in linked), linked


def test_config_reference_is_generated_from_the_code():
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gen_config_reference.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "#### `emapg train` — `TrainConfig`" in (DOCS / "configuration.md").read_text()


def test_multi_node_section_names_the_launch_and_the_resume():
    """Issue #30's contract: a multi-node section naming ``--nnodes`` (and how a preempted run comes back)."""
    text = (DOCS / "training.md").read_text()
    section = text.split("\n## Multi-node training\n", 1)[1].split("\n## ", 1)[0]
    assert "--nnodes" in section and "--node-rank" in section and "--resume" in section and "SLURM" in section
