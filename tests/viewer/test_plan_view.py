"""The plan beside the run's measured figures (trainer.plan.compare): ``emapg view``'s /api/runs/{id}/plan and the
report's lines, over a real training run (tests/fixtures/viewer.py) with the plan of its own config beside it."""

from __future__ import annotations

import json
import shutil
import statistics

from fastapi.testclient import TestClient

from app.viewer.runs import open_runs
from app.viewer.server import create_app
from emapg.config import load_config
from emapg.paths import CONFIG_DIR
from trainer.config import TrainConfig
from trainer.plan.catalogue import get_device
from trainer.plan.compare import plan_beside_measured, plan_lines
from trainer.plan.planner import plan_run
from trainer.tracking import read_metrics


def test_the_viewer_and_report_show_the_plan_beside_the_measured_figures(viewer_runs, tmp_path):
    run = tmp_path / "train_tags"
    shutil.copytree(viewer_runs.train_tags, run)
    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", ["retriever.urls=[http://127.0.0.1:9]"])
    plan = plan_run(cfg, get_device("cpu")).to_json()
    (run / "plan.json").write_text(json.dumps(plan))
    metrics = read_metrics(run)
    compared = plan_beside_measured(run, metrics)
    rows = {r["what"].split(" (")[0]: r for r in compared["rows"]}
    assert rows["peak memory"]["predicted"] == plan["memory_bytes"]["total"]
    assert rows["peak memory"]["measured"] == max(m["perf/peak_rss_bytes"] for m in metrics)  # a CPU run logs its RSS peak
    assert rows["step time"]["measured"] == statistics.median(m["time/step"] for m in metrics[1:])  # after the warm-up step
    assert rows["step time"]["drift"] == rows["step time"]["measured"] / plan["step_seconds"]["total"] - 1
    lines = plan_lines(compared)
    assert lines[0].startswith("Planned by `emapg plan` for 1 x this CPU") and len(lines) == 4 + len(compared["rows"])

    client = TestClient(create_app(open_runs([tmp_path]), allowed_hosts=["testserver"]))
    run_id = client.get("/api/runs").json()[0]["id"]
    assert client.get(f"/api/runs/{run_id}/plan").json() == json.loads(json.dumps(compared))
    bare = tmp_path / "bare"
    shutil.copytree(viewer_runs.train_tools, bare / "train_tools")
    other = TestClient(create_app(open_runs([bare]), allowed_hosts=["testserver"]))
    assert other.get(f"/api/runs/{other.get('/api/runs').json()[0]['id']}/plan").json() == {}  # no plan.json: nothing
