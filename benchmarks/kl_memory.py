"""Memory and time of the KL term: Top-k KL (k=32, 256) vs exact full-vocabulary KL vs sampled K3.

Setting (issue 4): Qwen vocabulary V = 151,936, T = 2,048 response tokens, CPU, float32, hidden
size 896 (Qwen2.5-0.5B), 32-token chunks.  ``--quick`` keeps V but uses
T = 256, hidden size 64 and 4-token chunks, and runs two workers at a time, and says so in the JSON: the memory of every
variant is dominated by (T, V) or (chunk, V) float32 tensors, so the exact/Top-k ratio depends
on T/chunk (64 in both modes), not on H; H only sets the matmul time.  The fused pass streams
the (V, H) lm_head weight once per chunk, which is what makes small chunks slow on a CPU.  Each variant runs in
a **fresh subprocess**; its peak extra memory is the kernel's resident-set high-water mark
(VmHWM, reset through /proc/self/clear_refs right before the measured region) minus the
resident set at that moment, so it sees every allocation torch makes.  glibc is told to
mmap every allocation ≥ 1 MiB (``MALLOC_MMAP_THRESHOLD_``) so freed chunk buffers are
returned to the kernel instead of lingering in the heap — the same for every variant.

Measured region of every KL variant, starting from the inputs that exist anyway (final
hidden states of the policy and of the anchor, their lm_head weights, the sampled tokens):

* ``exact``: the anchor's full logits (T, V) are produced and **stored** (the paper's
  ``full_*`` with k ≤ 0 stores them per token), the policy's logits (T, V) are materialised,
  exact KL by :func:`trainer.algo.topk_kl.exact_kl` (already chunked), backward to the hidden states.
* ``exact_unchunked`` (full mode, at T = 512): the same with plain ``log_softmax`` autograd, as most code does.
* ``topk32`` / ``topk256``: old-policy top-k indices (chunked pass), the anchor's stored stats
  (k logits, k int64 indices, logsumexp, log-prob of the sampled token), the policy's fused
  chunked pass (lm_head inside the chunks), TopkReverseKL with IW, backward.
* ``k3``: the anchor's log-prob of the sampled token, the policy's fused pass, K3, backward.
* ``exact_fused`` (full mode; not in the paper): exact KL by :func:`trainer.algo.topk_kl.exact_kl_from_hidden`,
  storing the anchor's final hidden states (H floats per token) and recomputing both models'
  logits per chunk; it needs the anchor's lm_head weight resident at loss time (reported).

The trainer's exact-KL path before and after it moved to hidden states (full mode), each with the
policy's log-prob/entropy pass the PPO loss needs besides the KL:

* ``trainer_exact_logits`` (before): the anchor's (T, V) logits from its forward, the policy's (T, V)
  logits, :func:`trainer.algo.token_stats.token_stats_from_logits` and :func:`trainer.algo.topk_kl.exact_kl` on them;
* ``trainer_exact_hidden`` (now): the anchor's stored final hidden states,
  :func:`trainer.algo.token_stats.token_stats_from_hidden` and :func:`trainer.algo.topk_kl.exact_kl_from_hidden`
  (both models' logits recomputed per chunk; no (T, V) tensor).

The lm_head weights are frozen here (their gradient is a model-size constant shared by every
variant); gradients flow to the hidden states.  ``ema`` times the EMA anchor update for a
Qwen2.5-0.5B-shaped stand-in (494M parameters; ``--quick`` uses fewer layers and says so).

Writes ``benchmarks/results/kl_memory.json`` with ``full_over_topk_peak_memory_ratio`` and
``full_over_topk_anchor_storage_ratio`` (exact / Top-k at k = 32).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "kl_memory.json"
QWEN_VOCAB = 151_936
QWEN05_HIDDEN = 896


# ---------------------------------------------------------------------------------------------
# Memory probes (Linux).


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS; return the current RSS in bytes."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def _peak_since(baseline: int) -> int:
    return _status_kib("VmHWM") * 1024 - baseline


# ---------------------------------------------------------------------------------------------
# Worker: one variant per process.


def _kl_worker(variant: str, T: int, V: int, H: int, chunk: int, seed: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from trainer.algo.kl import get_kl_estimator
    from trainer.algo.token_stats import token_stats_from_hidden, token_stats_from_logits
    from trainer.algo.topk_kl import exact_kl, exact_kl_from_hidden, topk_reverse_kl

    torch.manual_seed(seed)
    # Logit scale ~4 gives peaked next-token distributions, as in LMs (affects values, not cost).
    w_pol = torch.randn(V, H) * (4.0 / H**0.5)
    w_ref = w_pol + torch.randn(V, H) * (0.5 / H**0.5)
    h_pol = torch.randn(T, H, requires_grad=True)
    h_old = h_pol.detach().clone()
    h_ref = h_pol.detach() + 0.05 * torch.randn(T, H)
    with torch.no_grad():  # sampled tokens ~ policy, in chunks so the setup stays small
        labels = torch.cat([torch.multinomial(torch.softmax(h_old[s : s + 128] @ w_pol.t(), -1), 1)[:, 0] for s in range(0, T, 128)])
    labels = labels[None]
    h_pol_b, h_old_b, h_ref_b = h_pol[None], h_old[None], h_ref[None]

    baseline = _reset_peak()
    t0 = time.perf_counter()
    pg = None  # the policy's log-prob term of the PPO loss, in the trainer variants
    if variant == "trainer_exact_logits":
        with torch.no_grad():
            anchor_logits = h_ref_b @ w_ref.t()  # the anchor's forward, once per micro-batch: (T, V)
        storage = anchor_logits.numel() * anchor_logits.element_size()
        logits = h_pol_b @ w_pol.t()
        pg = token_stats_from_logits(logits, labels, entropy=True, chunk_size=chunk).logp
        kl = exact_kl(logits, anchor_logits, direction="reverse", chunk_size=chunk)
        del logits
    elif variant == "trainer_exact_hidden":
        stored_hidden = h_ref_b.clone()  # stored per token by the anchor pass: H floats
        storage = stored_hidden.numel() * stored_hidden.element_size()
        pg = token_stats_from_hidden(h_pol_b, w_pol, labels, entropy=True, chunk_size=chunk).logp
        kl = exact_kl_from_hidden(h_pol_b, w_pol, stored_hidden, w_ref, direction="reverse", chunk_size=chunk)
    elif variant in ("exact", "exact_unchunked"):
        with torch.no_grad():
            anchor_logits = h_ref_b @ w_ref.t()  # stored per token: (T, V)
        storage = anchor_logits.numel() * anchor_logits.element_size()
        logits = h_pol_b @ w_pol.t()
        if variant == "exact":
            kl = exact_kl(logits, anchor_logits, direction="reverse", chunk_size=chunk)
        else:
            lp, lq = torch.log_softmax(logits, -1), torch.log_softmax(anchor_logits, -1)
            kl = (lp.exp() * (lp - lq)).sum(-1)
            del lp, lq
        del logits
    elif variant == "exact_fused":
        stored_hidden = h_ref_b.clone()  # the anchor's final hidden states are what is stored
        storage = stored_hidden.numel() * stored_hidden.element_size()
        kl = exact_kl_from_hidden(h_pol_b, w_pol, stored_hidden, w_ref, direction="reverse", chunk_size=chunk)
    elif variant.startswith("topk"):
        k = int(variant[4:])
        with torch.no_grad():
            old = token_stats_from_hidden(h_old_b, w_pol, labels, topk=k, chunk_size=chunk)
            anchor = token_stats_from_hidden(h_ref_b, w_ref, labels, gather_indices=old.topk_indices, chunk_size=chunk)
        old_logp, indices = old.logp, old.topk_indices
        del old
        storage = anchor.storage_bytes()  # k logits + k int64 indices + logsumexp + log-prob
        pol = token_stats_from_hidden(h_pol_b, w_pol, labels, gather_indices=indices, chunk_size=chunk)
        kl = topk_reverse_kl(
            logits_k=pol.topk_logits, logsumexp=pol.logsumexp, logp=pol.logp,
            ref_logits_k=anchor.topk_logits, ref_logsumexp=anchor.logsumexp, ref_logp=anchor.logp,
            topk_indices=indices, labels=labels, old_logp=old_logp,
        )
    elif variant == "k3":
        with torch.no_grad():
            ref_logp = token_stats_from_hidden(h_ref_b, w_ref, labels, chunk_size=chunk).logp
        storage = ref_logp.numel() * ref_logp.element_size()
        pol = token_stats_from_hidden(h_pol_b, w_pol, labels, chunk_size=chunk)
        kl = get_kl_estimator("k3")(pol.logp, ref_logp)
    else:
        raise ValueError(variant)
    (kl.mean() if pg is None else kl.mean() - pg.mean()).backward()
    elapsed = time.perf_counter() - t0
    peak = _peak_since(baseline)
    assert h_pol.grad is not None and torch.isfinite(h_pol.grad).all()
    return {
        "variant": variant,
        "peak_extra_bytes": peak,
        "anchor_storage_bytes": int(storage),
        "anchor_storage_bytes_per_token": int(storage) / T,
        "seconds": elapsed,
        "kl_mean": float(kl.detach().mean()),
    }


def _ema_worker(layers: int, seed: int) -> dict:
    import torch
    from torch import nn

    sys.path.insert(0, str(ROOT))
    from trainer.ema import EMAAnchor

    torch.manual_seed(seed)
    H, I, V, kv = QWEN05_HIDDEN, 4864, QWEN_VOCAB, 128  # Qwen2.5-0.5B shapes (tied embeddings)
    model = nn.Module()
    model.embed = nn.Parameter(torch.empty(V, H).uniform_(-0.02, 0.02))
    for i in range(layers):
        for name, shape in [("q", (H, H)), ("q_b", (H,)), ("k", (kv, H)), ("k_b", (kv,)), ("v", (kv, H)), ("v_b", (kv,)),
                            ("o", (H, H)), ("gate", (I, H)), ("up", (I, H)), ("down", (H, I)), ("ln1", (H,)), ("ln2", (H,))]:
            model.register_parameter(f"l{i}_{name}", nn.Parameter(torch.empty(shape).uniform_(-0.02, 0.02)))
    model.norm = nn.Parameter(torch.ones(H))
    n_params = sum(p.numel() for p in model.parameters())
    out: dict = {"parameters": n_params, "layers": layers}
    for dtype in ("float32", "bfloat16"):
        ema = EMAAnchor(model, anchor_decay=0.9, update_period=1, dtype=dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3)
        times = []
        baseline = _reset_peak()
        for _ in range(3):
            t0 = time.perf_counter()
            ema.update()
            times.append(time.perf_counter() - t0)
        out[dtype] = {
            "anchor_bytes": sum(t.numel() * t.element_size() for t in ema.tensors.values()),
            "update_seconds_median": sorted(times)[1],
            "update_peak_extra_bytes": _peak_since(baseline),
        }
        del ema
        gc.collect()
    return out


# ---------------------------------------------------------------------------------------------
# Driver.


def _run_worker(args: list[str], threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), MALLOC_MMAP_THRESHOLD_=str(2**20))
    proc = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T=256, H=64, chunk 4, 2-layer EMA stand-in, two workers at a time, no unchunked-exact run (V stays 151,936); < 90 s on 2 cores")
    ap.add_argument("--tokens", type=int, default=None, help="response tokens T (default 2048, quick 256)")
    ap.add_argument("--vocab", type=int, default=QWEN_VOCAB, help="vocabulary size V")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size H (default 896, quick 64)")
    ap.add_argument("--chunk", type=int, default=None, help="tokens per chunk in the chunked passes (default 32, quick 4)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    ap.add_argument("--ema-layers", type=int, default=None, help="decoder layers of the EMA stand-in (default 24, quick 2)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        kind, *rest = args.worker
        if kind == "ema":
            res = _ema_worker(int(rest[0]), 0)
        else:
            T, V, H, chunk = (int(x) for x in rest)
            res = _kl_worker(kind, T, V, H, chunk, 0)
        print(json.dumps(res))
        return 0

    T = args.tokens or (256 if args.quick else 2048)
    args.hidden = args.hidden or (64 if args.quick else QWEN05_HIDDEN)
    args.chunk = args.chunk or (4 if args.quick else 32)
    layers = args.ema_layers if args.ema_layers is not None else (2 if args.quick else 24)
    variants = ["exact", "topk32", "topk256", "k3"] + ([] if args.quick else ["exact_fused", "trainer_exact_logits", "trainer_exact_hidden"])
    unchunked_T = min(T, 512)
    started = time.perf_counter()
    jobs: dict[str, list[str]] = {v: [v, str(T), str(args.vocab), str(args.hidden), str(args.chunk)] for v in variants}
    if not args.quick:
        jobs["unchunked:exact_unchunked"] = ["exact_unchunked", str(unchunked_T), str(args.vocab), str(args.hidden), str(args.chunk)]
        jobs["unchunked:exact"] = ["exact", str(unchunked_T), str(args.vocab), str(args.hidden), str(args.chunk)]
    jobs["ema"] = ["ema", str(layers)]
    # Quick mode runs two workers at a time (2 cores); each still measures only its own process.
    with ThreadPoolExecutor(max_workers=2 if args.quick else 1) as pool:
        futures = {name: pool.submit(_run_worker, job, args.threads) for name, job in jobs.items()}
        done = {name: f.result() for name, f in futures.items()}
    results = {v: done[v] for v in variants}
    for v, r in results.items():
        print(f"{v:>16}: peak extra {r['peak_extra_bytes'] / 2**20:9.1f} MiB, "
              f"anchor storage {r['anchor_storage_bytes'] / 2**20:9.2f} MiB, {r['seconds']:6.2f} s", flush=True)
    unchunked = {k.split(":")[1]: r for k, r in done.items() if k.startswith("unchunked:")}
    ema = done["ema"]

    ex, t32, t256, k3 = (results[v] for v in variants[:4])
    exf = results.get("exact_fused")
    tr_logits, tr_hidden = results.get("trainer_exact_logits"), results.get("trainer_exact_hidden")
    ratio = lambda a, b, key: a[key] / b[key]  # noqa: E731
    report = {
        "benchmark": "kl_memory",
        "quick": args.quick,
        "note": ("quick mode: V kept at 151,936; T, hidden size and chunk reduced (T/chunk = 64 as in the full "
                 "setting, which the memory ratio depends on); times are not comparable with the full setting"
                 if args.quick else "full setting of issue 4 (T=2048, V=151,936, H=896, float32, CPU)"),
        "vocab": args.vocab,
        "tokens": T,
        "hidden": args.hidden,
        "chunk_tokens": args.chunk,
        "dtype": "float32",
        "device": "cpu",
        "threads_per_worker": args.threads,
        "concurrent_workers": 2 if args.quick else 1,
        "memory_probe": "VmHWM - VmRSS in a fresh subprocess per variant (clear_refs reset), MALLOC_MMAP_THRESHOLD_=1MiB",
        "variants": results,
        "full_over_topk_peak_memory_ratio": ratio(ex, t32, "peak_extra_bytes"),
        "full_over_topk_anchor_storage_ratio": ratio(ex, t32, "anchor_storage_bytes"),
        "full_over_topk256_peak_memory_ratio": ratio(ex, t256, "peak_extra_bytes"),
        "full_over_topk256_anchor_storage_ratio": ratio(ex, t256, "anchor_storage_bytes"),
        "full_over_k3_peak_memory_ratio": ratio(ex, k3, "peak_extra_bytes"),
        # Any exact KL from stored anchor logits holds at least those (T, V) logits:
        "exact_anchor_storage_over_topk_peak_ratio": ex["anchor_storage_bytes"] / t32["peak_extra_bytes"],
        # Our exact KL from hidden states (full mode) stores H floats per token but keeps the
        # anchor's lm_head resident:
        "exact_fused": None if exf is None else {
            "over_topk_peak_memory_ratio": ratio(exf, t32, "peak_extra_bytes"),
            "over_topk_anchor_storage_ratio": ratio(exf, t32, "anchor_storage_bytes"),
            "over_full_time_ratio": ratio(exf, ex, "seconds"),
            "anchor_lm_head_bytes": args.vocab * args.hidden * 4,
        },
        # The trainer's exact KL (with the policy's log-prob pass) from logits (before) and from hidden states (now):
        "trainer_exact_kl": None if tr_hidden is None else {
            "logits_peak_extra_bytes": tr_logits["peak_extra_bytes"],
            "hidden_peak_extra_bytes": tr_hidden["peak_extra_bytes"],
            "hidden_over_logits_peak_memory_ratio": ratio(tr_hidden, tr_logits, "peak_extra_bytes"),
            "hidden_over_logits_time_ratio": ratio(tr_hidden, tr_logits, "seconds"),
            "same_kl": abs(tr_hidden["kl_mean"] - tr_logits["kl_mean"]) <= 1e-5 * max(abs(tr_logits["kl_mean"]), 1e-12),
        },
        "topk32_over_full_time_ratio": ratio(t32, ex, "seconds"),
        "topk256_over_full_time_ratio": ratio(t256, ex, "seconds"),
        "k3_over_full_time_ratio": ratio(k3, ex, "seconds"),
        "targets": {
            "anchor_storage_ratio_at_least": 1000,
            "peak_memory_ratio_at_least": 20,
            "anchor_storage_met": ratio(ex, t32, "anchor_storage_bytes") >= 1000,
            "peak_memory_met": ratio(ex, t32, "peak_extra_bytes") >= 20,
        },
        "exact_chunking": None if not unchunked else {
            "tokens": unchunked_T,
            "unchunked_peak_extra_bytes": unchunked["exact_unchunked"]["peak_extra_bytes"],
            "chunked_peak_extra_bytes": unchunked["exact"]["peak_extra_bytes"],
            "unchunked_over_chunked_peak_memory_ratio": ratio(unchunked["exact_unchunked"], unchunked["exact"], "peak_extra_bytes"),
        },
        "ema_update": {
            **ema,
            "stand_in": f"Qwen2.5-0.5B shapes, {layers} of 24 decoder layers" + (" (quick)" if layers != 24 else ""),
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "total_seconds": None,
    }
    report["total_seconds"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"exact / top-32: peak memory {report['full_over_topk_peak_memory_ratio']:.1f}x, "
          f"anchor storage {report['full_over_topk_anchor_storage_ratio']:.0f}x; "
          f"exact / top-256: {report['full_over_topk256_peak_memory_ratio']:.1f}x, "
          f"{report['full_over_topk256_anchor_storage_ratio']:.0f}x")
    if exf is not None:
        f = report["exact_fused"]
        print(f"exact fused from hidden states / top-32: peak memory {f['over_topk_peak_memory_ratio']:.2f}x, "
              f"storage {f['over_topk_anchor_storage_ratio']:.1f}x (+ the anchor lm_head, {f['anchor_lm_head_bytes'] / 2**20:.0f} MiB)")
    if tr_hidden is not None:
        f = report["trainer_exact_kl"]
        print(f"trainer exact KL from hidden states / from logits: peak memory {f['hidden_over_logits_peak_memory_ratio']:.3f}x "
              f"({f['hidden_peak_extra_bytes'] / 2**20:.0f} vs {f['logits_peak_extra_bytes'] / 2**20:.0f} MiB), "
              f"time {f['hidden_over_logits_time_ratio']:.2f}x, same KL: {f['same_kl']}")
    print(f"time vs exact: top-32 {report['topk32_over_full_time_ratio']:.2f}x, top-256 "
          f"{report['topk256_over_full_time_ratio']:.2f}x, k3 {report['k3_over_full_time_ratio']:.2f}x")
    if unchunked:
        print(f"unchunked / chunked exact KL peak memory at T={unchunked_T}: "
              f"{report['exact_chunking']['unchunked_over_chunked_peak_memory_ratio']:.2f}x")
    for dt in ("float32", "bfloat16"):
        e = ema[dt]
        print(f"EMA update ({ema['parameters'] / 1e6:.0f}M params, {dt} anchor): {e['update_seconds_median']:.3f} s, "
              f"peak extra {e['update_peak_extra_bytes'] / 2**20:.0f} MiB")
    print(f"wrote {args.out} in {report['total_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
