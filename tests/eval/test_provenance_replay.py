"""Provenance and replay of `emapg eval`: results.json names the index (the fingerprint the server's
/health serves) and the protocol; `emapg eval compare` refuses runs whose index or protocol differ;
a greedy eval replayed from its recorded retrievals, without any server, reproduces the live eval.

Real parts: the scripted searcher model (tests/fixtures/agent.py) run by the transformers engine,
the session's `emapg serve` over a real MiniLM + FAISS index, real HTTP.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from app.cli import main as emapg_main
from eval.replay import RETRIEVALS_FILE
from emapg.jsonl import read_jsonl_repairing as read_items

DATASET = "bamboogle"


def _eval(*args) -> int:
    return emapg_main(["eval", *map(str, args), "--engine", "hf", "--no-progress", "--suite", "qa", "--protocol", "qa_quick",
                       "--limit", "2", "--datasets", DATASET])


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, searcher_dir, retriever_server):
    out = tmp_path_factory.mktemp("provenance") / "live"
    assert _eval("--model", searcher_dir, "--retriever-url", retriever_server.url, "--out", out, "--name", "live") == 0
    return out


def _items(run) -> list[dict]:
    return read_items(run / "items" / f"{DATASET}.jsonl")


def test_results_name_their_index_and_protocol(live_run, retriever_server, searcher_dir):
    results = json.loads((live_run / "results.json").read_text())
    served = httpx.get(retriever_server.url + "/health", timeout=10).json()["fingerprint"]
    assert results["fingerprint"] == served
    assert results["retriever_fingerprints"] == {retriever_server.url: served}
    card = results["protocol_card"]
    assert card["settings"]["max_turns"] == results["protocol"]["max_turns"] and card["settings"]["retrieval_topk"] == 3
    assert card["settings"]["temperature"] == 0.0 and card["settings"]["limit"] == 2
    assert card["template"]["name"] == "search_r1" and card["template"]["sha256"].startswith("sha256:")
    ds = card["datasets"][DATASET]
    assert ds["n"] == 2 and ds["file"].endswith("bamboogle/test.jsonl.gz") and ds["file_sha256"].startswith("sha256:")
    assert card["model"]["name"] == str(searcher_dir) and card["model"]["sha256"].startswith("sha256:")
    assert card["packages"]["torch"] and card["packages"]["emapg"]
    # every search recorded with its passages; the items keep the queries and the returned ids
    rows = read_items(live_run / RETRIEVALS_FILE)
    assert [(r["query"], r["topk"]) for r in rows] == [("capital of France", 3)]
    ids = [h["id"] for h in rows[0]["hits"]]
    for item in _items(live_run):
        assert item["samples"][0]["queries"] == ["capital of France"] * 2
        assert item["samples"][0]["retrieved_ids"] == [ids, ids]


def test_greedy_replay_without_a_server_reproduces_the_live_eval(live_run, searcher_dir, tmp_path, monkeypatch):
    import provision.retrievers

    def no_server(**kwargs):
        raise AssertionError("a replay without --retriever-url/--index must not open a retriever")

    monkeypatch.setattr(provision.retrievers, "open_retriever", no_server)
    out = tmp_path / "replay"
    assert _eval("--model", searcher_dir, "--replay", live_run, "--out", out, "--name", "replay") == 0
    live, replay = _items(live_run), _items(out)
    assert len(live) == len(replay) == 2
    for a, b in zip(live, replay):
        assert a == b  # prompt, responses, predictions, scores, queries, retrieved ids: identical
    r_live, r_replay = (json.loads((d / "results.json").read_text()) for d in (live_run, out))
    assert r_replay["datasets"] == r_live["datasets"]
    assert r_replay["fingerprint"] == r_live["fingerprint"]  # the replayed run's index
    assert r_replay["retriever"] == f"replayed from {live_run}"
    # same index and protocol: the two are comparable; the report says so
    assert emapg_main(["eval", "compare", str(live_run), str(out), "--out", str(tmp_path / "cmp"), "--no-paper"]) == 0
    assert "Same index fingerprint, protocol, model and packages" in (tmp_path / "cmp" / "report.md").read_text()


def test_unrecorded_query_is_an_error_unless_a_live_server_answers(live_run, searcher_dir, retriever_server, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(live_run / "results.json", other / "results.json")
    (other / RETRIEVALS_FILE).write_text(json.dumps({"query": "another query", "topk": 3, "hits": []}) + "\n")
    assert _eval("--model", searcher_dir, "--replay", other, "--out", tmp_path / "miss") == 2
    assert "was not recorded in the replayed run (first: 'capital of France')" in capsys.readouterr().err
    assert _items(tmp_path / "miss") == []  # the batch with failed searches was not written
    out = tmp_path / "fallback"
    assert _eval("--model", searcher_dir, "--replay", other, "--retriever-url", retriever_server.url, "--out", out) == 0
    assert [i["samples"] for i in _items(out)] == [i["samples"] for i in _items(live_run)]
    assert json.loads((out / "results.json").read_text())["retriever"].startswith(f"replayed from {other} (unrecorded queries: http")


def test_compare_refuses_another_index_or_protocol(live_run, tmp_path, capsys):
    results = json.loads((live_run / "results.json").read_text())
    variants = {"index": dict(results, name="index", fingerprint={**results["fingerprint"], "id": "0" * 16, "index_type": "HNSW32"}),
                "protocol": dict(results, name="protocol", protocol_card={**results["protocol_card"],
                                                         "settings": {**results["protocol_card"]["settings"], "max_turns": 4}})}
    for name, data in variants.items():
        run = tmp_path / name
        run.mkdir()
        (run / "results.json").write_text(json.dumps(data))
        assert emapg_main(["eval", "compare", str(live_run), str(run), "--out", str(tmp_path / f"cmp-{name}")]) == 2
        err = capsys.readouterr().err
        assert "not comparable" in err and "--allow-mismatch" in err
        assert ("fingerprint.index_type: 'Flat' != 'HNSW32'" if name == "index" else "settings.max_turns: 2 != 4") in err
        assert emapg_main(["eval", "compare", str(live_run), str(run), "--out", str(tmp_path / f"cmp-{name}"), "--allow-mismatch"]) == 0
        report = (tmp_path / f"cmp-{name}" / "report.md").read_text()
        assert "not comparable" in report
        diffs = json.loads((tmp_path / f"cmp-{name}" / "comparison.json").read_text())["differences"]
        assert diffs[name]["blocking"]
