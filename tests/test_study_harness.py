"""studies/harness.py: the committed-protocol check on a real git repository, resuming, the intervals in percentage
points, and the report with its plot."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from studies import harness


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


@pytest.fixture
def checkout(tmp_path):
    """A git repository holding a study and the harness's protocol files, all committed."""
    root = tmp_path / "repo"
    for rel in ("studies/my_study.py", *harness.PROTOCOL_FILES):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"# {rel}\n")
    _git(root, "init", "-q")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "protocol")
    return root


def test_a_committed_protocol_starts_and_is_recorded(checkout):
    record = harness.start(checkout / "studies/my_study.py", quick=False, allow_dirty=False, root=checkout)
    assert record["dirty"] is False and len(record["commit"]) == 40 and record["allowed_by"] is None
    assert record["protocol_files"] == ["studies/my_study.py", *harness.PROTOCOL_FILES]


@pytest.mark.parametrize("change", ["studies/my_study.py", "studies/harness.py", "eval/significance.py"])
def test_a_changed_protocol_file_refuses_the_run(checkout, change):
    (checkout / change).write_text("# changed after the commit\n")
    with pytest.raises(SystemExit, match=f"not committed: {change}.*--allow-dirty"):
        harness.start(checkout / "studies/my_study.py", quick=False, allow_dirty=False, root=checkout)
    for quick, allow_dirty, by in ((True, False, "quick"), (False, True, "allow-dirty")):
        record = harness.start(checkout / "studies/my_study.py", quick=quick, allow_dirty=allow_dirty, root=checkout)
        assert record["dirty"] is True and record["uncommitted"] == [change] and record["allowed_by"] == by


def test_an_untracked_study_and_a_staged_change_refuse(checkout):
    (checkout / "studies/new_study.py").write_text("# never committed\n")
    with pytest.raises(SystemExit, match="new_study.py"):
        harness.start(checkout / "studies/new_study.py", quick=False, allow_dirty=False, root=checkout)
    (checkout / "studies/my_study.py").write_text("# staged, not committed\n")
    _git(checkout, "add", "studies/my_study.py")
    with pytest.raises(SystemExit, match="my_study.py"):
        harness.start(checkout / "studies/my_study.py", quick=False, allow_dirty=False, root=checkout)
    # a file the study names as its dependency blocks it too; other files of the tree do not
    (checkout / "studies/other_study.py").write_text("# the code my_study runs\n")
    _git(checkout, "reset", "-q")
    _git(checkout, "checkout", "studies/my_study.py")
    assert harness.uncommitted(checkout / "studies/my_study.py", checkout) == []
    assert harness.uncommitted(checkout / "studies/my_study.py", checkout, also=["studies/other_study.py"]) == ["studies/other_study.py"]
    (checkout / "notes.txt").write_text("unrelated\n")
    assert harness.uncommitted(checkout / "studies/new_study.py", checkout) == ["studies/new_study.py"]


def test_outside_a_git_checkout_the_run_needs_allow_dirty(tmp_path):
    (tmp_path / "studies").mkdir()
    study = tmp_path / "studies" / "s.py"
    study.write_text("")
    with pytest.raises(SystemExit, match="cannot tell whether the protocol is committed"):
        harness.start(study, quick=False, allow_dirty=False, root=tmp_path)
    assert harness.start(study, quick=False, allow_dirty=True, root=tmp_path)["commit"] is None


def test_the_option_is_on_every_study():
    """Each study's parser has --allow-dirty (its --help lists it)."""
    root = Path(harness.__file__).parent
    for study in sorted(root.glob("*.py")):
        if study.name != "harness.py":
            assert "harness.add_arguments(" in study.read_text() and "harness.start(" in study.read_text(), study.name


def test_resuming_keeps_finished_runs_and_takes_only_missing_ones(tmp_path):
    done = tmp_path / "grpo-seed0" / "run.json"
    assert harness.finished(done) is None
    harness.record(done, {"em": 1.0})
    assert harness.finished(done) == {"em": 1.0}
    other = tmp_path / "emapg-seed0" / "run.json"
    taken = harness.take_finished({done: {"em": 0.0}, other: {"em": 0.5}})
    assert taken == [other] and harness.finished(done) == {"em": 1.0} and harness.finished(other) == {"em": 0.5}
    assert harness.seeds_first(["a", "b"], [0, 1]) == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    with pytest.raises(SystemExit, match="differs in steps"):
        harness.same_protocol({"steps": 12, "policy": "p"}, {"steps": 8, "policy": "p"}, ("steps", "policy"))


def test_both_intervals_in_percentage_points():
    start = {f"q{i}": float(i % 2) for i in range(40)}
    seeds = [{k: min(1.0, v + (1.0 if int(k[1:]) % 4 == 0 else 0.0)) for k, v in start.items()} for _ in range(3)]
    both = harness.intervals([start], seeds)
    assert both["per_question"]["mean"] == pytest.approx(both["seed_level"]["mean"]) == pytest.approx(25.0)
    assert both["seed_level"]["per_seed"] == pytest.approx([25.0] * 3) and both["seed_level"]["seeds_b"] == 3
    assert both["seed_level"]["low"] <= 25.0 <= both["seed_level"]["high"]
    with pytest.raises(ValueError, match="different questions"):
        harness.seed_difference([start], [{"q0": 1.0}])


def test_the_report_and_its_plot(tmp_path):
    def plot(report, path):
        fig, ax = harness.figure()
        ax.plot([0, 1], [report["start"], report["end"]])
        return harness.save_figure(fig, path)

    out = harness.write_report({"start": 1.0, "end": 2.0}, tmp_path / "r" / "study.json", plot)
    report = json.loads(out.read_text())
    assert report["plot"] == str(tmp_path / "r" / "study.png") and (tmp_path / "r" / "study.png").stat().st_size > 1000
