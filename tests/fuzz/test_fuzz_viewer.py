"""``emapg view`` over damaged and hostile run folders: what a killed trainer, a full disk, a hand edit or a crafted
record leaves must never make an API route answer 5xx, block, or stall the viewer; what was skipped is counted.

Real parts: the viewer's FastAPI app over real files (a named pipe, symlinks, bytes cut mid-character), and the
``emapg view`` command as a real process on real sockets for the header timeout, the loopback host check and SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from app.viewer.runs import open_runs
from app.viewer.server import HEADER_TIMEOUT_S, create_app
from app.viewer.trajectory import gold_spans
from emapg.servers import free_port

REPO = Path(__file__).resolve().parents[2]
GOOD_SAMPLE = {"step": 1, "question": "who?", "golds": ["Paris"], "response": "<answer>Paris</answer>", "reward": 1.0}
GOOD_ITEM = {"id": "nq/7", "question": "capital of france?", "golds": ["Paris"], "prediction": "Paris",
             "response": "<answer>Paris</answer>", "scores": {"em": 1.0}, "searches": 0}

#: Damaged lines, each one record the readers must skip (and count), in every JSON-lines file of a run.
BAD_LINES = {
    "torn UTF-8": '{"step": 9, "question": "caf\u00e9"}'.encode()[:-3],  # ends inside the two bytes of "\u00e9"
    "not JSON": b"{this is not json",
    "not an object": b"[1, 2, 3]",
    "a bare number": b"42",
    "deep nesting": b'{"step": 1, "x": ' + b"[" * 200 + b"]" * 200 + b"}",
    "lone surrogate escape": b'{"step": 1, "question": "\\ud800"}',
    "huge integer": b'{"step": ' + b"9" * 5000 + b"}",
    "step is text": b'{"step": "abc"}',
    "step is a list": b'{"step": [1]}',
    "step is true": b'{"step": true}',
    "invalid UTF-8": b'{"step": 1, "q": "\xff\xfe"}',
}
#: Records that parse but have fields of the wrong types: skipped where they cannot be summarized.
BAD_ITEMS = [{"id": "a", "samples": "not a list"}, {"id": "b", "scores": [1, 2]}, {"id": "c", "searches": "many"},
             {"id": "d", "samples": {"0": 1}}, {"id": "e", "golds": 5}, {"id": "f", "searches": [1]}]
BAD_SAMPLES = [{"step": 1, "segments": "oops"}, {"step": 1, "golds": 5, "response": "x"}, {"step": 1, "segments": [1, 2]},
               {"step": 1, "queries": 3, "response": "x"}]


def _lines(records: list[dict], bad: dict[str, bytes]) -> bytes:
    good = b"".join(json.dumps(r).encode() + b"\n" for r in records)
    return good + b"".join(line + b"\n" for line in bad.values())


def damaged_train_run(root: Path) -> Path:
    """A training run with a torn UTF-8 line, a bare NaN record and a named pipe as its metrics.jsonl."""
    run = root / "train"
    run.mkdir()
    os.mkfifo(run / "metrics.jsonl")  # a reader that opens it waits forever for a writer
    nan = b'{"step": 1, "reward": NaN, "advantage": -Infinity, "question": "nan?", "golds": ["x"], "response": "x"}\n'
    (run / "samples.jsonl").write_bytes(_lines([GOOD_SAMPLE, *BAD_SAMPLES], BAD_LINES) + nan + b'{"step": 2, "question": "caf\xc3')
    (run / "guard.jsonl").write_bytes(_lines([{"step": 1, "action": "warn", "reason": "kl"}], BAD_LINES))
    return run


def damaged_eval_run(root: Path) -> Path:
    run = root / "eval"
    (run / "items").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    (run / "items" / "nq.jsonl").write_bytes(_lines([GOOD_ITEM, *BAD_ITEMS], BAD_LINES))
    os.mkfifo(run / "items" / "pipe.jsonl")
    (run / "items" / "folder.jsonl").mkdir()
    (run / "items" / "outside.jsonl").symlink_to("/etc/passwd")
    (run / "results.json").write_bytes(b'{"model": "m", "average": NaN')  # torn
    return run


@pytest.fixture
def damaged(tmp_path):
    return damaged_train_run(tmp_path), damaged_eval_run(tmp_path)


def test_a_damaged_run_folder_answers_200_and_counts_what_it_skipped(damaged):
    """The outside run's defects: one malformed record in any run made GET /api/runs answer 500 (15 of 24 kinds), a
    named pipe as metrics.jsonl hung it forever, a bare NaN made the samples route answer 500."""
    train, ev = damaged
    client = TestClient(create_app(open_runs([train, ev]), allowed_hosts=["testserver"]))
    done: dict = {}
    thread = threading.Thread(target=lambda: done.update(r=client.get("/api/runs")), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "GET /api/runs blocked (a named pipe was opened?)"
    r = done["r"]
    assert r.status_code == 200, r.text
    runs = {x["label"]: x for x in r.json()}
    t, e = runs["train"], runs["eval"]
    assert t["problems"]["metrics.jsonl"]["unreadable"].startswith("not a regular file")
    assert t["problems"]["samples.jsonl"]["skipped"] == len(BAD_LINES) + 1  # + the torn last line
    assert t["problems"]["guard.jsonl"]["skipped"] == len(BAD_LINES)
    assert t["sample_steps"] == 1 and t["skipped_records"] == 2 * len(BAD_LINES) + 1 and t["unreadable_files"] == 1
    step_typed = sum(k.startswith("step is") for k in BAD_LINES)
    assert e["datasets"] == ["nq"]  # the pipe, the folder and the link out are not datasets
    assert e["questions"] == 1 + step_typed  # a question needs no step
    assert e["problems"]["items/nq.jsonl"]["skipped"] == len(BAD_LINES) - step_typed + len(BAD_ITEMS)
    assert e["problems"]["results.json"]["skipped"] == 1
    samples = client.get(f"/api/runs/{t['id']}/samples").json()
    assert samples["step"] == 1 and samples["skipped"] == len(BAD_SAMPLES)
    nan = [s for s in samples["samples"] if s["question"] == "nan?"]
    assert nan and nan[0]["reward"] is None and nan[0]["advantage"] is None  # the NaN record is shown, NaN as missing
    assert "NaN" not in client.get(f"/api/runs/{t['id']}/samples").text
    metrics = client.get(f"/api/runs/{t['id']}/metrics")
    assert metrics.status_code == 200 and metrics.json()["records"] == [] and len(metrics.json()["guard"]) == 1


def test_every_route_over_damaged_runs_answers_without_5xx(damaged):
    train, ev = damaged
    client = TestClient(create_app(open_runs([train, ev]), allowed_hosts=["testserver"]))
    ids = {x["label"]: x["id"] for x in client.get("/api/runs").json()}
    t, e = ids["train"], ids["eval"]
    urls = [f"/api/runs/{t}/metrics", f"/api/runs/{t}/metrics?since=-99999999999", f"/api/runs/{t}/samples?step=2",
            f"/api/runs/{t}/samples?step=-1", f"/api/runs/{t}/samples?step=99999999999999999999",
            f"/api/runs/{e}/items", f"/api/runs/{e}/items?dataset=pipe", f"/api/runs/{e}/items?outcome=wrong&searches=0",
            f"/api/runs/{e}/items/nq/a", f"/api/runs/{e}/items/nq/b", f"/api/runs/{e}/items/pipe/x",
            f"/api/runs/{e}/items/outside/x", f"/api/runs/{e}/items/nq/..%2F..%2Fetc%2Fpasswd", f"/api/compare?a={e}&b={e}",
            f"/api/runs/{e}/items/nq/%E2%80%AE", "/api/runs/9/metrics", "/api/health"]
    for url in urls:
        r = client.get(url)
        assert r.status_code < 500, (url, r.status_code, r.text[:300])


def test_an_item_id_with_a_slash_opens(damaged):
    _, ev = damaged
    client = TestClient(create_app(open_runs([ev]), allowed_hosts=["testserver"]))
    r = client.get("/api/runs/0/items/nq/" + "nq%2F7")  # the page sends encodeURIComponent(id)
    assert r.status_code == 200 and r.json()["id"] == "nq/7" and r.json()["right"]


def test_bidirectional_controls_are_shown_as_code_points(tmp_path):
    """Model text with U+202E (right-to-left override) would reorder the labels around it in the page."""
    run = tmp_path / "run"
    run.mkdir()
    sample = {**GOOD_SAMPLE, "response": "<answer>Paris\u202e reward: 0 \u2066x\u2069</answer>", "question": "q\u200f?"}
    (run / "samples.jsonl").write_text(json.dumps(sample) + "\n")
    body = TestClient(create_app(open_runs([run]), allowed_hosts=["testserver"])).get("/api/runs/0/samples").text
    assert "[U+202E]" in body and "[U+2066]" in body and "[U+200F]" in body
    assert not any(c in json.loads(body).__repr__() for c in "\u202e\u2066\u2069\u200f")


def _regex_spans(text: str, golds: list[str]) -> list[tuple[int, int]]:
    """The rule as a regular expression (the viewer's implementation before; backtracking on crafted input)."""
    import re

    found = []
    for gold in {g.strip() for g in golds if g and g.strip()}:
        head = r"(?<!\w)" if re.match(r"\w", gold) else ""
        tail = r"(?!\w)" if re.search(r"\w$", gold) else ""
        found += [m.span() for m in re.finditer(head + r"\s+".join(map(re.escape, gold.split())) + tail, text, re.IGNORECASE)]
    merged: list[tuple[int, int]] = []
    for start, end in sorted(found):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def test_gold_marking_is_linear_on_a_crafted_sample():
    """A 500-word gold over 1 MB of its own words stalled the viewer for 11 s (a backtracking regex); now it is a
    substring search per gold: the same spans as the old rule on ordinary text, and bounded work on the crafted one."""
    cases = [("In 1990 the United\n  States won; united states!", ["United States", "1"]),
             ("gold 1 in 1990 and x1 and (1)", ["1"]), ("C++ and c++x, xc++", ["c++"]), ("a\tb  a b ab", ["A B", " a  b "]),
             ("Doc 1(Title: Paris) Paris is the capital. PARIS!", ["paris", "the capital", "capital."]),
             ("overlap: new york york new york", ["new york", "york new"])]
    for text, golds in cases:
        assert gold_spans(text, golds) == _regex_spans(text, golds), (text, golds)
    words = " ".join(f"w{i}" for i in range(500))
    text = (words + " ") * (1_000_000 // len(words))
    assert gold_spans(text, [words + " extra"]) == []
    assert len(gold_spans(text, [words])) == text.count(words)


def _raw(port: int, payload: bytes, host: str) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=30)
    sock.sendall(payload)
    return sock


def test_the_command_times_out_headers_answers_its_loopback_host_and_stops_on_sigterm(tmp_path):
    """``emapg view --host 127.0.0.2`` answered every request 400 (its own address was not an allowed Host); a
    connection that sends half its headers was held forever; a viewer stuck on a named pipe ignored SIGTERM."""
    train = damaged_train_run(tmp_path)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "view", str(train), "--host", "127.0.0.2", "--port", str(port)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"http://127.0.0.2:{port}/api/runs", timeout=30)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        assert r.status_code == 200 and r.json()[0]["problems"]["metrics.jsonl"]["unreadable"]
        assert httpx.get(f"http://127.0.0.2:{port}/", headers={"Host": "evil.example"}, timeout=30).status_code == 400
        half = _raw(port, b"GET /api/runs HTTP/1.1\r\nHost: 127.0.0.2\r\nX-Slow:", "127.0.0.2")
        t0 = time.monotonic()
        answer = half.recv(4096)  # the server closes it at the header deadline (408), instead of holding it
        held = time.monotonic() - t0
        half.close()
        assert answer.startswith(b"HTTP/1.1 408") and held < 3 * HEADER_TIMEOUT_S, (answer[:80], held)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn shuts down, then re-raises the signal it caught
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_shared_jsonl_reader_skips_a_line_torn_mid_character(tmp_path):
    """emapg.jsonl.read_jsonl (the trainer's guard events and metrics) decoded the whole file first: a line cut inside a
    UTF-8 character made the file unreadable. Lines are decoded one by one now, and U+2028 inside a string is no line end."""
    from emapg.jsonl import parse_lines, read_jsonl

    path = tmp_path / "guard.jsonl"
    path.write_bytes(b'{"step": 1, "reason": "caf\xc3\xa9 \xe2\x80\xa8 ok"}\n{"step": 2, "reason": "caf\xc3')
    assert read_jsonl(path) == [{"step": 1, "reason": "caf\u00e9 \u2028 ok"}]
    assert parse_lines(b'1\n\n{"a": NaN}\n[' + b"[" * 100_000 + b"\n", parse_constant=lambda _: None) == ([1, {"a": None}], 1)
