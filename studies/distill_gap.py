"""Where a distilled student's sampled shortfall comes from: per-token divergence from the teacher on the student's
own held-out samples, the student's head and tail against the teacher's.

Question (issue #44, after ``distill.json`` and the 40-step follow-on). The student reaches ~80% of the teacher's
greedy EM but ~65% of its sampled EM (T = 1): it loses more than the teacher when it samples. Is its token
distribution flatter than the teacher's where it generates -- more entropy, more mass outside the teacher's top-k --
and in which parts of a response (search queries, answers, the rest)?

Method. For each evaluation folder given (``emapg eval`` items with ``samples``: the reader-slice evaluations of
``studies/distill.py``), every sampled response is split into the model's text and the environment's
observations (``<information>`` blocks and the invalid-action message, :mod:`agent.actions`); the prompt and the
observations are tokenized as the agent tokenized them, the model's text segment by segment (a re-tokenization of
generated text: the report gives how often the count equals the recorded ``model_tokens``). On every model-generated
token, teacher-forced, in fp32 over the whole vocabulary: the exact reverse KL(student || teacher), the student's
and the teacher's entropy, the student's and the teacher's probability mass outside the teacher's top-k, and
whether the two models' argmax agree. Averaged per token, by part of the response (``search`` -- inside
``<search>...</search>``, ``answer`` -- inside ``<answer>...</answer>``, ``other``), for each student checkpoint
given, on the same samples.

    python studies/distill_gap.py --samples runs/distill40_s0/arm_in_process/end_sampled \\
        --student step20=runs/distill/arm_in_process/step_20/policy --student step40=runs/distill40_s0/arm_in_process/step_40/policy \\
        --limit 120 --out benchmarks/results/distill_gap.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from studies import harness  # noqa: E402
RESULTS = harness.RESULTS
PARTS = ("search", "answer", "other")
STATS = ("reverse_kl", "student_entropy", "teacher_entropy", "student_tail_mass", "teacher_tail_mass", "argmax_agree")


def split_response(text: str) -> list[tuple[str, bool]]:
    """``text`` as (segment, generated) pairs: the environment's observations (``<information>`` blocks, the
    invalid-action message) are not generated; everything between them is."""
    from agent.actions import INFO_CLOSE, INFO_OPEN, INVALID_ACTION_MESSAGE

    pattern = re.compile(re.escape(INFO_OPEN) + r".*?" + re.escape(INFO_CLOSE) + "|" + re.escape(INVALID_ACTION_MESSAGE), re.S)
    out, pos = [], 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            out.append((text[pos:m.start()], True))
        out.append((m.group(0), False))
        pos = m.end()
    if pos < len(text):
        out.append((text[pos:], True))
    return out


def part_labels(segment: str, offsets: list[tuple[int, int]]) -> list[str]:
    """Per token of a generated ``segment`` (its character ``offsets``): ``search`` or ``answer`` when the token lies
    inside that tag's content, else ``other``."""
    spans = [(m.start(2), m.end(2), m.group(1)) for m in re.finditer(r"<(search|answer)>(.*?)</\1>", segment, re.S)]
    labels = []
    for a, b in offsets:
        mid = (a + b) / 2
        labels.append(next((kind for lo, hi, kind in spans if lo <= mid < hi), "other"))
    return labels


def encode(tokenizer: Any, prompt: str, response: str) -> tuple[list[int], list[str | None], int]:
    """Token ids of prompt + response, a part label per token (None: not generated) and the generated-token count."""
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    labels: list[str | None] = [None] * len(ids)
    generated = 0
    for segment, is_generated in split_response(response):
        enc = tokenizer(segment, add_special_tokens=False, return_offsets_mapping=is_generated)
        ids += enc["input_ids"]
        if is_generated:
            labels += part_labels(segment, enc["offset_mapping"])
            generated += len(enc["input_ids"])
        else:
            labels += [None] * len(enc["input_ids"])
    return ids, labels, generated


def token_stats(student_logits: Any, teacher_logits: Any, topk: int) -> dict[str, Any]:
    """Per position (logits ``[T, V]``, the same positions): :data:`STATS` as ``[T]`` tensors, exact over the vocabulary."""
    import torch

    s, t = torch.log_softmax(student_logits.float(), -1), torch.log_softmax(teacher_logits.float(), -1)
    ps, pt = s.exp(), t.exp()
    head = t.topk(topk, dim=-1).indices
    return {"reverse_kl": (ps * (s - t)).sum(-1), "student_entropy": -(ps * s).sum(-1), "teacher_entropy": -(pt * t).sum(-1),
            "student_tail_mass": 1 - ps.gather(-1, head).sum(-1), "teacher_tail_mass": 1 - pt.gather(-1, head).sum(-1),
            "argmax_agree": (s.argmax(-1) == t.argmax(-1)).float()}


def load_samples(folders: list[Path], limit: int | None) -> list[dict[str, Any]]:
    """(prompt, response, recorded model tokens, EM) of every sample of the evaluations in a fixed shuffled order (seed
    0), the first ``limit``."""
    rows = []
    for folder in folders:
        for f in sorted((folder / "items").glob("*.jsonl")):
            for line in f.read_text().splitlines():
                if not line.strip():
                    continue
                item = json.loads(line)
                for k, sample in enumerate(item.get("samples") or [item]):
                    rows.append({"id": f"{item['dataset']}/{item['id']}/{k}", "prompt": item["prompt"], "response": sample["response"],
                                 "model_tokens": sample.get("model_tokens"),
                                 "em": float((sample.get("scores") or {}).get("em", 0.0))})
    random.Random(0).shuffle(rows)  # a limit takes a sample of every dataset, not the first files' questions
    return rows[:limit] if limit else rows


