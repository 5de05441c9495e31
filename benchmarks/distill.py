"""On-policy distillation on the search task: does a student distilled from a teacher approach the teacher's EM?

Teacher: the shipped starter search policy (``emapg.models.STARTER``); student: the raw SmolLM2-135M-Instruct (same
tokenizer). The student trains with ``algorithm.distill`` (``--estimator``, ``--mode``; the teacher in process, or
behind ``emapg engine serve`` with ``--remote-teacher``) on the search config's training questions through one real
retriever over the bundled index; before and after, the student's held-out EM (``qa_quick``, sampled at
temperature 1, ``--n`` samples per question, mean over samples) is measured on the same questions as the teacher's.

Output: ``benchmarks/results/distill.json`` with the contract keys ``teacher_sampled_em``, ``student_sampled_em_start``,
``student_sampled_em_end`` (pooled percent), ``student_end_minus_start_ci`` (paired bootstrap 95% interval of end −
start, percentage points) and ``steps``, plus the run's minutes, teacher scoring time and per-step distillation metrics.

    python benchmarks/distill.py                 # SmolLM2-135M student, starter teacher: hours on 2 CPU cores
    python benchmarks/distill.py --quick         # smoke run: tiny-qwen2 teacher, a perturbed tiny-qwen2 student, 2 steps
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
CONTRACT = ("teacher_sampled_em", "student_sampled_em_start", "student_sampled_em_end", "student_end_minus_start_ci", "steps")


def perturbed_copy(src: str, out: Path, scale: float = 0.5, seed: int = 0) -> Path:
    """``src`` with Gaussian noise on every weight (``scale`` x the tensor's mean magnitude): a student with the same tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emapg.models import resolve_model

    path = resolve_model(src)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: tiny models, 2k-passage index, 2 steps, 2 q/set")
    p.add_argument("--teacher", default=None, help="teacher model (default: the starter search policy)")
    p.add_argument("--student", default=None, help="student model (default: smollm2-135m-instruct)")
    p.add_argument("--steps", type=int, default=None, help="distillation steps (default 40; --quick 2)")
    p.add_argument("--estimator", default="sampled_reverse_kl", choices=["sampled_reverse_kl", "topk_reverse_kl"])
    p.add_argument("--mode", default="alone", choices=["alone", "added", "below_best"])
    p.add_argument("--topk", type=int, default=16, help="k of topk_reverse_kl")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the config's)")
    p.add_argument("--remote-teacher", action="store_true", help="serve the teacher with `emapg engine serve` (hf engine)")
    p.add_argument("--per-dataset", type=int, default=None, help="held-out questions per QA set (default 20; --quick 2)")
    p.add_argument("--n", type=int, default=2, help="samples per held-out question (sampled EM: mean over samples)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "distill.json"))
    p.add_argument("--work", default=None, help="folder for the run and evaluations (default: a temp folder, removed)")
    args = p.parse_args(argv)
    if args.n < 1 or (args.steps is not None and args.steps < 1):
        p.error("--n and --steps must be >= 1")
    for k, v in {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "3"}.items():
        os.environ.setdefault(k, v)

    from agent.engines.launch import EngineServer
    from emapg.config import load_config
    from emapg.models import STARTER
    from emapg.paths import CONFIG_DIR
    from eval.learning import compare_learning
    from eval.protocols import get_protocol
    from eval.runner import EvalConfig, run_eval
    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever
    from tasks.datasets import QA_DATASETS
    from trainer.config import TrainConfig
    from trainer.loop import train

    t0 = time.perf_counter()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="distill-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.quick:
        teacher = args.teacher or "tiny-qwen2"
        student = args.student or str(perturbed_copy(teacher, work / "student", seed=args.seed))
        config, engine_kind, index_limit = "search_tiny_cpu.yaml", "hf", 2000
        steps, per_dataset = args.steps or 2, args.per_dataset or 2
        protocol_base: dict[str, Any] = {"max_tokens": 24, "max_turns": 2}
        extra = ["data.prompts_per_step=2", "algorithm.mini_batch_size=8", "rollout.max_response_tokens=96",
                 "rollout.max_tokens_per_turn=24", "rollout.max_obs_tokens=32", "logging.tensorboard=false"]
    else:
        teacher, student = args.teacher or STARTER, args.student or "smollm2-135m-instruct"
        config, engine_kind, index_limit = "demo_search_smollm2.yaml", "hf", None
        steps, per_dataset = args.steps or 40, args.per_dataset or 20
        protocol_base, extra = {}, []
    index_dir = ensure_bundled_index(index_limit)
    rollout = load_config(TrainConfig, CONFIG_DIR / config, []).rollout
    max_model_len = rollout.max_prompt_tokens + rollout.max_response_tokens
    datasets = list(QA_DATASETS)
    protocol = get_protocol("qa_quick", **protocol_base, temperature=1.0, n=args.n, seed=args.seed)
    dirs: dict[str, Path] = {}
    with open_retriever(index_dir=index_dir, log_path=work / "retriever.log") as retriever:
        def evaluate(label: str, model: str) -> None:
            with EngineServer(model, engine=engine_kind, max_model_len=max_model_len, omp_num_threads=os.cpu_count() or 1,
                              startup_timeout=900, log_path=work / f"engine-{label}.log") as engine:
                out = work / f"eval-{label}"
                run_eval(EvalConfig(model=model, out=str(out), protocol=protocol, datasets=datasets, limit=per_dataset,
                                    data_seed=0, engine="remote", engine_urls=[engine.url], retriever_url=retriever.urls[0],
                                    progress=False, name=f"{label} heldout sampled", batch_across_datasets=True, batch_size=64))
            dirs[label] = out
            print(f"[distill] {label} evaluated ({(time.perf_counter() - t0) / 60:.1f} min)", flush=True)

        evaluate("teacher", teacher)
        evaluate("student_start", student)
        run_dir = work / "run"
        overrides = [f"run.output_dir={run_dir}", f"model.policy={student}", f"retriever.urls=[{retriever.urls[0]}]",
                     f"run.total_steps={steps}", f"run.save_every={steps}", "run.keep_last=1", f"run.seed={args.seed}",
                     "logging.progress=false", "algorithm.distill.enabled=true", f"algorithm.distill.estimator={args.estimator}",
                     f"algorithm.distill.mode={args.mode}", f"algorithm.distill.topk={args.topk}", *extra,
                     *([f"optim.lr={args.lr}"] if args.lr else [])]
        t_train = time.perf_counter()
        if args.remote_teacher:
            with EngineServer(teacher, engine="hf", max_model_len=max_model_len, startup_timeout=900,
                              log_path=work / "teacher.log") as served:
                os.environ.pop("EMAPG_ENGINE_API_KEY", None)
                history = train(load_config(TrainConfig, CONFIG_DIR / config,
                                            [*overrides, f"algorithm.distill.teacher_urls=[{served.url}]",
                                             "algorithm.distill.teacher_api_key_env="]))
        else:
            history = train(load_config(TrainConfig, CONFIG_DIR / config, [*overrides, f"algorithm.distill.teacher={teacher}"]))
        train_s = time.perf_counter() - t_train
        evaluate("student_end", str(run_dir / f"step_{steps}" / "policy"))

    start_vs_end = compare_learning(dirs["student_start"], dirs["student_end"], datasets)["pooled"]
    teacher_em = compare_learning(dirs["student_start"], dirs["teacher"], datasets)["pooled"]["trained"]
    d = start_vs_end["difference"]
    report: dict[str, Any] = {
        "benchmark": "distill", "mode": "quick" if args.quick else "default", "teacher": teacher, "student": student,
        "teacher_sampled_em": teacher_em,
        "student_sampled_em_start": start_vs_end["base"],
        "student_sampled_em_end": start_vs_end["trained"],
        "student_end_minus_start_ci": {k: d[k] for k in ("mean", "low", "high", "confidence", "method")},
        "steps": steps,
        "distill": {"estimator": args.estimator, "mode": args.mode, "topk": args.topk,
                    "teacher": "remote (emapg engine serve, hf)" if args.remote_teacher else "in process"},
        "heldout": {"datasets": datasets, "per_dataset": per_dataset, "questions": start_vs_end["n"], "data_seed": 0,
                    "decoding": f"sampled, temperature 1, n={args.n}, mean over samples"},
        "train_minutes": round(train_s / 60, 2),
        "teacher_scoring_s": round(sum(h.get("time/teacher", 0.0) for h in history), 2),
        "step_s": [round(h.get("time/step", float("nan")), 2) for h in history],
        "distill_reverse_kl": [round(h.get("distill/reverse_kl", float("nan")), 4) for h in history],
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": {"cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    ci = report["student_end_minus_start_ci"]
    print(f"held-out sampled EM (%): teacher {teacher_em:.1f}; student {report['student_sampled_em_start']:.1f} -> "
          f"{report['student_sampled_em_end']:.1f} ({ci['mean']:+.1f} pp [{ci['low']:+.1f}, {ci['high']:+.1f}]) after {steps} "
          f"steps ({report['train_minutes']:.1f} min); wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
