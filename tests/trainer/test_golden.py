"""Golden runs: the metrics of fixed-seed 3-step tiny runs must be reproduced by the current code.

Each case is a real `train()` on tiny-qwen2 (math task, transformers engine, the bundled MATH train
prompts), covering every loss path: EMA-PG with Top-k reverse KL (stored π_old statistics, and the
on-policy fused path), Top-k forward KL, GRPO with K3 to a frozen reference (two PPO epochs), the
exact reverse/forward KL, and no KL; and two search-task cases from a warm-started policy. Timing metrics
and the engine-vs-trainer rounding metrics (``mismatch/``) are not compared; every other metric is, as is
a fingerprint of the update of the policy's and anchor's weights.

Conditioning. AdamW with its usual epsilon (1e-8) moves every weight by about ±lr in its first steps whatever
its gradient's size, so rounding-sized gradients (the math cases' rewards are all 0, and a KL to an identical
anchor is 0) become lr-sized weight differences: a sign amplifier of the CPU's rounding. The golden file recorded
that way on 2026-12-05 was reproduced on the host that recorded it and failed on two others (CI: search_grpo_k3 step 1
kl/loss 0.006106 vs 0.006116; an AMD host: eight of nine cases), although torch's kernels were pinned to AVX2
(ATEN_CPU_CAPABILITY) and MKL's to its AVX2 path (MKL_CBWR, both in tests/conftest.py). The cases therefore run with
``optim.eps=1e-3``, which keeps the update linear in small gradients, so rounding stays rounding-sized. Measured on
one host, AVX2 against scalar (``ATEN_CPU_CAPABILITY=default``) kernels as the stand-in for another CPU, from the
same starting weights: every compared metric of the seven math cases equal to 1e-6 (it was 7% on kl/mean with
eps=1e-8), update fingerprints within 2e-6 relative; the search cases within 1e-6 too. The search cases' warm
start (120 supervised steps at eps=1e-8) is itself rebuilt by the test and carries the kernels' rounding into its
weights (8.6e-5 of its update's norm in that comparison); from there the search metrics moved up to 2.5e-2 relative
(kl/mean ~1.5e-4) and 2e-3 on grad norms, so the search cases are compared at 1e-2 relative, 1e-5 absolute.

The runs keep ``model.share_prompt_training=false`` (the training pass as recorded: one pass per row). Sharing each
group's prompt in the differentiable pass gives the same gradients up to float rounding (float64-exact:
tests/trainer/test_shared_prompt_grad.py).

Re-recorded on 2026-12-06 with the current code (eff2274 plus this file's change of settings), which passed the
previous file on its host.

Regenerate (only when a change is *meant* to alter training numbers, and say so in the commit):
    OMP_NUM_THREADS=1 .venv/bin/python -m tests.trainer.test_golden
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

if __name__ == "__main__":  # regenerating: the same kernels as the tests (tests/conftest.py)
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("MKL_CBWR", "AVX2")
import torch  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "trainer_golden.json"

COMMON = [
    "logging.progress=false", "logging.tensorboard=false", "run.total_steps=3", "run.save_every=0",
    "data.prompts_per_step=2", "rollout.n_samples=4", "rollout.max_tokens_per_turn=16", "rollout.max_response_tokens=16",
    "algorithm.micro_batch_size=2", "optim.lr=3e-3", "run.seed=7", "model.share_prompt_training=false", "optim.eps=1e-3",
]

CASES: dict[str, list[str]] = {
    # two mini-batches: π_old and the anchor's statistics are stored before the update
    "emapg_topk_reverse": ["algorithm.kl.type=topk_reverse", "algorithm.kl.topk=8", "algorithm.kl.importance_weight=true",
                           "algorithm.ema.decay=0.5", "algorithm.ema.period=1", "algorithm.mini_batch_size=4",
                           "algorithm.loss_agg=token-mean"],
    # one mini-batch, one epoch: the training pass takes its own top-k and gathers the anchor there
    "emapg_topk_reverse_onpolicy": ["algorithm.kl.type=topk_reverse", "algorithm.kl.topk=8", "algorithm.ema.decay=0.5",
                                    "algorithm.ema.period=1", "algorithm.mini_batch_size=8"],
    "emapg_topk_forward": ["algorithm.kl.type=topk_forward", "algorithm.kl.topk=8", "algorithm.kl.tail_grad=exact",
                           "algorithm.ema.decay=0.5", "algorithm.ema.period=1", "algorithm.mini_batch_size=4"],
    "grpo_k3": ["algorithm.name=grpo", "algorithm.kl.type=k3", "algorithm.kl.importance_weight=false",
                "algorithm.ema.decay=1.0", "algorithm.mini_batch_size=4", "algorithm.ppo_epochs=2",
                "algorithm.kl.coef=0.05"],
    "exact_reverse": ["algorithm.kl.type=exact_reverse", "algorithm.ema.decay=0.5", "algorithm.ema.period=1",
                      "algorithm.mini_batch_size=4", "algorithm.kl.coef=0.05"],
    "exact_forward": ["algorithm.kl.type=exact_forward", "algorithm.ema.decay=0.5", "algorithm.ema.period=1",
                      "algorithm.mini_batch_size=8", "algorithm.kl.coef=0.05"],
    "no_kl": ["algorithm.kl.enabled=false", "algorithm.mini_batch_size=4", "algorithm.entropy_coef=0.01"],
}

# The search task on the toy facts (tests/fixtures/trainer.py) from a warm-started policy that answers
# right about half the time: rewards vary within groups, so the policy-gradient term is exercised
# (the random tiny model never scores on math), through the real retriever and the QA reward.
SEARCH_COMMON = ["logging.progress=false", "logging.tensorboard=false", "run.total_steps=3", "run.save_every=0",
                 "data.prompts_per_step=4", "rollout.n_samples=4", "algorithm.micro_batch_size=4", "optim.lr=1e-4",
                 "run.seed=3", "model.share_prompt_training=false", "optim.eps=1e-3"]
SEARCH_CASES: dict[str, list[str]] = {
    "search_emapg_topk_reverse": ["algorithm.mini_batch_size=8", "algorithm.kl.topk=8", "algorithm.ema.decay=0.5",
                                  "algorithm.ema.period=1", "algorithm.kl.coef=0.01"],
    "search_grpo_k3": ["algorithm.name=grpo", "algorithm.kl.type=k3", "algorithm.kl.importance_weight=false",
                       "algorithm.ema.decay=1.0", "algorithm.mini_batch_size=16", "algorithm.ppo_epochs=2",
                       "algorithm.kl.coef=0.01", "algorithm.dual_clip=3.0", "algorithm.loss_agg=seq-mean-token-mean"],
}
WARM_START_STEPS = 120

# time/ and perf/: wall times. mismatch/: the engine's log-probs against the trainer's, which measure float rounding
# between two passes (~1e-7..1e-6) and so the kernels themselves.
SKIP_PREFIXES = ("time/", "perf/", "mismatch/")


def _fingerprint(state: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> dict[str, float]:
    """Two numbers that move when any weight moves differently, taken over the update (weights minus the starting
    ones) and without cancellation (a plain sum of the update cancels down to its rounding): the sum of its absolute
    values and of its squares."""
    delta = [t.double() - start[k].double() for k, t in state.items() if k in start]  # not buffers (rotary inv_freq)
    return {"update_abs_sum": sum(float(d.abs().sum()) for d in delta),
            "update_sumsq": sum(float(d.pow(2).sum()) for d in delta)}


def run_case(name: str, out_dir: Path, model_dir: Path, toy=None) -> dict:
    """One golden case; ``toy`` = (ToyTask, server URL) for the search cases."""
    from safetensors.torch import load_file

    from emapg.config import load_config
    from emapg.paths import CONFIG_DIR
    from trainer.config import TrainConfig
    from trainer.loop import train
    from trainer.reshard import read_training_state

    torch.set_num_threads(1)
    if name in SEARCH_CASES:
        from tests.fixtures.trainer import toy_overrides

        task, url = toy
        overrides = toy_overrides(task, url, out_dir, **{"model.policy": str(model_dir)})
        cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", [*overrides, *SEARCH_COMMON, *SEARCH_CASES[name]])
    else:
        cfg = load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml",
                          [f"run.output_dir={out_dir}", f"model.policy={model_dir}", *COMMON, *CASES[name]])
    history = train(cfg)
    steps = [{k: v for k, v in m.items() if not k.startswith(SKIP_PREFIXES)} for m in history]
    ckpt = out_dir / "step_3"
    start = load_file(str(Path(model_dir) / "model.safetensors"))
    result = {"steps": steps, "policy": _fingerprint(load_file(str(ckpt / "policy" / "model.safetensors")), start)}
    anchor = read_training_state(ckpt).get("anchor")
    if anchor:
        result["anchor"] = _fingerprint(anchor, start)
    return result


def _close(a: float, b: float, *, rel: float = 1e-4, abs_: float = 1e-6) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def _check(name: str, got: dict) -> None:
    golden = json.loads(GOLDEN.read_text())[name]
    # The search cases start from a 120-step supervised warm start, which carries the kernels' rounding into its
    # weights (8.6e-5 of its update's norm, AVX2 against scalar kernels on one host), and 3 steps on carry it to
    # ~1e-3 relative in the metrics (2.5e-2 in kl/mean of ~1.5e-4): their tolerance is that spread's, not 1e-4.
    # Math cases: 1e-4 relative, 2e-6 absolute (the worst spread in that comparison when the starting weights were also
    # built by each kernel set: grpo_k3 loss/ppo_kl 2.63e-5 vs 2.78e-5).
    rel, abs_ = (1e-2, 1e-5) if name in SEARCH_CASES else (1e-4, 2e-6)
    kernels = torch.backends.cpu.get_cpu_capability()
    assert kernels in ("AVX2", "DEFAULT"), (
        f"torch runs its {kernels} CPU kernels; the golden runs were recorded with AVX2 ones "
        "(tests/conftest.py sets ATEN_CPU_CAPABILITY=avx2 before torch is imported)")
    assert os.environ.get("MKL_CBWR") == "AVX2", (
        "the golden runs were recorded with MKL pinned to its AVX2 code path (tests/conftest.py sets MKL_CBWR=AVX2 "
        f"before torch is imported); MKL_CBWR is {os.environ.get('MKL_CBWR')!r}")
    assert len(got["steps"]) == len(golden["steps"]) == 3
    for step, (g, want) in enumerate(zip(got["steps"], golden["steps"]), start=1):
        missing = set(want) - set(g)
        assert not missing, f"step {step}: metrics no longer reported: {sorted(missing)}"
        bad = {k: (g[k], want[k]) for k in want if not _close(float(g[k]), float(want[k]), rel=rel, abs_=abs_)}
        assert not bad, f"step {step}: metrics differ from the golden run (got, golden): {bad}"
    for part in ("policy", "anchor"):
        if part in golden:
            for k, v in golden[part].items():
                assert _close(got[part][k], v, rel=rel, abs_=1e-12), f"{part} weights {k}: {got[part][k]} vs golden {v}"


@pytest.mark.parametrize("name", list(CASES))
def test_golden_run_is_reproduced(name, tmp_path, tiny_model_dir):
    _check(name, run_case(name, tmp_path / name, tiny_model_dir))


@pytest.fixture(scope="module")
def golden_search_policy(toy_warm_policy):
    """The 120-step warm start (WARM_START_STEPS), cached by content and shared with the other toy-task tests; the
    search cases' tolerance (``_check``) covers the kernels' rounding a cache built elsewhere may carry."""
    from tests.fixtures.trainer import WARM_CACHE_STEPS

    assert WARM_CACHE_STEPS == WARM_START_STEPS
    return toy_warm_policy


@pytest.mark.parametrize("name", list(SEARCH_CASES))
def test_golden_search_run_is_reproduced(name, tmp_path, golden_search_policy, toy_task, toy_server):
    got = run_case(name, tmp_path / name, golden_search_policy, toy=(toy_task, toy_server.url))
    rewards = [s["reward/mean"] for s in got["steps"]]
    assert any(0.0 < r < 1.0 for r in rewards), f"the search cases must exercise the policy gradient: {rewards}"
    _check(name, got)


def main() -> int:  # regenerate the golden file
    import tempfile

    from emapg.models import tiny_qwen2_folder

    from retriever.launch import RetrieverServer
    from tests.fixtures.trainer import build_toy_task, warm_start

    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_qwen2_folder(Path(tmp) / "tiny-qwen2")
        out = {name: run_case(name, Path(tmp) / name, model) for name in CASES}
        task = build_toy_task(Path(tmp) / "toy")
        policy = warm_start(model, task, Path(tmp) / "warm", steps=WARM_START_STEPS)
        with RetrieverServer(task.index_dir, omp_num_threads=1, device="cpu", topk=1) as server:
            for name in SEARCH_CASES:
                out[name] = run_case(name, Path(tmp) / name, policy, toy=(task, server.url))
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
