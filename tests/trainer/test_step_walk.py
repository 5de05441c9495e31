"""The walk of one step's batch (scripts/step_walk.py, issue #56): ``Trainer`` stays at most 300 lines, and following
one ``Trainer.learn`` with every pass over the batch on (π_old in two mini-batches, the anchor, a teacher,
``kl/to_start``) enters no file more than twice down to the calls of ``learn``'s own calls (depth 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_one_steps_batch_enters_no_file_more_than_twice(tmp_path):
    out = tmp_path / "walk.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "step_walk.py"), "--json", str(out)], cwd=REPO, check=True,
                   capture_output=True, text=True)
    walk = json.loads(out.read_text())
    assert walk["trainer_class_lines"] <= 300
    depth2 = walk["depths"]["2"]
    assert depth2["over_twice"] == [], depth2["most_entered"]
    assert depth2["files"] >= 10  # the walk saw the step: the passes, the update, the anchor, the metrics
    assert walk["micro_batches_calls"] == 3  # the passes together (π_old's two mini-batches), the update's two
