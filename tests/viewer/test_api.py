"""``emapg view``'s command and JSON API over real runs (tests/fixtures/viewer.py): what each page reads, the refusal
of a folder that is not a run, the read-only, local-only, self-contained serving."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
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
                                                       f"{root}/eval_a_sampled": "eval", f"{root}/eval_b_sampled": "eval",
                                                       f"{root}/train_tags": "train", f"{root}/train_tools": "train"}
    assert runs[f"{root}/eval_a"]["protocol"] == "greedy" and runs[f"{root}/eval_a"]["samples"] == 1
    assert runs[f"{root}/eval_a_sampled"]["protocol"] == "sampled mean@2 (T=1, top_p=1)" and runs[f"{root}/eval_a_sampled"]["samples"] == 2
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
    # the page loads every asset under its content's digest, kept by the browser for good; the page itself never
    hashed = re.findall(r'"(/static/([0-9a-f]{16})/([a-z.]+))"', page.text)
    assert {name for _, _, name in hashed} == {"plotly.min.js", "view.js", "view.css"} and page.headers["cache-control"] == "no-store"
    for url, digest, name in hashed:
        got = client.get(url)
        assert got.status_code == 200 and "immutable" in got.headers["cache-control"] and "max-age=31536000" in got.headers["cache-control"]
        assert hashlib.sha256(got.content).hexdigest()[:16] == digest
        assert client.get(url.replace(digest, "0" * 16)).status_code == 404  # another version: not served as this one
    assert client.get("/api/runs").headers["cache-control"] == "no-store"
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


def test_sampled_items_show_mean_at_k_and_every_sample(client, viewer_runs):
    from eval.learning import question_score

    run = ids(client)["eval_a_sampled"]
    items = client.get(f"/api/runs/{run}/items").json()["items"]
    records = {r["id"]: r for ds in ("bamboogle", "nq") for r in
               (json.loads(line) for line in (viewer_runs.eval_a_sampled / "items" / f"{ds}.jsonl").read_text().splitlines())}
    for item in items:
        assert item["samples"] == 2 and item["score"] == question_score(records[item["id"]], "em")  # the reports' mean@2
        assert item["right_samples"] == sum(s["scores"]["em"] >= 1.0 for s in records[item["id"]]["samples"])
    first = items[0]
    answers = [client.get(f"/api/runs/{run}/items/{first['dataset']}/{first['id']}?sample={i}").json() for i in (0, 1)]
    samples = records[first["id"]]["samples"]
    assert [a["sample"] for a in answers] == [0, 1] and all(a["segments"] for a in answers)
    assert [s["prediction"] for s in answers[0]["sample_scores"]] == [s.get("prediction") for s in samples]
    assert [a["searches"] for a in answers] == [s.get("searches", 0) for s in samples]  # each sample's own trajectory
    assert client.get(f"/api/runs/{run}/items/{first['dataset']}/{first['id']}?sample=2").status_code == 404


def test_summary_is_the_reports_numbers_like_for_like(client, viewer_runs):
    """GET /api/summary: EM of A and B, B - A and its interval, exactly eval.learning.compare_learning's (the demo
    report's code); two evaluations under different protocols: a 409 naming both."""
    from eval.learning import compare_learning, evaluated_datasets

    runs = ids(client)
    for a, b in (("eval_b", "eval_injected"), ("eval_a_sampled", "eval_b_sampled")):
        got = client.get(f"/api/summary?a={runs[a]}&b={runs[b]}").json()
        report = compare_learning(getattr(viewer_runs, a), getattr(viewer_runs, b), evaluated_datasets(getattr(viewer_runs, a)))
        pooled = report["pooled"]
        assert (got["a"], got["b"]) == (runs[a], runs[b]) and got["n"] == pooled["n"] == 4
        assert (got["em_a"], got["em_b"], got["difference"]) == (pooled["base"], pooled["trained"], pooled["difference"]["mean"])
        assert got["interval"] == [pooled["difference"]["low"], pooled["difference"]["high"]]
        assert set(got["datasets"]) == {"bamboogle", "nq"}
    assert got["protocol"].startswith("sampled mean@2")
    crossed = client.get(f"/api/summary?a={runs['eval_b']}&b={runs['eval_b_sampled']}")
    assert crossed.status_code == 409
    assert "greedy" in crossed.json()["detail"] and "sampled mean@2 (T=1, top_p=1)" in crossed.json()["detail"]
    assert client.get(f"/api/compare?a={runs['eval_b']}&b={runs['eval_b_sampled']}").status_code == 409
    assert client.get(f"/api/summary?a={runs['eval_b']}&b={runs['train_tags']}").status_code == 404


def test_a_demo_report_folder_opens_its_runs(viewer_runs, tmp_path):
    """The folder the demo prints last (``<demo>/report``) opens the demo folder's runs."""
    demo = tmp_path / "demo"
    for name in ("eval_a", "eval_b"):
        shutil.copytree(getattr(viewer_runs, name), demo / name)
    (demo / "report").mkdir()
    (demo / "report" / "report.md").write_text("# report\n")
    assert sorted(r.label for r in open_runs([demo / "report"])) == ["demo/eval_a", "demo/eval_b"]


def test_only_curves_flat_by_construction_leave_the_default_panels(client):
    """filter/informative_frac at 1 (uniform groups dropped) is flat by construction; a reward flat so far is not, nor
    reward/zero_variance_groups flat at 1 (every group uniform: a fact about the run, not its construction)."""
    from app.viewer.server import flat_by_construction

    got = flat_by_construction({"filter/informative_frac": 1.0, "reward/zero_variance_groups": 1.0, "reward/mean": 0.5})
    assert list(got) == ["filter/informative_frac"] and "uniform groups are dropped" in got["filter/informative_frac"]
    metrics = client.get(f"/api/runs/{ids(client)['train_tags']}/metrics").json()
    assert set(metrics["by_construction"]) <= set(metrics["constant"])
    assert metrics["titles"]["reward/mean"] == "reward of the groups kept for the update"
