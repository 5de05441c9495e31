"""``POST /score`` against the largest answers its default limits allow and against clients that leave: the event loop
stays free (``/health`` answers throughout) and an abandoned score stops and frees the engine. Real servers (``emapg
engine serve``, transformers engine), real HTTP; the timings are printed, the claims are in benchmarks/hardening_round4.py.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from agent.engines.launch import EngineServer

KEY = "score-fuzz-key"
H = {"Authorization": f"Bearer {KEY}"}


def health_during(url: str, send) -> tuple[list[float], object]:
    """Poll ``GET /health`` every 50 ms on a kept-alive connection while ``send()`` runs in a thread; the latencies of
    the answers that came while it ran, and what it returned."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(value=send()))
    latencies: list[float] = []
    with httpx.Client(timeout=60) as client:
        client.get(url + "/health")
        thread.start()
        while thread.is_alive():
            t0 = time.perf_counter()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)
    thread.join()
    return latencies, result.get("value")


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("score-fuzz") / "server.log"
    with EngineServer(tiny_model_dir, engine="hf", api_key=KEY, max_model_len=4096, log_path=log) as s:
        yield s


def test_health_answers_during_the_largest_topk_score(tiny_server):
    """``topk`` 1024 over 4 x 4,095 tokens (16.8 M values, the default --max-score-values allows it) once left
    /health unanswered for 13.9 s: the answer was built and encoded on the event loop. Now it is built in a worker,
    and /health keeps answering while it is."""
    ids = [[(7 * i + j) % 2000 + 3 for j in range(4095)] for i in range(4)]

    def send():
        size, head = 0, b""
        with httpx.Client(timeout=600) as c, c.stream("POST", tiny_server.url + "/score", headers=H,
                                                      json={"token_ids": ids, "start": [1] * 4, "topk": 1024}) as r:
            for chunk in r.iter_bytes():
                head = head or chunk[:64]
                size += len(chunk)
            return r.status_code, size, head

    latencies, (status, size, head) = health_during(tiny_server.url, send)
    print(f"\n/score topk 1024 x 4 x 4095: {size / 2**20:.0f} MiB; /health answered {len(latencies)} times, slowest "
          f"{max(latencies):.3f} s")
    assert status == 200 and head.startswith(b'{"logprobs":[[') and size > 100 << 20
    assert len(latencies) >= 3  # it answered while the score was computed, built and sent


def test_a_large_body_of_token_ids_is_parsed_off_the_loop(tiny_server):
    """A 38 MiB body of token ids (parsed and checked on the event loop, it left /health unanswered for 7.1 s); its
    last id is past the vocabulary, so it is refused once parsed and checked (the case times the parsing, not a score)."""
    rows = [[1000 + (i * 7 + j) % 999 for j in range(4095)] for i in range(1624)]
    rows[-1][-1] = 10**6
    body = json.dumps({"token_ids": rows, "start": [1] * len(rows)}).encode()

    def send():
        return httpx.post(tiny_server.url + "/score", content=body, timeout=600,
                          headers={**H, "content-type": "application/json"}).status_code

    latencies, status = health_during(tiny_server.url, send)
    print(f"\n/score 1624 x 4095 ids ({len(body) / 2**20:.0f} MiB): {status}; /health slowest {max(latencies):.3f} s")
    assert status == 422 and len(latencies) >= 1


def test_the_score_budget_refuses_what_would_exceed_it():
    """Answers being built hold at most --max-score-values values together: a second answer that would pass the bound
    is refused at once (503, Retry-After), never queued holding its memory; one answer alone always fits (its size
    was checked against the same bound: 413); the budget is given back however the request ends."""
    from agent.engines.server import ScoreBudget
    from emapg.server_input import HTTPError

    budget = ScoreBudget(100)
    with budget.holding(100):
        with pytest.raises(HTTPError) as refused:
            with budget.holding(1):
                pass
        assert refused.value.status == 503 and refused.value.retry_after == 1 and "--max-score-values" in refused.value.message
    with budget.holding(60), budget.holding(40):
        assert budget.held == 100
    with pytest.raises(RuntimeError), budget.holding(70):
        raise RuntimeError("the engine failed")
    assert budget.held == 0


def test_a_score_whose_client_left_stops_and_frees_the_engine(smollm2_dir, tmp_path):
    """The outside run's defect: a 1-token chat call waited 62 s behind an abandoned 8 x 4,095-token score. Now the
    server notices the client left, the engine stops between layers, and the next call runs (the counter says the
    score was stopped, not finished)."""
    with EngineServer(smollm2_dir, engine="hf", api_key=KEY, max_model_len=4096, log_path=tmp_path / "server.log") as s:
        body = json.dumps({"token_ids": [[(11 * i + j) % 40000 + 5 for j in range(4095)] for i in range(8)],
                           "start": [1] * 8}).encode()
        host, port = s.url.split("//")[1].split(":")
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /score HTTP/1.1\r\nHost: " + host.encode() + b"\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(3)  # the score is running in the engine
        sock.close()  # the client goes away
        t0 = time.perf_counter()
        r = httpx.post(s.url + "/generate", headers=H, timeout=600,
                       json={"prompts": [[5, 6, 7]], "params": {"max_tokens": 1, "temperature": 0}})
        waited = time.perf_counter() - t0
        metrics = httpx.get(s.url + "/metrics", headers=H).json()
    print(f"\n1-token /generate after an abandoned 8 x 4095 score: {waited:.2f} s")
    assert r.status_code == 200 and len(r.json()["outputs"][0]["token_ids"]) == 1
    assert metrics["scores_stopped"] == 1 and metrics["errors"].get("client_disconnected") == 1, metrics
