"""Issue 57's targets, measured before and after in one run: /health during the largest /score, an abandoned /score,
64 runaway calculator expressions beside 4 good ones, and the viewer on a crafted gold-highlighting sample.

Each case runs against whatever ``agent``/``app``/``emapg`` is importable; ``--before DIR`` (a checkout of the code
before the change, e.g. ``git archive <commit> | tar -x -C DIR``) runs every case there first, in a child process
with ``PYTHONPATH=DIR`` and ``cwd=DIR`` (its servers and tool servers start from it too), then here, and writes the
ratios. Cases:

* ``score_topk``: ``POST /score`` with ``topk`` 1024 over 4 x 4,095 tokens (16.8 M values, within the default
  ``--max-score-values``; tiny-qwen2, transformers engine) while ``GET /health`` is polled every 50 ms: the slowest
  /health answer (the stall);
* ``score_body``: a 38 MiB body of token ids (refused after parsing: its last id is past the vocabulary): the same;
* ``score_abandoned``: an 8 x 4,095-token ``/score`` (SmolLM2-135M) whose client leaves after 3 s, then a 1-token
  ``/generate``: how long that call waits;
* ``calculator``: 64 runaway expressions, and while they run 4 good ones, through the tool box
  (``rollout.tool_timeout_s`` 30): how many good ones answered and how long they waited;
* ``viewer_gold``: the samples page of a run whose sample is 1 MB of ``a a a ...`` with a 500-word gold answer
  ``a a ... a b``, while the viewer's ``/static/view.js`` is polled: the slowest poll.

    python benchmarks/hardening_round4.py --before /tmp/before    # ~6 min on 2 cores
    python benchmarks/hardening_round4.py --cases calculator viewer_gold

Writes ``benchmarks/results/hardening_round4.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

KEY = "hardening-round4"
H = {"Authorization": f"Bearer {KEY}"}
CASES = ("score_topk", "score_body", "score_abandoned", "calculator", "viewer_gold")


def poll_during(url: str, send) -> dict:
    """Poll ``GET url`` every 50 ms on a kept-alive connection while ``send()`` runs in a thread."""
    answer: dict = {}

    def run() -> None:
        t0 = time.perf_counter()
        try:
            answer["status"] = send()
        except httpx.HTTPError as e:
            answer["status"] = f"{type(e).__name__}"
        answer["seconds"] = time.perf_counter() - t0

    thread = threading.Thread(target=run)
    latencies = []
    with httpx.Client(timeout=600) as http:
        http.get(url)
        thread.start()
        while thread.is_alive():
            t0 = time.perf_counter()
            try:
                http.get(url)
            except httpx.HTTPError:
                pass
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)
    thread.join()
    return {**answer, "polls": len(latencies), "poll_max_s": max(latencies, default=0.0)}


def score_cases(cases: list[str]) -> dict:
    from agent.engines.launch import EngineServer
    from emapg.models import resolve_model

    out: dict = {}
    if {"score_topk", "score_body"} & set(cases):
        with EngineServer(resolve_model("tiny-qwen2"), engine="hf", api_key=KEY, max_model_len=4096) as s:
            if "score_topk" in cases:
                ids = [[(7 * i + j) % 2000 + 3 for j in range(4095)] for i in range(4)]

                def topk() -> int:
                    with httpx.Client(timeout=600) as c, c.stream("POST", s.url + "/score", headers=H,
                                                                  json={"token_ids": ids, "start": [1] * 4, "topk": 1024}) as r:
                        for _ in r.iter_bytes():
                            pass
                        return r.status_code

                out["score_topk"] = poll_during(s.url + "/health", topk)
            if "score_body" in cases:
                rows = [[1000 + (i * 7 + j) % 999 for j in range(4095)] for i in range(1624)]
                rows[-1][-1] = 10**6  # past the vocabulary: refused once parsed, so the case times the parsing
                body = json.dumps({"token_ids": rows, "start": [1] * len(rows)}).encode()
                out["score_body"] = {"body_mib": len(body) / 2**20, **poll_during(s.url + "/health", lambda: httpx.post(
                    s.url + "/score", content=body, timeout=600, headers={**H, "content-type": "application/json"}).status_code)}
    if "score_abandoned" in cases:
        with EngineServer(resolve_model("smollm2-135m-instruct"), engine="hf", api_key=KEY, max_model_len=4096) as s:
            body = json.dumps({"token_ids": [[(11 * i + j) % 40000 + 5 for j in range(4095)] for i in range(8)],
                               "start": [1] * 8}).encode()
            host, port = s.url.split("//")[1].split(":")
            sock = socket.create_connection((host, int(port)))
            sock.sendall(f"POST /score HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json"
                         f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(3)
            sock.close()
            t0 = time.perf_counter()
            r = httpx.post(s.url + "/generate", headers=H, timeout=600, json={"prompts": [[5, 6, 7]], "params": {"max_tokens": 1}})
            out["score_abandoned"] = {"status": r.status_code, "generate_after_abandon_s": time.perf_counter() - t0}
    return out


def calculator_case() -> dict:
    """64 runaways sent in one call, then (0.3 s later, while they run) 4 good ones in another: the good ones' wait."""
    from agent.tools import ToolBox

    box = ToolBox(["calculator"], timeout_s=30, max_output_chars=1000)
    try:
        runaway = [("calculate", {"expression": f"9 ** 9 ** 9 ** {9 + i}"}) for i in range(64)]
        good = [("calculate", {"expression": f"{i} * 7 + 1"}) for i in range(4)]
        bad: dict = {}
        t0 = time.perf_counter()
        thread = threading.Thread(target=lambda: bad.update(answers=box.call_many(runaway)))
        thread.start()
        time.sleep(0.3)
        t1 = time.perf_counter()
        answers = box.call_many(good)
        good_s = time.perf_counter() - t1
        thread.join()
        round_s = time.perf_counter() - t0
        t2 = time.perf_counter()
        (after,) = box.call_many([("calculate", {"expression": "6 * 7"})])
        return {"good_answered": sum(a.text == str(i * 7 + 1) for i, a in enumerate(answers)), "good_total": 4,
                "good_calls_s": good_s, "round_s": round_s, "runaways_refused": sum(a.error is not None for a in bad["answers"]),
                "next_good_call_s": time.perf_counter() - t2, "next_good_ok": after.text == "42"}
    finally:
        box.close()


