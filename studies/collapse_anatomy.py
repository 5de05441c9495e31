"""Anatomy of a late collapse (issue #42): what the one update that broke a learning GRPO run changed, whether the
weights showed it coming, and what the guard's rollback does with it.

PROTOCOL (written 2026-12-06 09:55 UTC, after amendment 6 of ``studies/stability.py``; descriptive, not a test of
a hypothesis: it dissects the one collapse after a learning phase that the stability benchmark has measured)
====================================================================================================================

The run. Amendment 6's GRPO seed 2 (toy search task, lr 6e-4, beta 0.001, 64 steps; ``stability_late.json``):
reward 0.91 at step 40, 0.00 from step 41 on, and nothing led it. It is trained again with the same settings,
keeping every step's checkpoint; its reward series must equal the recorded one (a reproduction, else the script
stops). A healthy run beside it: seed 0 of the same arm (learned to 0.94 and stayed).

Anchors. The run's own correct trajectories of its first 12 steps (the logged samples; one per question), teacher
forced through every step's checkpoint: the log-probability of each model token.

* **The flipped token**: the anchor position whose log-probability fell most across the update into the collapse
  (the checkpoint of step c - 1 vs c - 2, c the collapse step: the weights of step c - 1 generate step c's
  rollouts), and every anchor position with the same (previous token, token) pair.
* Per step, for both runs: that token's mean log-probability over the anchors; its **sensitivity**, the norm of
  the gradient of that mean log-probability with respect to every weight; the update's norm
  (||theta_s - theta_{s-1}||).
* At the breaking update: the first-order prediction of the token's change (gradient . update) against the actual
  change, and the change at half the update (is the break linear in the step?).
* **The guard**: the same run with the guard on (every detector's action ``rollback``, a checkpoint every step):
  its rewards, trips and rollbacks.

Cost: three 64-step toy runs and ~130 teacher-forced passes, about 6 min on 2 free cores.

    python studies/collapse_anatomy.py            # writes benchmarks/results/collapse_anatomy.json and .png
    python studies/collapse_anatomy.py --quick --work /tmp/anatomy   # 8 steps, any run (a smoke run of the code)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from studies import harness  # noqa: E402
RESULTS = harness.RESULTS
LATE = {"lr": 6e-4, "beta": 0.001, "steps": 64}  # amendment 6's stress (stability_late.json)
COLLAPSED_SEED, HEALTHY_SEED = 2, 0
ANCHOR_STEPS = 12  # anchors: correct trajectories logged in the first steps


def anchors(run: Path, tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(token ids, model-token mask) of the run's first correct trajectory per question in its first
    :data:`ANCHOR_STEPS` steps (segments tokenized one by one, observations masked)."""
    from emapg.jsonl import read_jsonl

    chosen: dict[str, dict[str, Any]] = {}
    for s in read_jsonl(run / "samples.jsonl"):
        if s["reward"] >= 1.0 and s["step"] <= ANCHOR_STEPS and s["question"] not in chosen:
            chosen[s["question"]] = s
    out = []
    for s in chosen.values():
        ids = tokenizer(s["prompt"], add_special_tokens=False)["input_ids"]
        mask = [0] * len(ids)
        for seg in s["segments"]:
            t = tokenizer(seg["text"], add_special_tokens=False)["input_ids"]
            ids, mask = ids + t, mask + [0 if seg["masked"] else 1] * len(t)
        out.append((ids, mask))
    return out


def token_logprobs(model: Any, seqs: list[tuple[list[int], list[int]]]) -> list[Any]:
    """Per anchor: the log-probability of each next token (position i predicts token i + 1), a graph-carrying tensor."""
    import torch

    out = []
    for ids, _ in seqs:
        x = torch.tensor(ids)
        logp = torch.log_softmax(model(x[None]).logits[0, :-1].float(), -1)
        out.append(logp.gather(-1, x[1:, None])[:, 0])
    return out


def load(run: Path, step: int) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(run / f"step_{step}" / "policy", dtype="float32").eval()


def flipped_token(run: Path, seqs: list[tuple[list[int], list[int]]], collapse: int) -> tuple[int, int]:
    """The (previous token, token) pair of the model position whose log-probability fell most from the checkpoint of
    step ``collapse - 2`` to that of ``collapse - 1``."""
    import torch

    with torch.no_grad():
        before, after = token_logprobs(load(run, collapse - 2), seqs), token_logprobs(load(run, collapse - 1), seqs)
    best = (0.0, (0, 0))
    for (ids, mask), b, a in zip(seqs, before, after):
        for i in range(len(ids) - 1):
            if mask[i + 1] and (b[i] - a[i]).item() > best[0]:
                best = ((b[i] - a[i]).item(), (ids[i], ids[i + 1]))
    return best[1]


def positions(seqs: list[tuple[list[int], list[int]]], pair: tuple[int, int]) -> list[list[int]]:
    return [[i for i in range(len(ids) - 1) if mask[i + 1] and (ids[i], ids[i + 1]) == pair] for ids, mask in seqs]


