"""Our retrieval server against Search-R1's, side by side: same index, same encoder, same load harness.

Search-R1's server (``benchmarks/peers/search_r1/retrieval_server.py``, its own file at commit a14dc3a4,
run by ``serve_cpu.py`` beside it: ``.cuda()`` made the identity, bound to 127.0.0.1, nothing else
changed) and ours (``emapg serve`` on its defaults: micro-batching, the encoder in bf16 where the CPU
has bf16 instructions) serve the same FAISS Flat index over the whole bundled corpus
(``data/corpus/wiki_mini.jsonl.gz``, 43k passages, MiniLM). Both speak the same ``/retrieve`` body
(``queries``, ``topk`` 3, ``return_scores``). The load is :mod:`benchmarks.retriever_load`'s: N
closed-loop clients, one keep-alive connection each, one NQ question per request, the measured
window opening once every client has had an answer. One server runs at a time; the order of the
servers alternates between rounds so drift favours neither; each server gets ``OMP_NUM_THREADS``
``--server-threads`` (default 1: the load generator needs the other core), and the peer is also
measured at its own default thread count (all cores) and in fp16 (its ``__main__``'s setting); the
ratio is taken against the peer's best row at each concurrency.

Installing the peer: a virtual environment in the cache that sees this project's packages
(torch, transformers, faiss, fastapi, uvicorn) through a ``.pth`` file and adds what Search-R1's
server imports that we do not ship: ``datasets``, from the package index.

Before measuring, both servers answer the same 200 questions: the share with the same top-3 ids is
recorded (the two encode with different precisions and code, so a few ties may order differently).

    python benchmarks/retriever_vs_searchr1.py            # ~6 min on 2 cores
    python benchmarks/retriever_vs_searchr1.py --quick    # c = 32 only, 1 round

Writes ``benchmarks/results/retriever_vs_searchr1.json``. Target (issue 56): ours >= 8x the peer's
requests/s at c = 32.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import retriever_load as load  # noqa: E402  the same harness as the retriever's own load benchmark

from emapg.cpu import cpu_has_bf16  # noqa: E402
from emapg.models import resolve_model  # noqa: E402
from emapg.paths import cache_dir  # noqa: E402
from retriever.index_files import INDEX_FILE, read_meta  # noqa: E402
from retriever.launch import RetrieverServer  # noqa: E402

PEER_DIR = REPO / "benchmarks" / "peers" / "search_r1"
PEER_COMMIT = "a14dc3a4ffc6fe88c1e95038d9738e21ba3f7a06"
OUT = REPO / "benchmarks" / "results" / "retriever_vs_searchr1.json"
TARGET_RATIO = 8.0


def peer_python() -> Path:
    """A venv that sees this project's packages and has ``datasets`` (what Search-R1's server adds)."""
    venv = cache_dir() / "peers" / "search-r1-venv"
    py = venv / "bin" / "python"
    probe = [str(py), "-c", "import datasets, faiss, torch, transformers, fastapi, uvicorn"]
    if py.is_file() and subprocess.run(probe, capture_output=True).returncode == 0:
        return py
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    ours = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site / "emapg-project.pth").write_text(ours + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "datasets"], check=True)
    subprocess.run(probe, check=True)
    return py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerServer:
    """Search-R1's server in its own process, up once ``/retrieve`` answers."""

    def __init__(self, py: Path, index_dir: Path, corpus: Path, model: str, threads: int | None, fp16: bool, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        if threads is not None:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        else:
            env.pop("OMP_NUM_THREADS", None)
            env.pop("MKL_NUM_THREADS", None)
        cmd = [str(py), str(PEER_DIR / "serve_cpu.py"), "--index", str(index_dir / INDEX_FILE), "--corpus", str(corpus),
               "--model", model, "--port", str(self.port), *(["--fp16"] if fp16 else [])]  # fmt: skip
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        import httpx

        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Search-R1's server exited ({self.proc.returncode}); see {log}")
            try:
                r = httpx.post(self.url + "/retrieve", json={"queries": ["warm up"], "topk": 3, "return_scores": True}, timeout=30)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"Search-R1's server did not answer in 300 s; see {log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def top3(url: str, qs: list[str]) -> list[list[str]]:
    import httpx

    out = []
    for i in range(0, len(qs), 20):
        r = httpx.post(url + "/retrieve", json={"queries": qs[i : i + 20], "topk": 3, "return_scores": True}, timeout=120)
        r.raise_for_status()
        out += [[hit["document"]["id"] for hit in row] for row in r.json()["result"]]
    return out


def level(url: str, qs: list[str], c: int, warmup_s: float, duration_s: float) -> dict:
    """One closed-loop level through retriever_load's clients (without its /metrics reading, which the peer lacks)."""
    import asyncio

    import numpy as np

    async def run() -> dict:
        w = load._Window(c)
        clients = asyncio.gather(*(load._client(url, load.single_queries(qs), i, w) for i in range(c)))
        try:
            await asyncio.wait_for(w.all_warm.wait(), timeout=max(30.0, 4 * duration_s))
        except asyncio.TimeoutError:
            pass
        await asyncio.sleep(warmup_s)
        w.start = time.perf_counter()
        await asyncio.sleep(duration_s)
        w.end = time.perf_counter()
        w.stop = True
        await clients
        arr = np.array(w.latencies) * 1000
        return {"concurrency": c, "requests": len(arr), "qps": round(w.queries / (w.end - w.start), 1),
                "p50_ms": round(float(np.percentile(arr, 50)), 1) if len(arr) else None,
                "p99_ms": round(float(np.percentile(arr, 99)), 1) if len(arr) else None, "errors": len(w.errors)}  # fmt: skip

    import gc

    gc.freeze()
    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="c = 32 only, one round, shorter windows")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every server at every level, alternating the order (default 2)")
    p.add_argument("--levels", default="1,8,32", help="concurrency levels (default 1,8,32)")
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per level (default 8)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds after every client's first answer before measuring (default 2)")
    p.add_argument("--server-threads", type=int, default=1, help="OMP_NUM_THREADS of both servers (default 1: the load generator needs the other core)")
    p.add_argument("--out", default=str(OUT), help="JSON output path")
    args = p.parse_args(argv)
    levels = [32] if args.quick else [int(x) for x in args.levels.split(",")]
    rounds = 1 if args.quick else args.rounds
    duration, warmup = (4.0, 1.0) if args.quick else (args.duration, args.warmup)

    py = peer_python()
    index_dir, _ = load.cached_index(None, max_length=256)  # the whole bundled corpus, Flat, MiniLM
    meta = read_meta(index_dir)
    model = resolve_model("minilm")
    qs = load.questions(2000)
    logs = cache_dir() / "peers" / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    # Who is measured: ours on defaults; the peer at our thread count in fp32 and fp16, and at its own default threads.
    peers = {"search_r1_fp32": dict(threads=args.server_threads, fp16=False),
             "search_r1_fp16": dict(threads=args.server_threads, fp16=True),
             "search_r1_fp32_all_threads": dict(threads=None, fp16=False)}  # fmt: skip
    if args.quick:
        peers = {"search_r1_fp32": peers["search_r1_fp32"]}
    rows: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in levels} for name in ["ours", *peers]}
    agreement = None
    for r in range(rounds):
        order = ["ours", *peers] if r % 2 == 0 else [*reversed(list(peers)), "ours"]
        for name in order:
            with contextlib.ExitStack() as stack:
                if name == "ours":
                    srv = RetrieverServer(index_dir, device="cpu", omp_num_threads=args.server_threads, log_path=logs / "ours.log")
                    srv.start()
                    stack.callback(srv.stop)
                    url = srv.url
                else:
                    peer = PeerServer(py, index_dir, load.CORPUS, model, log=logs / f"{name}.log", **peers[name])
                    stack.callback(peer.stop)
                    url = peer.url
                if r == 0 and name in ("ours", "search_r1_fp32"):
                    ids = top3(url, qs[:200])
                    agreement = ids if agreement is None else round(sum(a == b for a, b in zip(agreement, ids)) / len(ids), 3)
                for c in levels:
                    row = level(url, qs, c, warmup, duration)
                    rows[name][c].append(row)
                    print(f"round {r} {name:28s} c={c:3d} {row['qps']:8.1f} req/s  p50 {row['p50_ms']} ms  p99 {row['p99_ms']} ms  errors {row['errors']}", flush=True)

    def med(xs: list[float]) -> float:
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

    summary = {name: {str(c): {"qps_per_round": [x["qps"] for x in rs], "qps_median": med([x["qps"] for x in rs]),
                                "p99_ms_median": med([x["p99_ms"] for x in rs if x["p99_ms"] is not None] or [float("nan")]),
                                "errors": sum(x["errors"] for x in rs)} for c, rs in by_c.items()} for name, by_c in rows.items()}  # fmt: skip
    ratios = {}
    for c in levels:
        best_peer = max(peers, key=lambda n: summary[n][str(c)]["qps_median"])
        ratios[str(c)] = {"ours_over_best_peer": round(summary["ours"][str(c)]["qps_median"] / summary[best_peer][str(c)]["qps_median"], 2),
                          "best_peer": best_peer,
                          "per_round": [round(o["qps"] / b["qps"], 2) for o, b in zip(rows["ours"][c], rows[best_peer][c])]}  # fmt: skip
    out = {
        "benchmark": "retriever_vs_searchr1",
        "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "cpu_bf16_instructions": cpu_has_bf16(), "load_average_at_end": list(os.getloadavg())},  # fmt: skip
        "setup": {
            "index": {"type": meta.get("index_type", "Flat"), "passages": meta.get("num_docs") or meta.get("rows"), "encoder": "minilm", "corpus": str(load.CORPUS.relative_to(REPO))},
            "peer": {"repo": "PeterGriffinJin/Search-R1", "commit": PEER_COMMIT, "file": "search_r1/search/retrieval_server.py (unmodified)",
                     "cpu_changes": [".cuda() is the identity on modules and tensors; torch.cuda.empty_cache is a no-op",
                                     "binds 127.0.0.1 on a free port instead of 0.0.0.0:8000", "fp16 measured both ways (its __main__ sets fp16)"],
                     "extra_dependency": "datasets (pip)"},
            "ours": "emapg serve defaults (micro-batching, max_batch 64, encoder in bf16 where the CPU has bf16 instructions), query cache off by default",
            "load": "retriever_load's harness: closed-loop clients, one keep-alive HTTP/1.1 connection each, one NQ question per request, topk 3, scores returned",
            "server_omp_threads": args.server_threads, "rounds": rounds, "levels": levels, "duration_s": duration, "warmup_s": warmup,
        },  # fmt: skip
        "same_top3_fraction_200_questions": agreement,
        "servers": summary,
        "ratio": ratios,
        "target": {"ratio_at_32": TARGET_RATIO, "met": ratios.get("32", {}).get("ours_over_best_peer", 0) >= TARGET_RATIO if "32" in ratios else None},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for c in levels:
        print(f"c={c}: ours {summary['ours'][str(c)]['qps_median']} req/s vs Search-R1 best ({ratios[str(c)]['best_peer']}) "
              f"{summary[ratios[str(c)]['best_peer']][str(c)]['qps_median']} req/s: {ratios[str(c)]['ours_over_best_peer']}x")  # fmt: skip
    print(f"same top-3 on 200 questions: {agreement}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