def viewer_case() -> dict:
    from emapg.servers import free_port

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        run.mkdir()
        # every position of the text starts 500 matching words before the gold's last one fails: what backtracks
        text, gold = "a " * 500_000, " ".join(["a"] * 500 + ["b"])
        sample = {"step": 1, "question": "q", "golds": [gold], "response": f"<information>{text}</information>"}
        (run / "samples.jsonl").write_text(json.dumps(sample) + "\n")
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "view", str(run), "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            for _ in range(300):
                try:
                    httpx.get(base + "/static/view.js", timeout=5)
                    break
                except httpx.TransportError:
                    time.sleep(0.2)
            return poll_during(base + "/static/view.js",
                               lambda: httpx.get(base + "/api/runs/0/samples?step=1", timeout=600).status_code)
        finally:
            proc.terminate()
            proc.wait(30)


def measure(cases: list[str]) -> dict:
    out = score_cases(cases)
    if "calculator" in cases:
        out["calculator"] = calculator_case()
    if "viewer_gold" in cases:
        out["viewer_gold"] = viewer_case()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    p.add_argument("--before", type=Path, help="a checkout of the code before the change: measured first, side by side")
    p.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)  # the child's role
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "hardening_round4.json")
    args = p.parse_args()
    if args.measure_only:
        print(json.dumps(measure(args.cases)))
        return 0
    before = None
    if args.before:
        env = {**os.environ, "PYTHONPATH": str(args.before.resolve())}
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure-only", "--cases", *args.cases],
                              cwd=args.before, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        before = json.loads(proc.stdout.strip().splitlines()[-1])
    after = measure(args.cases)
    ratios = {}
    if args.out.exists():  # a run of some cases keeps the others' measurements
        old = json.loads(args.out.read_text())
        before = {**(old.get("before") or {}), **(before or {})} if before is not None else old.get("before")
        after = {**(old.get("after") or {}), **after}
    for case, key in (("score_topk", "poll_max_s"), ("score_body", "poll_max_s"), ("viewer_gold", "poll_max_s"),
                      ("score_abandoned", "generate_after_abandon_s"), ("calculator", "good_calls_s")):
        if before and case in before and case in after and after[case].get(key):
            ratios[f"before_over_after_{key}_{case}"] = before[case][key] / after[case][key]
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), **ratios, "cases": sorted(after), "before": before, "after": after,
              "machine": f"{os.cpu_count()} CPUs, {sys.platform}"}
    for case in args.cases:
        print(f"{case:16} before {json.dumps(before.get(case)) if before else '-'}\n{'':16} after  {json.dumps(after.get(case))}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