def token_logprob(model: Any, seqs: list[tuple[list[int], list[int]]], where: list[list[int]]) -> Any:
    lps = token_logprobs(model, seqs)
    picked = [lp[i] for lp, idx in zip(lps, where) for i in idx]
    return sum(picked) / len(picked)


def series(run: Path, seqs: list[tuple[list[int], list[int]]], where: list[list[int]], steps: int) -> list[dict[str, float]]:
    """Per checkpoint: the flipped token's mean log-probability, its sensitivity and the update norm into it."""
    from safetensors.torch import load_file

    rows, prev = [], None
    for step in range(1, steps + 1):
        model = load(run, step)
        lp = token_logprob(model, seqs, where)
        lp.backward()
        sens = sum(float((p.grad ** 2).sum()) for p in model.parameters() if p.grad is not None) ** 0.5
        weights = load_file(run / f"step_{step}" / "policy" / "model.safetensors")
        update = None if prev is None else sum(float(((weights[k].float() - prev[k].float()) ** 2).sum()) for k in weights) ** 0.5
        rows.append({"step": step, "logprob": lp.item(), "sensitivity": sens, "update_norm": update})
        prev = weights
    return rows


def breaking_update(run: Path, seqs: list[tuple[list[int], list[int]]], where: list[list[int]], step: int) -> dict[str, float]:
    """The update from checkpoint ``step - 1`` to ``step``: the token's first-order predicted change, the actual
    change and the change at half the update."""
    import torch

    model, nxt = load(run, step - 1), load(run, step)
    lp = token_logprob(model, seqs, where)
    lp.backward()
    delta = {n: q.detach() - p.detach() for (n, p), q in zip(model.named_parameters(), nxt.parameters())}
    predicted = sum(float((p.grad * delta[n]).sum()) for n, p in model.named_parameters() if p.grad is not None)
    with torch.no_grad():
        actual = (token_logprob(nxt, seqs, where) - lp).item()
        for n, p in model.named_parameters():
            p.add_(0.5 * delta[n])
        half = (token_logprob(model, seqs, where) - lp).item()
    return {"from_step": step - 1, "to_step": step, "logprob_before": lp.item(), "first_order_change": predicted,
            "actual_change": actual, "half_update_change": half}


