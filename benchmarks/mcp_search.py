"""MCP search vs the native ``/retrieve``, side by side on one ``emapg serve --mcp`` at c = 32.

One server (the small MiniLM + FAISS Flat test index of tests/fixtures/retriever.py unless ``--index``), two routes to
the same micro-batcher: ``POST /retrieve`` (one query per request) and ``POST /mcp`` with a JSON-RPC ``tools/call`` of
the ``search`` tool (stateless streamable HTTP, JSON answers). Both are driven by the same lean closed-loop client
(retriever/loadgen.py: one keep-alive connection per client, the next request as soon as the answer is in), so the
difference is the server's cost of the MCP layer (JSON-RPC, the SDK's per-request transport and validation) and the
larger answer (passages as text and as structured content). Rounds alternate which route goes first; the ratios are of
the medians over the rounds. Before timing, the two routes' answers to the same questions are checked equal.

Two servers, one after the other: the query cache off (``--query-cache-size 0``: every query is encoded, as in
retriever_load.py's engine comparison; the top-level ``mcp_over_native_qps``/``_p99``), and on (the default: the
questions repeat, so most answers skip the encoder and the protocol's own cost is most of the time;
``mcp_over_native_qps_cached``).

Then a training step with the search tool through MCP (``rollout.tools=[<the server>/mcp]``) vs the built-in search
(the same server's ``/retrieve``, batched per round): `emapg train`'s step on the tiny Qwen2 weight-scripted to call
the search tool on every turn (agent/scripted_tools.py), one warm-up step and ``--train-steps`` timed steps each, one
trainer after the other (``training.mcp_over_builtin_step_time``; ``--train-steps 0`` skips it). The MCP arm's prompt
declares both of the server's tools (search, search_batch), so it is longer.

The training comparison was once off by default because the MCP arm's connect "hung" after the load phases. Cause,
found 2026-12-05: this script was ``benchmarks/mcp.py``; run as a script its folder comes first on ``sys.path``, so
``import mcp`` on the tool loop found the script instead of the SDK, the import failed before the connect began, and
the toolbox waited out its 60-s deadline without the error (under pytest, where the folder is not on the path, it
never happened). The script was renamed, the tool loop's imports now fail the connect at once with their reason, and
a test keeps every benchmark script from shadowing an importable module. On by default since (``--train-steps 3``).

    python benchmarks/mcp_search.py                   # 2 caches x 2 rounds x 2 routes x 8 s, then 3 + 1 training steps per arm (~5 min)
    python benchmarks/mcp_search.py --train-steps 0   # the load comparison only (about 1.5 minutes)
    python benchmarks/mcp_search.py --quick           # 1 round x 4 s each

Writes ``benchmarks/results/mcp.json`` (``mcp_over_native_qps``, ``mcp_over_native_p99``, ``mcp_over_native_qps_cached``,
``mcp_over_builtin_step_time``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from retriever.loadgen import retrieve_request  # noqa: E402

MCP_HEADERS = {"accept": "application/json, text/event-stream"}


def mcp_request(query: str, topk: int) -> tuple[str, dict]:
    return "/mcp", {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "search", "arguments": {"query": query, "topk": topk}}}


async def _closed_loop(url: str, make, headers: dict, queries: list[str], concurrency: int, seconds: float, topk: int) -> dict:
    """retriever.loadgen's closed loop (the same lean client and timing window) with ``make`` building each request."""
    from retriever.loadgen import closed_loop_async

    return await closed_loop_async(url, queries, concurrency, seconds, topk, request=make, headers=headers)


def check_equal(url: str, queries: list[str], topk: int) -> int:
    """The MCP search answers exactly what /retrieve answers (ids, passages, scores) for each query."""
    import httpx

    for q in queries:
        native = httpx.post(url + "/retrieve", json={"queries": [q], "topk": topk, "return_scores": True}, timeout=30).json()["result"][0]
        r = httpx.post(url + "/mcp", json=mcp_request(q, topk)[1], headers=MCP_HEADERS, timeout=30).json()
        hits = r["result"]["structuredContent"]["hits"]
        expected = [{"id": h["document"]["id"], "contents": h["document"]["contents"], "score": h["score"]} for h in native]
        if hits != expected:
            raise SystemExit(f"MCP and /retrieve disagree on {q!r}")
    return len(queries)