def measure(teacher: str, students: dict[str, str], samples: list[dict[str, Any]], topk: int) -> dict[str, Any]:
    """Per student: :data:`STATS` averaged over generated tokens, per part and over all."""
    import torch
    from transformers import AutoTokenizer

    from emapg.models import load_merged_model, resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(teacher))
    encoded = [encode(tokenizer, r["prompt"], r["response"]) for r in samples]
    recorded = [(r["model_tokens"], g) for r, (_, _, g) in zip(samples, encoded) if r["model_tokens"] is not None]
    models = {"teacher": teacher, **students}
    logits: dict[str, list[Any]] = {}
    for n, (name, path) in enumerate(models.items(), 1):
        model = load_merged_model(resolve_model(path)).float().eval()
        t0 = time.perf_counter()
        with torch.no_grad():
            logits[name] = []
            for k, (ids, labels, _) in enumerate(encoded, 1):
                if k % 20 == 0 or k == len(encoded):  # progress: this takes minutes per model on 2 cores
                    print(f"[distill_gap] model {n}/{len(models)} ({name}): {k}/{len(encoded)} samples, "
                          f"{time.perf_counter() - t0:.0f} s", flush=True)
                gen = [i - 1 for i, lab in enumerate(labels) if lab is not None]  # the logits that predict each generated token
                out = model(input_ids=torch.tensor([ids])).logits[0]
                logits[name].append(out[gen])
        del model
    report: dict[str, Any] = {
        "samples": len(samples), "generated_tokens": sum(g for _, _, g in encoded),
        "retokenized_count_matches_recorded": (sum(a == b for a, b in recorded) / len(recorded)) if recorded else None,
        "students": {}}
    for name in students:
        sums = {p: {k: 0.0 for k in STATS} for p in (*PARTS, "all")}
        counts = {p: 0 for p in (*PARTS, "all")}
        by_em: dict[str, dict[str, float]] = {"right": {k: 0.0 for k in STATS}, "wrong": {k: 0.0 for k in STATS}}
        em_counts = {"right": 0, "wrong": 0}
        for row, (ids, labels, _), s_logits, t_logits in zip(samples, encoded, logits[name], logits["teacher"]):
            stats = token_stats(s_logits, t_logits, topk)
            parts = [lab for lab in labels if lab is not None]
            outcome = "right" if row["em"] >= 1.0 else "wrong"
            for i, part in enumerate(parts):
                for p in (part, "all"):
                    counts[p] += 1
                    for k in STATS:
                        sums[p][k] += float(stats[k][i])
                em_counts[outcome] += 1
                for k in STATS:
                    by_em[outcome][k] += float(stats[k][i])
        report["students"][name] = {
            "per_part": {p: {"tokens": counts[p], **{k: sums[p][k] / counts[p] for k in STATS}} for p in (*PARTS, "all") if counts[p]},
            "by_sample_outcome": {o: {"tokens": em_counts[o], **{k: by_em[o][k] / em_counts[o] for k in STATS}}
                                  for o in by_em if em_counts[o]}}
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=Path, nargs="+", required=True, help="evaluation folders whose sampled responses are scored")
    p.add_argument("--teacher", default=None, help="the teacher (default: the starter search policy)")
    p.add_argument("--student", action="append", required=True, metavar="NAME=PATH", help="a student checkpoint (repeatable)")
    p.add_argument("--topk", type=int, default=16, help="the teacher's head for the tail masses (distill.json: 16)")
    p.add_argument("--limit", type=int, default=None, help="score the first N samples")
    p.add_argument("--out", type=Path, default=RESULTS / "distill_gap.json")
    harness.add_arguments(p)
    args = p.parse_args(argv)
    students = {}
    for item in args.student:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            p.error(f"--student {item!r}: expected NAME=PATH")
        students[name] = path
    provenance = harness.start(__file__, quick=False, allow_dirty=args.allow_dirty)
    import torch

    from emapg.models import STARTER

    torch.manual_seed(0)
    t0 = time.perf_counter()
    samples = load_samples(args.samples, args.limit)
    if not samples:
        p.error(f"no sampled responses in {[str(s) for s in args.samples]}")
    report = {"benchmark": "distill_gap", "date": harness.now(), "provenance": provenance,
              "teacher": args.teacher or STARTER, "students": students, "samples_from": [str(s) for s in args.samples],
              "topk": args.topk, "limit": args.limit, "precision": "fp32, full vocabulary, teacher-forced"}
    report.update(measure(report["teacher"], students, samples, args.topk))
    report["minutes"] = round((time.perf_counter() - t0) / 60, 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, block in report["students"].items():
        for part, s in block["per_part"].items():
            print(f"{name:8s} {part:7s} tokens {s['tokens']:6d}  KL(s||t) {s['reverse_kl']:.3f}  H(s) {s['student_entropy']:.3f}  "
                  f"H(t) {s['teacher_entropy']:.3f}  tail s/t {s['student_tail_mass']:.4f}/{s['teacher_tail_mass']:.4f}  "
                  f"argmax agree {s['argmax_agree']:.3f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
