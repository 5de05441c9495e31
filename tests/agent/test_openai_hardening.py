"""The OpenAI-compatible endpoint never stalls or fails the generation server (issue 46), against a real
``emapg engine serve`` (transformers engine, the tiny tool-call searcher), real HTTP and real sockets.

* E1: JSON nested inside fields (tool-call ``arguments`` 5,000 deep) is a 4xx naming the field, not a 500.
* E2: a request of 1,024 messages x 60 KB is refused by the character bound before any templating, and
  ``/health`` answers while it is in flight; a large prompt under the bound is tokenized in the bounded worker
  threads while ``/health`` answers; the workers' bound refuses (503, Retry-After) what would wait beyond it.
* E3: a session refused for room (429) costs no generation: the engine's generated-token counter is unchanged.
* E4: the session byte budget refuses (429 with Retry-After) a call that could pass it; nothing is evicted.
* O1: connection-guard closes (header timeout, body timeout) are counted in /metrics and logged once per minute.

Ordering, not timing: "answered while in flight" is shown by the order of events (the big request's answer
had not arrived, or the server still counted it as being prepared), never by a duration.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
import uuid
from urllib.parse import urlsplit

import httpx
import pytest

from agent.engines.launch import EngineServer
from agent.recorded_sessions import ID_BYTES, expected_call_nbytes
from tests.fixtures.http_checks import hold_open, raw_exchange, strict_json

KEY = "hardening-v1-key"
H = {"Authorization": f"Bearer {KEY}"}
MAX_CHARS = 3_000_000  # raised from the derived default so a 2 MB prompt reaches the tokenizer (in a worker)
BUDGET = 1 << 20


@pytest.fixture(scope="module")
def server(tool_searcher_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("openai-hardening") / "server.log"
    args = ["--openai-max-sessions", "3", "--openai-session-memory-mb", "1", "--openai-max-prompt-chars", str(MAX_CHARS),
            "--prep-workers", "1", "--prep-max-waiting", "1", "--header-timeout", "2", "--body-timeout", "3"]
    with EngineServer(tool_searcher_dir, engine="hf", api_key=KEY, max_model_len=2048, log_path=log, extra_args=args) as s:
        yield s


def _metrics(server) -> dict:
    return httpx.get(server.url + "/metrics", headers=H, timeout=60).json()


def _chat(server, body: dict, session: str | None = None, timeout: float = 300) -> httpx.Response:
    headers = {**H, **({"X-Session-Id": session} if session else {})}
    return httpx.post(server.url + "/v1/chat/completions", content=json.dumps(body).encode(),
                      headers={**headers, "content-type": "application/json"}, timeout=timeout)


def _completion(server, body: dict, session: str | None = None) -> httpx.Response:
    headers = {**H, **({"X-Session-Id": session} if session else {})}
    return httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=300)


def _delete_all(server, sids) -> None:
    for sid in sids:
        httpx.delete(f"{server.url}/v1/sessions/{sid}", headers=H, timeout=60)


USER = {"role": "user", "content": "what is the capital of france"}


def _with_call(arguments) -> dict:
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": arguments}}
    return {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "Paris"}], "max_tokens": 2}


def test_nested_tool_arguments_are_a_4xx_naming_the_field(server):
    """Before: ``arguments = '{"a":' * 5000 + '1' + '}' * 5000`` answered 500 "internal error: RecursionError"."""
    where = "messages[1].tool_calls[0].function.arguments"
    before = _metrics(server)["errors"]
    cases = [
        ('{"a":' * 5000 + "1" + "}" * 5000, "is nested more than 64 levels deep"),  # the report's request
        ("[" * 65 + "]" * 65, "is nested more than 64 levels deep"),  # just past the bound
        ('{"q": "\\ud800"}', "is not valid Unicode"),  # a lone surrogate, escaped inside the string
        ('{"q": NaN}', "NaN is not a JSON number"),
        ('{"q": 1, "q": 2}', "appears twice"),
        ('{"q": ' + "1" * 5000 + "}", "digits is out of range"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"q": "x"', "is not a JSON string"),
    ]
    for arguments, needle in cases:
        r = _chat(server, _with_call(arguments))
        assert r.status_code == 422, (arguments[:40], r.text)
        detail = strict_json(r.text)["detail"]
        assert where in detail and needle in detail, (arguments[:40], detail)
    # the same nesting as an object in the body (the body parser allows ~1,000 levels) and in a tool's schema
    deep = json.loads("[" * 500 + "]" * 500)
    r = _chat(server, _with_call({"q": deep}))
    assert r.status_code == 422 and f"{where} is nested more than 64" in r.json()["detail"], r.text
    tool = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": deep}}}
    r = _chat(server, {"messages": [USER], "tools": [tool], "max_tokens": 2})
    assert r.status_code == 422 and "tools[0].function.parameters is nested more than 64" in r.json()["detail"], r.text
    r = _chat(server, {"messages": [USER, {"role": "assistant", "tool_calls": [
        {"id": deep, "function": {"name": "search", "arguments": "{}"}}]}]})
    assert r.status_code == 422 and "messages[1].tool_calls[0].id must be a string" in r.json()["detail"], r.text
    after = _metrics(server)["errors"]
    assert after.get("internal", 0) == before.get("internal", 0)
    assert after["invalid_field"] == before.get("invalid_field", 0) + len(cases) + 3
    ok = _chat(server, _with_call('{"query": "capital of France"}'))  # a well-formed call of the same shape is served
    assert ok.status_code == 200, ok.text


def _huge_chat_body() -> bytes:
    """1,024 messages of 60 KB (61 MB of JSON, under the 64 MiB body limit)."""
    content = ("The quick brown fox jumps over the lazy dog. " * 1400)[:60_000]
    return json.dumps({"messages": [{"role": "user", "content": content}] * 1024, "max_tokens": 2}).encode()


def test_health_answers_while_a_huge_request_is_in_flight_and_it_is_refused_before_templating(server):
    """Before: 1,024 messages x 60 KB were templated and tokenized on the event loop (/health stalled 53.6 s), then
    refused (422) for the context anyway. Now the character bound refuses them before templating; and /health is
    answered while the request is in flight (all but its last byte sent: it cannot have been answered yet)."""
    body = _huge_chat_body()
    before = _metrics(server)
    parts = urlsplit(server.url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=120)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    try:
        sock.sendall(head + body[:-1])
        health = httpx.get(server.url + "/health", timeout=60)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert select.select([sock], [], [], 0)[0] == []  # the big request has no answer yet
        sock.sendall(body[-1:])
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + int(
                data.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]):
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
    finally:
        sock.close()
    status = int(data.split(b" ", 2)[1])
    detail = strict_json(data.split(b"\r\n\r\n", 1)[1])["detail"]
    assert status == 422 and f"characters, more than the limit of {MAX_CHARS} (--openai-max-prompt-chars)" in detail, detail
    assert int(detail.split("the messages and tools hold ", 1)[1].split(" ", 1)[0]) >= 1024 * 60_000
    after = _metrics(server)
    assert after["errors"]["prompt_too_long"] == before["errors"].get("prompt_too_long", 0) + 1
    assert after["prep"]["done"] == before["prep"]["done"]  # never templated nor tokenized
    assert after["tokens"] == before["tokens"]


def _poll(server, predicate, what: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = _metrics(server)
        if predicate(m):
            return m
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_large_prompts_are_tokenized_off_the_event_loop_within_a_bound(server):
    """A 2 MB prompt under the character bound is tokenized in a worker thread (seconds on this tokenizer): while it
    is, /health answers; one more large request waits (--prep-max-waiting 1), the next is refused at once."""
    big = {"prompt": "capital of france " * 110_000, "max_tokens": 2}  # 1.98 M characters
    answers: dict[str, httpx.Response] = {}
    threads = {name: threading.Thread(target=lambda n=name: answers.__setitem__(n, _completion(server, big))) for name in ("a", "b")}
    before = _metrics(server)
    threads["a"].start()
    _poll(server, lambda m: m["prep"]["pending"] == 1, "the first large prompt in the worker")
    health = httpx.get(server.url + "/health", timeout=60)
    assert health.status_code == 200
    threads["b"].start()
    _poll(server, lambda m: m["prep"]["pending"] == 2, "the second large prompt waiting")
    assert "a" not in answers  # /health was answered while the first was still being tokenized
    third = _completion(server, big)
    assert third.status_code == 503 and third.headers["retry-after"] == "1" and "--prep-max-waiting 1" in third.json()["detail"]
    for t in threads.values():
        t.join(timeout=600)
    for name in ("a", "b"):  # tokenized, then refused for the context
        assert answers[name].status_code == 422 and "the model's context is 2048" in answers[name].json()["detail"]
    after = _metrics(server)
    assert after["prep"]["done"] == before["prep"]["done"] + 2 and after["prep"]["refused"] == before["prep"]["refused"] + 1
    assert after["errors"]["busy"] == before["errors"].get("busy", 0) + 1 and after["tokens"] == before["tokens"]


def test_a_429_from_a_full_session_store_costs_no_generation(server):
    """Before: the session cap was checked when the call was recorded, after it was sampled."""
    sids = [f"cap-{i}-{uuid.uuid4().hex[:6]}" for i in range(4)]
    try:
        for sid in sids[:3]:  # --openai-max-sessions 3
            assert _chat(server, {"messages": [USER], "max_tokens": 3}, session=sid).status_code == 200
        before = _metrics(server)
        assert before["sessions"]["open"] == 3
        r = _chat(server, {"messages": [USER], "max_tokens": 3}, session=sids[3])
        assert r.status_code == 429 and "3 sessions are open" in r.json()["detail"]
        assert int(r.headers["retry-after"]) >= 1
        after = _metrics(server)
        assert after["tokens"] == before["tokens"] and after["steps"] == before["steps"] and after["prompts"] == before["prompts"]
        assert after["errors"]["too_many_sessions"] == before["errors"].get("too_many_sessions", 0) + 1
        assert after["sessions"]["open"] == 3 and after["sessions"]["reserved_bytes"] == 0
        assert httpx.get(f"{server.url}/v1/sessions/{sids[3]}", headers=H).status_code == 404  # nothing was opened
    finally:
        _delete_all(server, sids)


def test_the_session_byte_budget_refuses_with_retry_after_and_evicts_nothing(server):
    """--openai-session-memory-mb 1: calls of 1,900-token prompts fill it; the call that could pass it is refused
    (429, Retry-After) before it is sampled, the sessions already held stay whole, and deleting one makes room."""
    prompt = [5 + i % 400 for i in range(1900)]
    sids = [f"bytes-{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    calls = 0
    try:
        while True:
            before = _metrics(server)
            r = _completion(server, {"prompt": prompt, "max_tokens": 1}, session=sids[calls % 2])
            if r.status_code != 200:
                break
            calls += 1
            assert calls < 40, "the byte budget never refused"
        after = _metrics(server)
        assert r.status_code == 429 and "the session memory budget is in use" in r.json()["detail"], r.text
        assert int(r.headers["retry-after"]) >= 1 and after["errors"]["session_memory"] >= 1
        assert after["tokens"] == before["tokens"]  # refused before sampling
        held = after["sessions"]
        assert held["max_bytes"] == BUDGET and held["bytes"] <= BUDGET and held["calls"] == calls and held["open"] == 2
        need = expected_call_nbytes(1900, 1, request_bytes=16, reply_bytes=0)
        assert held["bytes"] + need > BUDGET and calls * ID_BYTES * 1901 <= held["bytes"]  # refused because it could not fit
        for sid in sids:  # nothing was evicted: every recorded call is still there
            assert len(httpx.get(f"{server.url}/v1/sessions/{sid}", headers=H).json()["calls"]) in (calls // 2, calls - calls // 2)
        httpx.delete(f"{server.url}/v1/sessions/{sids[0]}", headers=H)
        assert _completion(server, {"prompt": prompt, "max_tokens": 1}, session=sids[1]).status_code == 200
    finally:
        _delete_all(server, sids)


def test_connection_guard_closes_are_counted_and_logged_once_a_minute(server):
    """Before: header-timeout and idle-cap closes were logged at DEBUG only and counted nowhere."""
    before = _metrics(server)["connection_closes"]
    assert set(before) >= {"header_timeout", "idle_timeout", "idle_cap", "oversized_headers", "body_timeout"}
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    answers = [None, None]

    def stall(i: int) -> None:
        answers[i] = hold_open(server.url, head, trickle=b"X-Slow: aaaa", every_s=0.2, wait_s=15)

    threads = [threading.Thread(target=stall, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(a.status == 408 for a in answers), answers
    stalled_body = raw_exchange(server.url, "/v1/completions", b'{"prompt": "x', declared_length=200, headers=H, wait_s=30)
    assert stalled_body.status == 408
    after = _metrics(server)["connection_closes"]
    assert after["header_timeout"] == before["header_timeout"] + 2 and after["body_timeout"] == before["body_timeout"] + 1
    deadline = time.monotonic() + 10
    while "(body_timeout)" not in server.log_path.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.05)
    log = server.log_path.read_text(errors="replace")
    lines = [line for line in log.splitlines() if "emapg.connection_guard" in line and "(header_timeout)" in line]
    assert len(lines) == 1 and " INFO " in lines[0], lines  # two closes within a minute: one line
    assert sum("(body_timeout)" in line and " INFO " in line for line in log.splitlines()) == 1


def test_new_options_are_refused_out_of_range_naming_them(capsys):
    from app.cli import main as emapg_main

    for flag, value in (("--openai-session-memory-mb", "0"), ("--openai-max-messages", "0"), ("--openai-max-prompt-chars", "0"),
                        ("--prep-workers", "0"), ("--prep-max-waiting", "-1")):
        assert emapg_main(["engine", "serve", "--model", "tiny-qwen2", "--engine", "hf", flag, value]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and flag.lstrip("-").replace("-", "_") in err.replace("-", "_"), (flag, err)
    for value in ("nan", "inf", "1.5"):  # not integers: argparse's usage, then one line naming the flag
        with pytest.raises(SystemExit) as e:
            emapg_main(["engine", "serve", "--model", "tiny-qwen2", "--openai-session-memory-mb", value])
        assert e.value.code == 2
        assert f"argument --openai-session-memory-mb: invalid int value: '{value}'" in capsys.readouterr().err.splitlines()[-1]
