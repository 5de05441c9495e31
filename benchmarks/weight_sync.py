"""HTTP weight sync to an ``emapg engine serve`` server: the request body sent whole vs in 1 MiB slices.

What a remote-engine trainer does before every rollout (``RemoteEngine.load_weights``, http transport):
the policy's fp32 weights in safetensors buckets, one POST per bucket, then a commit that loads them.
httpcore sends a ``bytes`` body by re-slicing what is left after each socket ``send`` (a copy every
time), so the cost of one POST grows with the square of its size; ``RemoteEngine`` now streams large
bodies as memoryview slices of ``BODY_CHUNK_BYTES``. Both ways are measured side by side in one run,
alternating, on the same server (transformers engine serving SmolLM2-135M, loopback), for 256 MiB buckets
(the default, ``rollout.weight_sync_bucket_mb``) and 1 GiB buckets; every push is checked to change the
server's weights version.

    python benchmarks/weight_sync.py            # 3 pushes per way and bucket size (~3 min on 2 cores)

Writes ``benchmarks/results/weight_sync.json``: seconds per push (median, all), the ratio whole/sliced.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-search-starter", help="model whose weights are pushed (alias or folder)")
    ap.add_argument("--repeats", type=int, default=3, help="pushes per way and bucket size (after one warm-up each)")
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[256, 1024], help="bucket sizes to measure, MiB")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "weight_sync.json")
    args = ap.parse_args(argv)

    import agent.engines.remote as remote
    from agent.engines.launch import EngineServer
    from emapg.models import load_merged_model, resolve_model

    path = resolve_model(args.model)
    state = {k: v.detach() for k, v in load_merged_model(path).state_dict().items()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    sliced_chunk = remote.BODY_CHUNK_BYTES
    ways = {"whole": 1 << 62, "sliced": sliced_chunk}
    seconds: dict[str, dict[str, list[float]]] = {str(b): {w: [] for w in ways} for b in args.bucket_mb}
    print(f"pushing {len(state)} tensors, {nbytes / 2**20:.0f} MiB fp32, to a transformers engine server", flush=True)
    with EngineServer(path, engine="hf", omp_num_threads=os.cpu_count() or 1, max_model_len=2048) as server:
        for bucket_mb in args.bucket_mb:
            engine = remote.RemoteEngine(server.url, model_path=path, bucket_bytes=bucket_mb << 20)
            try:
                for attempt in range(args.repeats + 1):  # attempt 0 warms up; the ways alternate
                    for way, chunk in ways.items():
                        remote.BODY_CHUNK_BYTES = chunk
                        t = time.perf_counter()
                        before = engine.health()[0]["weights_version"]
                        after = engine.load_weights(state, tag=f"{way}-{attempt}")[0]
                        dt = time.perf_counter() - t
                        if after != before + 1:
                            raise RuntimeError(f"push {way} {attempt}: weights version {before} -> {after}")
                        if attempt:
                            seconds[str(bucket_mb)][way].append(dt)
                        print(f"bucket {bucket_mb} MiB, {way:6s}: {dt:.2f} s", flush=True)
            finally:
                remote.BODY_CHUNK_BYTES = sliced_chunk
                engine.close()
    results = {}
    for bucket, by_way in seconds.items():
        med = {w: statistics.median(v) for w, v in by_way.items()}
        results[bucket] = {"seconds": by_way, "median_s": med, "whole_over_sliced": med["whole"] / med["sliced"]}
        print(f"bucket {bucket} MiB: whole {med['whole']:.2f} s, sliced {med['sliced']:.2f} s per push: "
              f"{med['whole'] / med['sliced']:.1f}x", flush=True)
    report = {
        "benchmark": "weight_sync", "model": args.model, "bytes": nbytes, "tensors": len(state),
        "slice_bytes": sliced_chunk, "repeats": args.repeats, "buckets_mb": results,
        "conditions": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                       "server": "emapg engine serve --engine hf, loopback", "date": time.strftime("%Y-%m-%d")},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
