"""The real server on a real port over a real MiniLM + FAISS index (fixtures in tests/fixtures/retriever.py)."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest

from retriever.client import RetrieverClient

# Measured 2026-11-29 on this index (200 NQ gold questions, 399 passages, MiniLM, 128 tokens):
# recall@1 0.965, recall@3 0.995. The floor leaves room for float differences across CPUs.
RECALL_AT_3_FLOOR = 0.95


def _post(url: str, body, **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(url + "/retrieve", content=body, headers={"content-type": "application/json"}, timeout=60, **kw)
    return httpx.post(url + "/retrieve", json=body, timeout=60, **kw)


def test_recall_at_3_on_nq_gold_passages(retriever_server, retriever_index):
    questions = retriever_index.questions
    with RetrieverClient(retriever_server.url, batch_size=64) as client:
        hits = client.retrieve([q["question"] for q in questions], topk=3)
    found = [q["gold_id"] in [h["id"] for h in hh] for q, hh in zip(questions, hits)]
    recall = sum(found) / len(found)
    print(f"\nrecall@3 over {len(found)} NQ gold-passage questions ({retriever_index.rows} passages): {recall:.3f}")
    assert recall >= RECALL_AT_3_FLOOR
    assert all(len(hh) == 3 for hh in hits)
    assert all(hh[0]["score"] >= hh[1]["score"] >= hh[2]["score"] for hh in hits)


def test_search_r1_shapes_with_scores(retriever_server, retriever_index):
    q = retriever_index.questions[0]
    r = _post(retriever_server.url, {"queries": [q["question"], "capital of France"], "topk": 2, "return_scores": True})
    assert r.status_code == 200, r.text
    result = r.json()["result"]
    assert len(result) == 2 and all(len(hits) == 2 for hits in result)
    for hits in result:
        for hit in hits:
            assert set(hit) == {"document", "score"}
            assert set(hit["document"]) == {"id", "contents"}
            assert isinstance(hit["score"], float)
            title, _, text = hit["document"]["contents"].partition("\n")
            assert title.startswith('"') and title.endswith('"') and text  # wiki-18 form
    assert result[0][0]["document"]["id"] == q["gold_id"]


@pytest.mark.parametrize("n_queries", [1, 2, 3])
def test_search_r1_shapes_without_scores(retriever_server, retriever_index, n_queries):
    """Search-R1 500s on 1 or 3 queries and mislabels 2 when return_scores is false; we must not."""
    questions = retriever_index.questions[:n_queries]
    with_scores = _post(retriever_server.url, {"queries": [q["question"] for q in questions], "topk": 3, "return_scores": True}).json()
    for body in ({"queries": [q["question"] for q in questions], "topk": 3, "return_scores": False}, {"queries": [q["question"] for q in questions], "topk": 3}):
        r = _post(retriever_server.url, body)
        assert r.status_code == 200, r.text
        result = r.json()["result"]
        assert len(result) == n_queries
        for plain, scored in zip(result, with_scores["result"]):
            assert [set(d) for d in plain] == [{"id", "contents"}] * 3
            assert plain == [h["document"] for h in scored]


def test_default_topk_and_concurrent_requests_with_different_topk(retriever_server, retriever_index):
    q = retriever_index.questions[1]["question"]
    assert len(_post(retriever_server.url, {"queries": [q]}).json()["result"][0]) == 3  # server --topk 3
    results = {}

    def ask(k):
        results[k] = _post(retriever_server.url, {"queries": [q], "topk": k, "return_scores": True}).json()["result"][0]

    threads = [threading.Thread(target=ask, args=(k,)) for k in (1, 5, 10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [len(results[k]) for k in (1, 5, 10)] == [1, 5, 10]
    assert [h["document"]["id"] for h in results[10][:5]] == [h["document"]["id"] for h in results[5]]


BAD_INPUTS = [
    (b"", 400, "empty body"),
    (b"{not json", 400, "not valid JSON"),
    (b"\xff\xfe", 400, "not valid JSON"),
    (b"[1, 2]", 422, "JSON object"),
    ({}, 422, "missing field 'queries'"),
    ({"query": ["x"]}, 422, "unknown field"),
    ({"queries": "who wrote hamlet"}, 422, "single string"),
    ({"queries": {"a": 1}}, 422, "list of strings"),
    ({"queries": []}, 422, "empty"),
    ({"queries": ["ok", ""]}, 422, r"queries\[1\] is empty"),
    ({"queries": ["   "]}, 422, r"queries\[0\] is empty"),
    ({"queries": ["ok", 7]}, 422, r"queries\[1\] must be a string"),
    ({"queries": [None]}, 422, r"queries\[0\] must be a string"),
    ({"queries": ["x" * 2001]}, 422, "2001 characters"),
    ({"queries": ["x"] * 4097}, 413, "too many queries"),
    ({"queries": ["x"], "topk": 0}, 422, "between 1 and 100"),
    ({"queries": ["x"], "topk": 101}, 422, "between 1 and 100"),
    ({"queries": ["x"], "topk": -3}, 422, "between 1 and 100"),
    ({"queries": ["x"], "topk": "3"}, 422, "'topk' must be an integer"),
    ({"queries": ["x"], "topk": 2.5}, 422, "'topk' must be an integer"),
    ({"queries": ["x"], "topk": True}, 422, "'topk' must be an integer"),
    ({"queries": ["x"], "return_scores": "yes"}, 422, "'return_scores' must be true or false"),
]


@pytest.mark.parametrize("body,status,message", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_input_gets_4xx_with_a_message(retriever_server, body, status, message):
    r = _post(retriever_server.url, body)
    assert r.status_code == status, r.text
    assert re.search(message, r.json()["detail"]), r.json()


def test_oversized_body_is_rejected_and_server_keeps_serving(retriever_server):
    big = json.dumps({"queries": ["x" * 1000] * 5000}).encode()  # ~5 MB > 4 MiB limit
    r = _post(retriever_server.url, big)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["detail"]
    assert _post(retriever_server.url, {"queries": ["still alive?"]}).status_code == 200


def test_sixty_four_concurrent_clients_get_their_own_results(retriever_server, retriever_index):
    questions = [q["question"] for q in retriever_index.questions[:64]]
    # Reference: the same queries one request at a time, sequentially.
    with RetrieverClient(retriever_server.url) as client:
        expected = [client.retrieve([q], topk=3)[0] for q in questions]
    count_before, singles_before = _batch_counts(retriever_server.url)
    errors: list[str] = []
    barrier = threading.Barrier(len(questions))

    def worker(i: int) -> None:
        with httpx.Client(base_url=retriever_server.url, timeout=120) as http:  # one connection per client
            barrier.wait()
            for _round in range(3):
                r = http.post("/retrieve", json={"queries": [questions[i]], "topk": 3, "return_scores": True})
                if r.status_code != 200:
                    errors.append(f"client {i}: HTTP {r.status_code} {r.text}")
                    return
                got = r.json()["result"]
                if len(got) != 1:
                    errors.append(f"client {i}: {len(got)} result lists for 1 query")
                    return
                ids = [h["document"]["id"] for h in got[0]]
                if ids != [h["id"] for h in expected[i]]:
                    errors.append(f"client {i}: got {ids}, expected {[h['id'] for h in expected[i]]}")
                for h, e in zip(got[0], expected[i]):
                    if abs(h["score"] - e["score"]) > 1e-4:
                        errors.append(f"client {i}: score {h['score']} != {e['score']}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    # The batches really mixed requests: every request held one query, so a batch of more than
    # one query joined several requests.
    count, singles = _batch_counts(retriever_server.url)
    assert singles - singles_before < count - count_before


def _batch_counts(url: str) -> tuple[int, int]:
    """(micro-batches so far, of which held a single query) from /metrics."""
    metrics = httpx.get(url + "/metrics").text
    count = int(re.search(r"^retriever_batch_size_count (\d+)", metrics, re.M).group(1))
    singles = int(re.search(r'^retriever_batch_size_bucket\{le="1"\} (\d+)', metrics, re.M).group(1))
    return count, singles


def test_health_metrics_and_openapi(retriever_server, retriever_index):
    h = httpx.get(retriever_server.url + "/health")
    assert h.status_code == 200
    info = h.json()["index"]
    assert info["rows"] == retriever_index.rows and info["encoder"] == "minilm" and info["dim"] == 384
    m = httpx.get(retriever_server.url + "/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    for name in ("retriever_requests_total", "retriever_queries_total", "retriever_batch_size_bucket", "retriever_batch_seconds_bucket", "retriever_request_latency_seconds_bucket", "retriever_errors_total"):
        assert name in m.text
    spec = httpx.get(retriever_server.url + "/openapi.json").json()
    body_schema = spec["paths"]["/retrieve"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(body_schema["properties"]) == {"queries", "topk", "return_scores"}
    assert "/health" in spec["paths"] and "/metrics" in spec["paths"]


def test_metrics_say_where_a_requests_time_went(retriever_server):
    """Queue wait per request, worker time per stage, delivery lag per batch: they count what was served."""

    def series(text: str, name: str) -> float:
        return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))

    url = retriever_server.url
    before = httpx.get(url + "/metrics").text
    with RetrieverClient(url) as client:
        for q in ("who wrote hamlet", "capital of france", "when did the titanic sink"):
            client.retrieve([q], topk=2)
    after = httpx.get(url + "/metrics").text
    grew = lambda name: series(after, name) - series(before, name)  # noqa: E731
    assert grew("retriever_queue_wait_seconds_count") == 3
    assert grew("retriever_delivery_lag_seconds_count") == grew("retriever_batch_size_count") >= 1
    assert grew('retriever_stage_seconds_total{stage="encode"}') > 0
    assert grew('retriever_stage_seconds_total{stage="search"}') > 0 and grew('retriever_stage_seconds_total{stage="lookup"}') > 0
    assert grew("retriever_gather_wait_seconds_total") >= 0
    # the stages happen inside the batches the worker timed
    stages = sum(grew(f'retriever_stage_seconds_total{{stage="{s}"}}') for s in ("encode", "search", "lookup"))
    assert stages <= grew("retriever_batch_seconds_sum") + 1e-5


def test_keepalive_connection_survives_a_bad_request(retriever_server):
    """Search-R1 drops the kept-alive connection after its 500; a pooled client then fails."""
    with httpx.Client(base_url=retriever_server.url, timeout=60) as http:
        bad = http.post("/retrieve", json={"queries": []})
        assert bad.status_code == 422 and bad.headers.get("connection", "").lower() != "close"
        assert http.post("/retrieve", json={"queries": ["after the error"]}).status_code == 200
