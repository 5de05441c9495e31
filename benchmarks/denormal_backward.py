"""Subnormal floats in a CPU backward: the time of one forward+backward with ``run.flush_denormal`` off and on.

Why it matters (issue #56, the suite's time): the tests train *scripted* tiny models (agent/scripted.py), whose
attention and MLP output projections are zero. Their first updates see rounding-sized gradients (rewards all 0, a KL
to an anchor equal to the policy), which AdamW turns into weights of about lr·g/eps; the next backward multiplies
gradients by those weights and fills the attention and MLP backward with subnormal floats, which x86 computes about
100x slower. Measured in tests/trainer/test_external_agent.py's training step: ``Trainer.learn`` 59 s, of which the
SDPA backward 31.5 s and the matrix products 24.3 s, with 1.5M of the attention backward's 25M outputs subnormal;
8.3 s with subnormals flushed to zero.

This script rebuilds that state without the test fixtures: the scripted searcher (agent.scripted) on tiny-qwen2,
one AdamW step (the trainer's betas and eps) on a gradient scaled to rounding size, then times forward+backward on
``--rows`` rows of ``--tokens`` tokens with subnormals kept (IEEE) and flushed (``torch.set_flush_denormal``), and
the same on the plain random tiny-qwen2 (no subnormals: the flag must cost nothing there). One thread.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/denormal_backward.py [--rows 2 --tokens 1024 --repeats 2]

Writes ``benchmarks/results/denormal_backward.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULT = REPO / "benchmarks" / "results" / "denormal_backward.json"
#: A rounding-sized gradient scale (in the test's first update AdamW's g*g was already subnormal somewhere: g < 1e-19),
#: far below AdamW's eps, so its step is about lr * g / eps: tiny weights where the scripted model had zeros.
GRADIENT_SCALE = 1e-18


def subnormal_share(t: torch.Tensor) -> float:
    tiny = torch.finfo(t.dtype).tiny
    return float(((t != 0) & (t.abs() < tiny)).float().mean())


def loss_of(model: torch.nn.Module, ids: torch.Tensor, scale: float) -> torch.Tensor:
    logp = model(input_ids=ids).logits[:, :-1].float().log_softmax(-1)
    return -scale * logp.gather(-1, ids[:, 1:, None]).mean()


def time_backward(model_dir: Path, ids: torch.Tensor, repeats: int) -> dict[str, float]:
    """One AdamW step on a rounding-sized gradient, then forward+backward timed with subnormals kept and flushed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    torch.set_flush_denormal(False)
    loss_of(model, ids, GRADIENT_SCALE).backward()
    opt.step()
    out: dict[str, float] = {}
    for flush in (False, True):
        torch.set_flush_denormal(flush)
        times = []
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss_of(model, ids, GRADIENT_SCALE).backward()
            times.append(time.perf_counter() - t0)
        key = "flushed" if flush else "ieee"
        out[f"{key}_s"] = min(times)
        if not flush:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            out["ieee_subnormal_gradient_share"] = sum(subnormal_share(g) * g.numel() for g in grads) / sum(g.numel() for g in grads)
    torch.set_flush_denormal(False)
    out["ieee_over_flushed"] = out["ieee_s"] / out["flushed_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from agent.scripted import SEARCH_SCRIPT, build_untied_tiny, save_scripted
    from emapg.models import tiny_qwen2_folder

    with tempfile.TemporaryDirectory() as tmp:
        tiny = tiny_qwen2_folder(Path(tmp) / "tiny-qwen2")
        scripted = save_scripted(build_untied_tiny(Path(tmp) / "untied", tiny), Path(tmp) / "searcher", SEARCH_SCRIPT)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(tiny).vocab_size
        ids = torch.randint(0, vocab, (args.rows, args.tokens), generator=torch.Generator().manual_seed(0))
        result = {
            "what": "forward+backward of one batch after one AdamW step on a rounding-sized gradient, subnormals kept (IEEE) "
                    "vs flushed to zero (run.flush_denormal); seconds, best of the repeats, one thread",
            "date": time.strftime("%Y-%m-%d %H:%M"), "rows": args.rows, "tokens": args.tokens, "repeats": args.repeats,
            "gradient_scale": GRADIENT_SCALE, "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "scripted_searcher": time_backward(scripted, ids, args.repeats),
            "random_tiny_qwen2": time_backward(tiny, ids, args.repeats),
        }
    result["scripted_ieee_over_flushed"] = result["scripted_searcher"]["ieee_over_flushed"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
