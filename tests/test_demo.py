"""The main job end to end: `make demo PRESET=tiny` through the real index, server, trainer and evaluator."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tasks.datasets import QA_DATASETS

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_env(tmp_path_factory):
    env = dict(os.environ)
    env["EMAPG_CACHE"] = str(tmp_path_factory.mktemp("emapg-cache"))  # a fresh cache: the demo builds its index
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_make_demo_tiny_writes_a_report(tmp_path, demo_env):
    out = tmp_path / "demo"
    proc = subprocess.run(["make", "-s", "demo", "PRESET=tiny", f"OUT={out}"], cwd=REPO, env=demo_env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = Path(proc.stdout.strip().splitlines()[-1])  # contract: the last line is the report folder
    assert report == out / "report"
    assert (report / "report.md").is_file() and list(report.glob("*.png"))
    results = json.loads((report / "results.json").read_text())
    assert set(results["datasets"]) == set(QA_DATASETS)
    for name in QA_DATASETS:
        for label in ("base", "trained"):
            scores = results["datasets"][name][label]
            assert scores["n_items"] == 2 and 0.0 <= scores["em"] <= 100.0
    assert results["training"]["steps"] == 2
    # contract: pooled EM (percent over all held-out questions) of the starter and the trained policy, greedy and
    # sampled (mean@k at the training temperature), and the training stage's trajectories per minute
    for label in ("base", "trained"):
        assert 0.0 <= results[label]["pooled_em"] <= 100.0 and 0.0 <= results[label]["sampled_em"] <= 100.0
    assert results["sampled"]["samples"] == 2 and results["training"]["trajectories_per_min"] > 0
    ds = results["difference"]["sampled_em"]
    assert ds["n"] == 2 * len(QA_DATASETS) and ds["mean"] == pytest.approx(results["trained"]["sampled_em"] - results["base"]["sampled_em"])
    sampled_items = [json.loads(line) for line in (out / "eval_base_sampled" / "items" / "nq.jsonl").read_text().splitlines()]
    assert all(len(r["samples"]) == 2 for r in sampled_items)
    diff = results["difference"]["pooled_em"]
    assert diff["n"] == 2 * len(QA_DATASETS) and diff["low"] <= diff["mean"] <= diff["high"]
    assert diff["mean"] == pytest.approx(results["trained"]["pooled_em"] - results["base"]["pooled_em"])
    # trained on the answerable pool, evaluated on a subset of the held-out split (disjoint by construction)
    assert results["training"]["train_set"] == "qa_pool" and results["training"]["questions"]["nq/test"] > 2000  # tiny preset
    from tasks.datasets import heldout_ids
    for name in QA_DATASETS:
        items = [json.loads(line) for line in (out / "eval_base" / "items" / f"{name}.jsonl").read_text().splitlines()]
        assert {r["id"] for r in items} <= set(heldout_ids(name))
    assert "reward_first_step" in results["training"] and "informative groups trained per minute" in (report / "report.md").read_text()
    curves = [m["reward/mean"] for m in results["training"]["metrics"]]
    assert len(curves) == 2 and all("response/answered_frac" in m for m in results["training"]["metrics"])
    # every stage's own output went to a log file named in the report, not to the console
    for name in ("models", "eval_base", "eval_base_sampled", "train", "eval_trained", "eval_trained_sampled"):
        assert Path(results["logs"][name]).is_file() and Path(results["logs"][name]).stat().st_size > 0
    assert "Traceback" not in proc.stdout and "INFO" not in proc.stdout
    md = (report / "report.md").read_text()
    assert all(f"| {name} |" in md for name in QA_DATASETS) and "Example trajectories" in md
    assert "| **pooled** |" in md and "KL *estimate*" in md
    for label in ("base", "trained"):  # where the misses are: every held-out question counted once
        m = results["misses"][label]
        assert m["right"] + m["wrong_shown"] + m["wrong_not_shown"] == m["questions"] == 2 * len(QA_DATASETS)
        assert sum(m["searches"].values()) == m["questions"]
        assert m["right"] == round(results[label]["pooled_em"] * m["questions"] / 100)  # greedy: one answer each
    assert "## Where the misses are" in md and "wrong although a gold answer was in the passages shown" in md
    assert md.index("## Held-out accuracy, sampled and greedy") < md.index("## Starter vs trained per dataset")
    assert "sampled mean@2 EM" in md and "qa_pool" in md
    # issue 53: searches per question of both policies (greedy, every question evaluated), the per-slice search
    # metrics, the search-slice questions evaluated beside the held-out sample, one trajectory that searched twice
    _search_slice_is_reported(out, results, md)
    # with its output not a terminal, the training stage printed one plain line per step
    assert proc.stdout.count("  train step ") == 2 and "ETA" in proc.stdout
    assert (report / "training_curves.png").is_file()
    _reader_slice_row_counts_the_questions_evaluated(out, results, md)
    _viewer_summary_equals_the_report(report, results)


def _items(folder: Path) -> list[dict]:
    return [json.loads(line) for name in QA_DATASETS if (folder / "items" / f"{name}.jsonl").is_file()
            for line in (folder / "items" / f"{name}.jsonl").read_text().splitlines()]


def _search_slice_is_reported(out: Path, results: dict, md: str) -> None:
    """The tiny preset evaluates 2 search-slice questions (data/qa/search_slice.json) beside its 2 x 7 held-out ones,
    greedy and sampled, for both policies; they join every per-slice count, and a row of their own compares them."""
    from tasks.multihop import search_slice_ids

    recorded = search_slice_ids()
    ss = results["search_slice"]
    assert ss["questions"] == 2 and ss["file"] == "data/qa/search_slice.json"
    for label in ("base", "trained"):
        searched = _items(out / f"eval_{label}_search")
        assert len(searched) == 2 and all(r["id"] in recorded[r["dataset"]] for r in searched)
        greedy = _items(out / f"eval_{label}") + searched
        assert results[label]["searches_per_question"] == pytest.approx(
            sum(r["samples"][0]["searches"] for r in greedy) / len(greedy), abs=1e-4)
        rows = results["search"][label]
        assert set(rows) == {"search", "reader", "rest", "all"} and rows["all"]["questions"] == 2 * len(QA_DATASETS) + 2
        assert sum(rows[s]["questions"] for s in ("search", "reader", "rest")) == rows["all"]["questions"]
        assert rows["search"]["questions"] >= 2
        assert {"searched_again_rate", "second_holds_gold_rate", "sampled_em", "sampled_f1", "greedy_em"} <= set(rows["all"])
        every = [smp for folder in ("", "_sampled", "_search", "_search_sampled")
                 for r in _items(out / f"eval_{label}{folder}") for smp in r["samples"]]
        assert len(every) == (2 * len(QA_DATASETS) + 2) * 3  # one greedy and 2 sampled trajectories per question
        assert results["two_searches"][label] == {"trajectories": len(every), "searched_twice": sum(smp["searches"] >= 2 for smp in every)}
    for key in ("sampled_em_start", "sampled_em_end", "greedy_em_start", "greedy_em_end"):
        assert 0.0 <= ss[key] <= 100.0
    assert ss["difference"]["mean"] == pytest.approx(ss["sampled_em_end"] - ss["sampled_em_start"])
    assert ss["greedy_difference"]["mean"] == pytest.approx(ss["greedy_em_end"] - ss["greedy_em_start"])
    assert "| search slice, sampled mean@2 EM | 2 |" in md and "| search slice, greedy EM | 2 |" in md
    assert "## Searching, per slice" in md and "## A held-out trajectory with two searches" in md
    assert all(Path(results["logs"][f"eval_{label}_search{tail}"]).is_file() for label in ("base", "trained") for tail in ("", "_sampled"))


def _reader_slice_row_counts_the_questions_evaluated(out: Path, results: dict, md: str) -> None:
    """Contract: ``reader_slice.questions`` is the overlap of the demo's held-out questions with the recorded slice,
    recomputed here from data/qa/reader_slice.json itself; with some, the sampled EM over them at start and end."""
    recorded = json.loads((REPO / "data" / "qa" / "reader_slice.json").read_text())["ids"]
    evaluated = {ds: {json.loads(line)["id"] for line in (out / "eval_base_sampled" / "items" / f"{ds}.jsonl").read_text().splitlines()}
                 for ds in QA_DATASETS}
    overlap = sum(len(evaluated[ds] & set(recorded.get(ds, []))) for ds in QA_DATASETS)
    rs = results["reader_slice"]
    assert rs["questions"] == overlap == results["sampled"]["reader_questions"]
    assert f"{overlap} of these {2 * len(QA_DATASETS)} questions are in it" in md
    if overlap:
        assert 0.0 <= rs["sampled_em_start"] <= 100.0 and 0.0 <= rs["sampled_em_end"] <= 100.0
        assert rs["difference"]["mean"] == pytest.approx(rs["sampled_em_end"] - rs["sampled_em_start"])
        assert "| reader slice, sampled mean@2 EM |" in md
    else:
        assert "sampled_em_start" not in rs and "reader slice, sampled" not in md


def _viewer_summary_equals_the_report(report: Path, results: dict) -> None:
    """``emapg view <report folder>`` opens the demo's runs, and its summary of each like-for-like pair is the report's."""
    from fastapi.testclient import TestClient

    from app.viewer.runs import open_runs
    from app.viewer.server import create_app

    runs = open_runs([report])
    client = TestClient(create_app(runs, allowed_hosts=["testserver"]))
    by_name = {r.label.split("/")[-1]: r.id for r in runs}
    for a, b, key in (("eval_base", "eval_trained", "pooled_em"), ("eval_base_sampled", "eval_trained_sampled", "sampled_em")):
        got = client.get(f"/api/summary?a={by_name[a]}&b={by_name[b]}").json()
        d = results["difference"][key]
        assert (got["em_a"], got["em_b"]) == (results["base"][key], results["trained"][key])
        assert (got["difference"], got["interval"]) == (d["mean"], [d["low"], d["high"]])
    crossed = client.get(f"/api/summary?a={by_name['eval_base']}&b={by_name['eval_trained_sampled']}")
    assert crossed.status_code == 409 and "greedy" in crossed.json()["detail"] and "sampled mean@2" in crossed.json()["detail"]
    other_questions = client.get(f"/api/summary?a={by_name['eval_base']}&b={by_name['eval_trained_search']}")
    assert other_questions.status_code == 409 and "search slice" in other_questions.json()["detail"]
    got = client.get(f"/api/summary?a={by_name['eval_base_search']}&b={by_name['eval_trained_search']}").json()
    assert (got["em_a"], got["em_b"]) == (results["search_slice"]["greedy_em_start"], results["search_slice"]["greedy_em_end"])


def test_ctrl_c_stops_every_process_and_keeps_the_cache(tmp_path, demo_env):
    """Interrupt while the retriever serves; nothing the demo started survives; a rerun reuses the index."""
    out = tmp_path / "demo"
    log = tmp_path / "demo.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([str(REPO / ".venv/bin/emapg"), "demo", "--preset", "tiny", "--out", str(out)],
                                cwd=REPO, env=demo_env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = None
    deadline = time.monotonic() + 600
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text().splitlines():
            if line.startswith("retriever ready at "):
                url = line.split()[3]
        time.sleep(0.5)
    assert url, log.read_text()[-3000:]
    time.sleep(3)  # let the base evaluation start
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(60) != 0
    assert "demo interrupted" in log.read_text()
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)
    leftovers = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert leftovers == []
    index = Path(demo_env["EMAPG_CACHE"]) / "indexes" / "wiki_mini-minilm-flat-first2000"
    assert (index / "meta.json").is_file()
