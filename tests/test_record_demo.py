"""scripts/record_demo.py: a finished demo's results.json becomes benchmarks/results/demo.json with its provenance."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location("record_demo", REPO / "scripts" / "record_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


record_demo = _module()


def _run_folder(tmp_path: Path) -> Path:
    report = tmp_path / "demo" / "report"
    report.mkdir(parents=True)
    results = {"preset": "default", "base": {"pooled_em": 15.2, "sampled_em": 8.1},
               "trained": {"pooled_em": 16.2, "sampled_em": 10.5},
               "stage_seconds": {"train": 222.0, "eval_base": 108.0}, "logs": {"train": "/abs/logs/train.log"}}
    (report / "results.json").write_text(json.dumps(results))
    return tmp_path / "demo"


def test_the_results_are_copied_with_the_wall_time_commit_and_machine(tmp_path):
    run = _run_folder(tmp_path)
    log = tmp_path / "demo.log"
    log.write_text("[5/5] report  (t+10.2 min)\n\ndemo finished in 10.9 min. Report: x/report.md\n" + str(run / "report") + "\n")
    out = tmp_path / "demo.json"
    assert record_demo.main([str(run), "--stdout", str(log), "--out", str(out), "--note", "idle"]) == 0
    data = json.loads(out.read_text())
    assert data["trained"]["sampled_em"] == 10.5 and data["base"]["pooled_em"] == 15.2
    assert "logs" not in data  # absolute paths of the machine that ran it
    rec = data["recorded"]
    assert rec["wall_s"] == pytest.approx(654.0) and rec["wall_min"] == pytest.approx(10.9)
    assert rec["stage_minutes"] == {"train": pytest.approx(3.7), "eval_base": pytest.approx(1.8)}
    assert len(rec["commit"]) >= 7 and rec["machine"]["cpus"] >= 1 and rec["note"] == "idle"
    assert rec["date"].endswith("Z") and data["date"] == rec["date"]


def test_the_report_folder_works_too_and_no_wall_time_is_none(tmp_path):
    run = _run_folder(tmp_path)
    data = record_demo.record(run / "report")
    assert data["recorded"]["wall_s"] is None and data["recorded"]["wall_min"] is None


def test_a_folder_without_results_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no results.json"):
        record_demo.find_results(tmp_path)
