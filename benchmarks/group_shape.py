"""Which group shape spends the fewest trajectories per informative group: prompts x group size at equal trajectories.

GRPO learns only from groups whose rewards differ. With ``rollout.uniform_groups=drop`` a step pays generation for
every trajectory and the update only for the informative groups' rows, so the shape that yields the most
informative groups per minute is the better default. This measures it with the starter search policy on fresh
questions of the answerable training pool (``qa_pool``, seeded sampler, none repeated), through the real retriever
and one vLLM engine, at the training temperature (the demo config's rollout):

* each shape (``--shapes``, default 8x4 and 4x8: 32 trajectories a round) samples ``--rounds`` rounds, alternating
  shapes round by round; per shape: the informative-group share, informative groups and rows trained per round,
  the generation time;
* informative groups per minute = informative groups / (generation time + trained rows x the update's seconds per
  row), the update cost per row taken from ``benchmarks/results/update_speed.json`` (the ``--update-arm``, default
  ``bf16``: what the demo trains with).

Writes ``benchmarks/results/group_shape.json`` (``informative_groups_per_min`` per shape and ``best``).

    python benchmarks/group_shape.py            # 2 shapes x 6 rounds x 32 trajectories (~5 min on 2 cores)
    python benchmarks/group_shape.py --quick    # tiny-qwen2, hf engine, 1 round of 2 shapes x 8 (< 1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"


def parse_shape(text: str) -> tuple[int, int]:
    prompts, _, group = text.partition("x")
    if not (prompts.isdigit() and group.isdigit()) or int(prompts) < 1 or int(group) < 2:
        raise argparse.ArgumentTypeError(f"a shape is PROMPTSxGROUP with GROUP >= 2, e.g. 8x4; got {text!r}")
    return int(prompts), int(group)


def update_seconds_per_row(arm: str) -> tuple[float, str]:
    path = RESULTS / "update_speed.json"
    data = json.loads(path.read_text())
    a = data["arms"][arm]
    return a["update_plus_export_s"] / data["rows"], f"{path.name} arm {arm}: {a['update_plus_export_s']:.1f} s for {data['rows']} rows"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=[(8, 4), (4, 8)], help="PROMPTSxGROUP shapes (equal trajectories)")
    p.add_argument("--rounds", type=int, default=6, help="rounds per shape (alternating)")
    p.add_argument("--update-arm", default="bf16", help="update_speed.json arm whose seconds per row price the update")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-qwen2, hf engine, 2k-passage index, 1 round of 2x4 and 1x8")
    p.add_argument("--out", type=Path, default=RESULTS / "group_shape.json")
    args = p.parse_args(argv)
    for k, v in {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "3"}.items():
        os.environ.setdefault(k, v)
    from transformers import AutoTokenizer

    from emapg.config import load_config
    from emapg.models import STARTER, resolve_model
    from emapg.paths import CONFIG_DIR
    from provision.engines import EngineSpec, build_engine
    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever
    from retriever.client import RetrieverClient
    from trainer.config import TrainConfig
    from trainer.data import PromptSampler, load_prompts
    from trainer.group_filter import informative_groups
    from trainer.sampled_batch import generate, grade, step_seed

    t0 = time.perf_counter()
    shapes = [(2, 4), (1, 8)] if args.quick else args.shapes
    rounds = 1 if args.quick else args.rounds
    policy = "tiny-qwen2" if args.quick else STARTER
    config = CONFIG_DIR / ("search_tiny_cpu.yaml" if args.quick else "demo_search_smollm2.yaml")
    per_row_s, per_row_source = (0.05, "quick: a fixed 0.05 s per row") if args.quick else update_seconds_per_row(args.update_arm)
    model_path = resolve_model(policy)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    base = load_config(TrainConfig, config, [f"model.policy={policy}", "data.train=qa_pool", "data.split=train"])
    sampler = PromptSampler(load_prompts("qa_pool", split="train", limit=None, seed=0), seed=0)  # fresh questions, no repeats
    r = base.rollout
    results: dict[str, dict[str, Any]] = {f"{pr}x{g}": {"prompts": pr, "group_size": g, "rounds": []} for pr, g in shapes}
    with open_retriever(index_dir=ensure_bundled_index(2000 if args.quick else None)) as served:
        retriever = RetrieverClient(served.urls[0])
        engine = build_engine(EngineSpec("hf" if args.quick else "vllm", model_path,
                                         max_model_len=r.max_prompt_tokens + r.max_response_tokens, seed=0))
        try:
            for k in range(rounds):
                for (prompts, group) in shapes:
                    cfg = load_config(TrainConfig, config, [f"model.policy={policy}", "data.train=qa_pool", f"rollout.n_samples={group}",
                                                            f"data.prompts_per_step={prompts}", f"algorithm.mini_batch_size={prompts * group}",
                                                            "algorithm.micro_batch_size=1"])
                    batch = sampler.next(prompts, k + 1)
                    t = time.perf_counter()
                    trajs, _ = generate(engine, tokenizer, batch, retriever, cfg, seed=step_seed(0, k + 1, 0))
                    gen_s = time.perf_counter() - t
                    rewards = [o.reward for o in grade(trajs, batch, cfg)]
                    import torch

                    inf = int(informative_groups(torch.tensor(rewards), group).sum())
                    results[f"{prompts}x{group}"]["rounds"].append({"generation_s": round(gen_s, 2), "informative_groups": inf,
                                                                   "reward_mean": sum(rewards) / len(rewards)})
                    print(f"[group_shape] round {k + 1} {prompts}x{group}: {inf}/{prompts} informative, "
                          f"reward {sum(rewards) / len(rewards):.2f}, generation {gen_s:.1f} s", flush=True)
        finally:
            engine.close()
            retriever.close()
    for name, res in results.items():
        rs = res["rounds"]
        gen = sum(x["generation_s"] for x in rs)
        inf = sum(x["informative_groups"] for x in rs)
        trained_rows = inf * res["group_size"]
        res.update({"trajectories": len(rs) * res["prompts"] * res["group_size"], "informative_groups": inf,
                    "informative_frac": inf / (len(rs) * res["prompts"]), "generation_s": round(gen, 1),
                    "update_s_estimate": round(trained_rows * per_row_s, 1),
                    "informative_groups_per_min": 60 * inf / (gen + trained_rows * per_row_s),
                    "trained_rows_per_informative_group": res["group_size"]})
    best = max(results, key=lambda n: results[n]["informative_groups_per_min"])
    report = {"benchmark": "group_shape", "mode": "quick" if args.quick else "default", "policy": policy,
              "train_set": "qa_pool (fresh questions, seeded sampler)", "temperature": r.temperature,
              "update_cost": {"seconds_per_trained_row": per_row_s, "source": per_row_source},
              "shapes": results, "best": best, "wall_s": round(time.perf_counter() - t0, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name, res in results.items():
        print(f"{name:>5}: informative {res['informative_frac']:.0%} of groups, {res['informative_groups_per_min']:.2f} informative "
              f"groups/min (generation {res['generation_s']} s + update ~{res['update_s_estimate']} s)")
    print(f"best: {best}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
