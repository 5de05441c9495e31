"""``emapg view``'s command and JSON API over real runs (tests/fixtures/viewer.py): what each page reads, the refusal
of a folder that is not a run, the read-only, local-only, self-contained serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from app.viewer.runs import open_runs
from app.viewer.server import CSP, create_app
from emapg.errors import UserError
from emapg.servers import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def client(viewer_runs):
    runs = open_runs([viewer_runs.root])
    return TestClient(create_app(runs, allowed_hosts=["testserver"]))


def ids(client) -> dict[str, str]:
    return {r["label"].split("/")[-1]: r["id"] for r in client.get("/api/runs").json()}


def test_a_folder_of_runs_opens_as_each_run(client, viewer_runs):
    runs = {r["label"]: r for r in client.get("/api/runs").json()}
    root = viewer_runs.root.name
    assert {k: r["kind"] for k, r in runs.items()} == {f"{root}/eval_a": "eval", f"{root}/eval_b": "eval", f"{root}/eval_injected": "eval",
                                                       f"{root}/train_tags": "train", f"{root}/train_tools": "train"}
    assert runs[f"{root}/train_tags"]["steps"] == 3 and runs[f"{root}/train_tags"]["sample_steps"] == 3
    assert runs[f"{root}/eval_a"]["questions"] == 4 and runs[f"{root}/eval_a"]["datasets"] == ["bamboogle", "nq"]
    # how it searched, per slice (eval.search_metrics): every question in exactly one of search / reader / rest
    search = runs[f"{root}/eval_a"]["search"]
    assert search["all"]["questions"] == 4 == sum(search[s]["questions"] for s in ("search", "reader", "rest"))
    assert {"searches_per_question", "searched_again_rate", "second_holds_gold_rate", "em", "f1"} <= set(search["all"])


def test_metrics_since_a_step(client):
    run = ids(client)["train_tags"]
    every = client.get(f"/api/runs/{run}/metrics").json()
    assert [r["step"] for r in every["records"]] == [1, 2, 3] and "reward/mean" in every["keys"] and "kl/mean" in every["keys"]
    assert [r["step"] for r in client.get(f"/api/runs/{run}/metrics?since=2").json()["records"]] == [3]


@pytest.mark.parametrize("name, fmt", [("train_tags", "tags"), ("train_tools", "tool_calls")])
def test_samples_are_whole_trajectories(client, name, fmt):
    got = client.get(f"/api/runs/{ids(client)[name]}/samples").json()
    assert got["step"] == got["steps"][-1] and len(got["samples"]) == 4
    for t in got["samples"]:
        assert t["format"] == fmt and t["prompt"] and t["golds"] and t["advantage"] is not None and not t["segments_inferred"]
        roles = [s["role"] for s in t["segments"]]
        assert "model" in roles and "observation" in roles  # the scripted searchers search: passages came back
        assert all(s["masked"] == (s["role"] == "observation") for s in t["segments"])
        searched = [s["query"] for s in t["segments"] if s["query"] is not None]
        assert searched == t["queries"][: len(searched)] and searched
        assert any(s.get("passages") for s in t["segments"] if s["role"] == "observation")


def test_eval_items_filter(client):
    run = ids(client)["eval_injected"]
    every = client.get(f"/api/runs/{run}/items").json()
    assert every["total"] == every["matching"] == 4 and every["datasets"] == ["bamboogle", "nq"]
    right = client.get(f"/api/runs/{run}/items?outcome=right").json()["items"]
    assert [i["dataset"] for i in right] == ["bamboogle"]  # the crafted right answer
    wrong = client.get(f"/api/runs/{run}/items?outcome=wrong").json()
    assert wrong["matching"] == 3 and all(not i["right"] for i in wrong["items"])
    shown = client.get(f"/api/runs/{run}/items?outcome=shown_wrong").json()["items"]
    not_shown = client.get(f"/api/runs/{run}/items?outcome=not_shown_wrong").json()["items"]
    assert len(shown) + len(not_shown) == 3 and all(i["shown"] for i in shown) and not any(i["shown"] for i in not_shown)
    assert client.get(f"/api/runs/{run}/items?dataset=nq").json()["matching"] == 2
    searches = every["searches"][0]
    assert all(i["searches"] == searches for i in client.get(f"/api/runs/{run}/items?searches={searches}").json()["items"])
    assert client.get(f"/api/runs/{run}/items?outcome=bogus").status_code == 422
    item = right[0]
    detail = client.get(f"/api/runs/{run}/items/{item['dataset']}/{item['id']}").json()
    assert detail["right"] and detail["segments"] and detail["question"] == item["question"]
    assert client.get(f"/api/runs/{run}/items/nq/no-such-id").status_code == 404
    assert client.get(f"/api/runs/{run}/items/..%2F..%2Fetc/passwd").status_code == 404


def test_two_evaluations_question_by_question(client):
    runs = ids(client)
    got = client.get(f"/api/compare?a={runs['eval_b']}&b={runs['eval_injected']}").json()
    assert len(got["rows"]) == 4 and got["counts"]["gained"] == 1 and got["counts"]["lost"] == 0
    flipped = [r for r in got["rows"] if r["change"] == "gained"]
    assert flipped[0]["dataset"] == "bamboogle" and not flipped[0]["a"]["right"] and flipped[0]["b"]["right"]
    back = client.get(f"/api/compare?a={runs['eval_injected']}&b={runs['eval_b']}").json()
    assert back["counts"]["lost"] == 1 and back["counts"]["gained"] == 0
    assert client.get(f"/api/compare?a={runs['eval_a']}&b={runs['train_tags']}").status_code == 404


def test_serving_is_read_only_local_and_self_contained(client, viewer_runs):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-security-policy"] == CSP
    assert "script-src 'self'" in CSP and "unsafe-eval" not in CSP and "frame-ancestors 'none'" in CSP
    assert "http" not in page.text.replace('charset="utf-8"', "")  # no asset from another origin
    bundle = client.get("/static/plotly.min.js")
    assert bundle.status_code == 200 and len(bundle.content) > 1_000_000 and b"plotly" in bundle.content[:2000].lower()
    assert client.get("/static/view.js").status_code == 200 and client.get("/static/../runs.py").status_code == 404
    assert client.post("/api/runs").status_code == 405
    assert TestClient(create_app(open_runs([viewer_runs.root]))).get("/").status_code == 400  # Host: testserver is not local
    assert "innerHTML" not in (REPO / "app/viewer/static/view.js").read_text().replace("nothing is ever assigned to innerHTML", "")


def test_a_folder_that_is_not_a_run_is_refused(tmp_path):
    (tmp_path / "notes").mkdir()
    with pytest.raises(UserError, match="is not a run"):
        open_runs([tmp_path])
    proc = subprocess.run([sys.executable, "-m", "app.cli", "view", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("emapg view: error:") and "is not a run" in proc.stderr


def test_the_command_serves_the_page_and_the_runs(viewer_runs):
    """The contract: ``emapg view RUN --port P`` serves ``GET /`` (200) and ``GET /api/runs`` (JSON)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "view", str(viewer_runs.train_tags), "--port", str(port)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                page = httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else "timeout"
                time.sleep(0.2)
        assert page.status_code == 200
        runs = httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=5)
        assert runs.headers["content-type"].startswith("application/json")
        assert [r["kind"] for r in json.loads(runs.text)] == ["train"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert f"http://127.0.0.1:{port}/" in proc.stderr.read()