def train_steps(index: Path, queries: list[str], steps: int) -> dict:
    """Step time of `emapg train` with the search tool over MCP vs built-in (module docstring)."""
    import tempfile

    from agent.scripted import save_scripted
    from agent.scripted_tools import TOOL_SEARCH_SCRIPT, build_tool_tiny
    from emapg.config import load_config
    from emapg.models import resolve_model
    from emapg.paths import CONFIG_DIR
    from retriever.launch import RetrieverServer
    from trainer.config import TrainConfig
    from trainer.loop import Trainer

    work = Path(tempfile.mkdtemp(prefix="emapg-mcp-bench-"))
    policy = save_scripted(build_tool_tiny(work / "tool-tiny", Path(resolve_model("tiny-qwen2"))), work / "searcher", TOOL_SEARCH_SCRIPT)
    train = work / "train.jsonl"
    train.write_text("".join(json.dumps({"id": i, "question": q, "answers": ["x"]}) + "\n" for i, q in enumerate(queries)))
    times: dict[str, list[float]] = {"builtin": [], "mcp": []}
    calls: dict[str, dict] = {}
    with RetrieverServer(index, omp_num_threads=1, topk=3, extra_args=["--mcp"]) as server:
        for arm, tools in (("builtin", "[]"), ("mcp", f"[{server.url}/mcp]")):  # one trainer at a time (2 cores)
            cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", [
                f"run.output_dir={work / arm}", f"model.policy={policy}", f"retriever.urls=[{server.url}]", f"data.train={train}",
                "rollout.format=tool_calls", f"rollout.tools={tools}", "logging.progress=false", "data.prompts_per_step=4",
                "algorithm.mini_batch_size=8", "algorithm.micro_batch_size=8", "rollout.max_tokens_per_turn=24",
                "rollout.max_obs_tokens=96", "rollout.max_response_tokens=400", "rollout.max_prompt_tokens=1400", "run.save_every=0",
                f"run.total_steps={steps + 1}"])  # fmt: skip
            trainer = Trainer(cfg).setup()
            try:
                trainer.train_step()  # warm-up (first forward passes; the MCP connection)
                for _ in range(steps):
                    t0 = time.perf_counter()
                    m = trainer.train_step()
                    times[arm].append(time.perf_counter() - t0)
                calls[arm] = {"builtin_searches_per_traj": m.get("search/per_traj"), "rollout_errors": m.get("reward/rollout_errors")}
            finally:
                trainer.close()
    med = {arm: statistics.median(ts) for arm, ts in times.items()}
    print(f"training step: built-in search {med['builtin']:.2f} s, MCP search {med['mcp']:.2f} s", flush=True)
    return {"what": "emapg train step (tiny Qwen2 scripted to search every turn, 4 prompts x 4 samples, 2 searches each) with "
                    "rollout.tools=[<server>/mcp] vs the built-in search of the same server, after one warm-up step each",
            "step_time_s": times, "median_step_time_s": med, "mcp_over_builtin_step_time": round(med["mcp"] / med["builtin"], 3),
            "last_step": calls}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", default=None, help="index directory (default: the small test index, built and cached)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=3, help="training steps per arm (default 3; 0: skip the training "
                                                               "comparison; see the module docstring)")
    p.add_argument("--quick", action="store_true", help="1 round x 4 s")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "mcp.json"))
    args = p.parse_args()
    if args.quick:
        args.rounds, args.seconds = 1, 4.0

    from retriever.launch import RetrieverServer
    from tests.fixtures.retriever import build_small_index

    small = build_small_index()
    index = Path(args.index) if args.index else small.index_dir
    queries = [q["question"] for q in small.questions]
    runs, checked = {}, 0
    for cache, cache_args in (("cache_off", ["--query-cache-size", "0"]), ("cache_on", [])):
        rows: dict[str, list[dict]] = {"native": [], "mcp": []}
        with RetrieverServer(index, omp_num_threads=int(os.environ.get("OMP_NUM_THREADS", "1")), topk=args.topk,
                             extra_args=["--mcp", *cache_args]) as server:  # fmt: skip
            checked += check_equal(server.url, queries[:20], args.topk)
            for r in range(args.rounds):
                order = [("native", retrieve_request, {}), ("mcp", mcp_request, MCP_HEADERS)]
                for name, make, headers in (order if r % 2 == 0 else order[::-1]):
                    result = asyncio.run(_closed_loop(server.url, make, headers, queries, args.concurrency, args.seconds, args.topk))
                    result["round"] = r
                    rows[name].append(result)
                    print(f"{cache} round {r} {name:6s} c={args.concurrency}: {result['qps']:7.1f} q/s  p50 {result['p50_ms']:6.1f} ms  "
                          f"p99 {result['p99_ms']:6.1f} ms  {result['statuses']}", flush=True)
        med = {name: {k: statistics.median(x[k] for x in rs) for k in ("qps", "p50_ms", "p99_ms")} for name, rs in rows.items()}
        runs[cache] = {"median": med, "rounds": rows,
                       "mcp_over_native_qps": round(med["mcp"]["qps"] / med["native"]["qps"], 3),
                       "mcp_over_native_p99": round(med["mcp"]["p99_ms"] / med["native"]["p99_ms"], 3)}
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "what": "emapg serve --mcp: the MCP search tool (JSON-RPC tools/call on /mcp, stateless, JSON) vs POST /retrieve on "
                "the same server and index, closed loop at c=32, one query per request, same lean client; query cache off "
                "(top-level ratios) and on (_cached)",
        "mcp_over_native_qps": runs["cache_off"]["mcp_over_native_qps"],
        "mcp_over_native_p99": runs["cache_off"]["mcp_over_native_p99"],
        "mcp_over_native_qps_cached": runs["cache_on"]["mcp_over_native_qps"],
        "mcp_over_native_p99_cached": runs["cache_on"]["mcp_over_native_p99"],
        "mcp_over_builtin_step_time": None,
        **runs, "answers_checked_equal": checked,
        "training": train_steps(index, queries, args.train_steps) if args.train_steps > 0 else None,
        "setup": {"index": str(index), "rows": small.rows if args.index is None else None, "concurrency": args.concurrency,
                  "seconds": args.seconds, "rounds": args.rounds, "topk": args.topk, "cpus": os.cpu_count(),
                  "load_average": os.getloadavg(), "python": platform.python_version(),
                  "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
    }  # fmt: skip
    if report["training"] is not None:
        report["mcp_over_builtin_step_time"] = report["training"]["mcp_over_builtin_step_time"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"MCP / native at c={args.concurrency}: q/s {report['mcp_over_native_qps']:.2f}x, p99 {report['mcp_over_native_p99']:.2f}x "
          f"(query cache on: q/s {report['mcp_over_native_qps_cached']:.2f}x) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