def plot(report: dict[str, Any], path: Path) -> Path:
    fig, axes = harness.figure(1, 3, figsize=(15, 4))
    for key, style in (("collapsed", "-"), ("healthy", "--")):
        run = report[key]
        xs = [r["step"] for r in run["token"]]
        axes[0].plot(xs, [-r["logprob"] for r in run["token"]], style, label=f"{key} (seed {run['seed']})")
        axes[1].plot(xs, [r["sensitivity"] for r in run["token"]], style, label=f"{key} (seed {run['seed']})")
        axes[2].plot(range(1, len(run["reward"]) + 1), run["reward"], style, label=f"{key} (seed {run['seed']})")
    g = report["guarded"]
    axes[2].plot(range(1, len(g["reward"]) + 1), g["reward"], ":", label=f"collapsed seed with the guard ({len(g['rollbacks'])} rollbacks)")
    axes[0].set_yscale("log")
    axes[0].set_title(f"-log p({report['flipped_token']['text']!r}) on the anchors")
    axes[1].set_yscale("log")
    axes[1].set_title("its sensitivity ||grad log p||")
    axes[2].set_title("mean reward")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return harness.save_figure(fig, path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 steps: a smoke run of the code (its collapse step is the run's last "
                   "reward minimum, not a collapse), written to --work")
    p.add_argument("--work", type=Path, default=None, help="run folders (kept; finished runs are reused)")
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/results/collapse_anatomy.json (--quick: in --work)")
    harness.add_arguments(p)
    args = p.parse_args(argv)
    provenance = harness.start(__file__, quick=args.quick, allow_dirty=args.allow_dirty, also=["studies/stability.py"])
    harness.environment(OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from studies.stability import Runner, toy_base
    from emapg.paths import CONFIG_DIR
    from retriever.launch import RetrieverServer
    from tests.fixtures.trainer import build_toy_task
    from transformers import AutoTokenizer
    from trainer.collapse import collapse_step
    from trainer.recovery import read_guard_events
    from trainer.tracking import read_metrics

    steps = 8 if args.quick else LATE["steps"]
    work = args.work or Path(tempfile.mkdtemp(prefix="anatomy-"))
    out = args.out or (work / "collapse_anatomy.json" if args.quick else RESULTS / "collapse_anatomy.json")
    task = build_toy_task(work / "task")
    runner = Runner(work, steps=steps, prompts=8, samples=4, probe=8)
    with RetrieverServer(task.index_dir, omp_num_threads=1, device="cpu", topk=1, startup_timeout=900) as server:
        base = toy_base(task, server.url, work)

        def train(seed: int, guard: bool) -> Path:
            name = f"grpo_seed{seed}{'_guard' if guard else ''}"
            runner.run(name, CONFIG_DIR / "search_tiny_cpu.yaml", base, "grpo", seed, LATE["lr"], LATE["beta"], guard=guard,
                       keep_checkpoints=True)
            return work / name / "run"

        runs = {seed: train(seed, guard=False) for seed in (COLLAPSED_SEED, HEALTHY_SEED)}
        guarded = train(COLLAPSED_SEED, guard=True)
    rewards = {seed: [float(m["reward/mean"]) for m in read_metrics(run)] for seed, run in runs.items()}
    recorded = json.loads((RESULTS / "stability_late.json").read_text())["toy"]["runs"]["grpo"][str(COLLAPSED_SEED)]["reward"]
    reproduced = [round(x, 6) for x in rewards[COLLAPSED_SEED]] == [round(x, 6) for x in recorded[:steps]]
    if not args.quick and not reproduced:
        raise SystemExit(f"the rerun did not reproduce stability_late.json's GRPO seed {COLLAPSED_SEED}: {rewards[COLLAPSED_SEED]}")
    collapse = collapse_step(rewards[COLLAPSED_SEED], [0.0] * steps)
    if collapse is None or collapse < 4:  # --quick: the last step stands in (a smoke run of the code)
        collapse = steps
    collapsed_run = runs[COLLAPSED_SEED]
    tokenizer = AutoTokenizer.from_pretrained(collapsed_run / "step_1" / "policy")
    seqs = anchors(collapsed_run, tokenizer)
    pair = flipped_token(collapsed_run, seqs, collapse)
    where = positions(seqs, pair)
    healthy_seqs = anchors(runs[HEALTHY_SEED], tokenizer)
    healthy_where = positions(healthy_seqs, pair)
    report: dict[str, Any] = {
        "date": harness.now(), "provenance": provenance, "protocol": "studies/collapse_anatomy.py docstring", "quick": args.quick, "settings": {**LATE, "steps": steps, "arm": "grpo"},
        "reproduced_stability_late": reproduced, "collapse_step": collapse, "anchors": len(seqs),
        "flipped_token": {"previous": tokenizer.decode([pair[0]]), "text": tokenizer.decode([pair[1]]),
                          "anchor_positions": sum(len(w) for w in where)},
        "collapsed": {"seed": COLLAPSED_SEED, "reward": rewards[COLLAPSED_SEED], "token": series(collapsed_run, seqs, where, steps),
                      "breaking_update": breaking_update(collapsed_run, seqs, where, collapse - 1),
                      "zero_variance_groups": [float(m["reward/zero_variance_groups"]) for m in read_metrics(collapsed_run)]},
    }
    if any(healthy_where):
        report["healthy"] = {"seed": HEALTHY_SEED, "reward": rewards[HEALTHY_SEED],
                             "token": series(runs[HEALTHY_SEED], healthy_seqs, healthy_where, steps)}
    events = read_guard_events(guarded)
    report["guarded"] = {"seed": COLLAPSED_SEED, "reward": [float(m["reward/mean"]) for m in read_metrics(guarded)],
                         "trips": [{k: e[k] for k in ("step", "detector", "value", "threshold", "action")} for e in events],
                         "rollbacks": [e["detail"] for e in events if e["detail"].startswith("rollback:")]}
    c = report["collapsed"]["token"]
    before = [r for r in c if r["step"] < collapse - 1]
    report["summary"] = {
        "token_logprob_before_break": c[collapse - 3]["logprob"], "token_logprob_after_break": c[collapse - 2]["logprob"],
        "sensitivity_max_before_break": max(r["sensitivity"] for r in before),
        "sensitivity_at_last_checkpoint_before_break": c[collapse - 3]["sensitivity"],
        "update_norm_breaking": c[collapse - 2]["update_norm"],
        "update_norm_range_before": [min(r["update_norm"] for r in before[1:]), max(r["update_norm"] for r in before[1:])],
    }
    if "healthy" in report:
        h = report["healthy"]["token"]
        report["summary"] |= {"healthy_token_logprob_min": min(r["logprob"] for r in h),
                              "healthy_sensitivity_max": max(r["sensitivity"] for r in h)}
    out.parent.mkdir(parents=True, exist_ok=True)
    if "healthy" in report:
        report["plot"] = plot(report, out.with_suffix(".png")).name
    out.write_text(json.dumps(report, indent=2))
    b = report["collapsed"]["breaking_update"]
    print(f"flipped token {report['flipped_token']['previous']!r} -> {report['flipped_token']['text']!r}; breaking update "
          f"{b['from_step']} -> {b['to_step']}: log p {b['logprob_before']:.4f}, first-order change {b['first_order_change']:+.4f}, "
          f"actual {b['actual_change']:+.4f}, half update {b['half_update_change']:+.4f}")
    print(json.dumps(report["summary"], indent=1))
    print(f"guarded: {len(report['guarded']['rollbacks'])} rollbacks, reward at the end {report['guarded']['reward'][-1]:.3f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
