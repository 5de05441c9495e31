"""Does one large OpenAI-endpoint request stall the generation server? /health latency while it is in flight.

Starts ``emapg engine serve`` (transformers engine, tiny-qwen2, max_model_len 4096) and, per case, sends one
large request from a thread while the main thread polls ``GET /health`` every 50 ms on a kept-alive connection,
until the large request is answered. Reports the slowest /health answer seen meanwhile (its latency is the
stall), the large request's status and time. Cases (issue 46, E2):

* ``chat_1024x60k``: 1,024 user messages of 60,000 characters (61 MB of JSON, under the 64 MiB body limit);
* ``chat_4mib``: one user message of 4 MiB;
* ``completion_4mib``: a 4 MiB /v1/completions prompt;
* ``chat_<n>x60k`` (``--messages n``): fewer 60 KB messages, for code whose stall on the full case would run for minutes.

It runs against whatever ``agent``/``emapg`` is importable, so the code before the change can be measured from a
checkout of it (``PYTHONPATH=<old checkout>``, run from there).

    python benchmarks/openai_stall.py                              # every case, ~1 min on 2 cores
    python benchmarks/openai_stall.py --cases chat_4mib --messages 128 --out /tmp/before.json

Writes ``benchmarks/results/openai_stall.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import httpx

KEY = "stall-bench"


def _bodies(messages: int) -> dict[str, tuple[str, bytes]]:
    text60k = ("The quick brown fox jumps over the lazy dog. " * 1400)[:60_000]
    mib4 = ("capital of france " * 250_000)[: 4 << 20]
    return {
        "chat_1024x60k": ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": text60k}] * 1024, "max_tokens": 2}).encode()),
        f"chat_{messages}x60k": ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": text60k}] * messages, "max_tokens": 2}).encode()),
        "chat_4mib": ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": mib4}], "max_tokens": 2}).encode()),
        "completion_4mib": ("/v1/completions", json.dumps({"prompt": mib4, "max_tokens": 2}).encode()),
    }  # fmt: skip


def run_case(url: str, path: str, body: bytes, timeout_s: float) -> dict:
    answer: dict = {}

    def big() -> None:
        t0 = time.perf_counter()
        try:
            r = httpx.post(url + path, content=body, timeout=timeout_s,
                           headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})  # fmt: skip
            answer.update(status=r.status_code, detail=r.json().get("detail", "")[:160] if r.status_code != 200 else "")
        except httpx.HTTPError as e:
            answer.update(status=None, detail=f"{type(e).__name__}: {e}"[:160])
        answer["seconds"] = time.perf_counter() - t0

    thread = threading.Thread(target=big)
    latencies = []
    with httpx.Client(timeout=timeout_s) as http:
        http.get(url + "/health")  # the connection is open before the large request starts
        thread.start()
        while thread.is_alive():
            t0 = time.perf_counter()
            http.get(url + "/health")
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)
    thread.join()
    return {**answer, "health_polls": len(latencies), "health_max_s": max(latencies, default=0.0),
            "health_median_s": sorted(latencies)[len(latencies) // 2] if latencies else 0.0}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=["chat_1024x60k", "chat_4mib", "completion_4mib"])
    p.add_argument("--messages", type=int, default=128, help="n of the chat_<n>x60k case")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a large request may take")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "openai_stall.json")
    p.add_argument("--server-args", default="", help="more emapg engine serve options, e.g. '--openai-max-prompt-chars 5000000' "
                                                     "(the large prompts then reach the tokenizer, in the worker threads)")  # fmt: skip
    args = p.parse_args()
    from agent.engines.launch import EngineServer
    from emapg.models import resolve_model

    bodies = _bodies(args.messages)
    results = {}
    with EngineServer(resolve_model("tiny-qwen2"), engine="hf", api_key=KEY, max_model_len=4096,
                      extra_args=args.server_args.split()) as server:
        for case in args.cases:
            path, body = bodies[case]
            results[case] = {"body_bytes": len(body), **run_case(server.url, path, body, args.timeout)}
            r = results[case]
            print(f"{case:18} body {len(body) / 1e6:6.1f} MB -> {r['status']} in {r['seconds']:6.2f} s; "
                  f"/health max {r['health_max_s'] * 1000:8.1f} ms, median {r['health_median_s'] * 1000:6.1f} ms "
                  f"over {r['health_polls']} polls  {r['detail'][:90]}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"server_args": args.server_args, "cases": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
