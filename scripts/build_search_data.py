"""Build the data of a search agent that searches again: multi-hop questions, their coverage, the search slice,
the training pool v2 and the multi-search demonstrations (issue 53).

    /work/heavy python scripts/build_search_data.py --shared ../shared/data      # ~3 min on 2 cores

Writes (deterministic for a given index):

* ``data/qa/multihop/questions.jsonl`` -- the multi-hop questions with known supporting paragraphs
  (:mod:`tasks.multihop`; from ``--shared``; without it the bundled file is reused);
* ``data/qa/multihop/coverage.json`` -- each question's class on the bundled index (:mod:`tasks.coverage`);
* ``data/qa/search_slice.json`` -- the search slice (:data:`SLICE_RULE`), recorded before any RL run;
* ``data/qa/pool_v2/train.jsonl.gz`` + ``record.json`` -- the training pool v2 (:data:`POOL_RULE`);
* ``data/qa/multihop/demonstrations.jsonl`` + ``demonstrations_record.json`` -- SFT trajectories (one or two
  searches, then the answer) replayed through the rollout loop against the live retriever (a real server on a
  port), kept only when the passages shown hold the gold (:data:`DEMO_RULE`);
* ``data/qa/multihop/demonstrations_v3.jsonl`` + ``demonstrations_v3_record.json`` (``--only demos_v3``) -- the
  third starter's: the same rule with need-conditioned think steps before each decision, a larger mix with more
  one-search rows from multi-hop questions the first search answers and "A or B?" 2Wiki questions
  (:data:`DEMO_V3_RULE`, :data:`MIX_V3`).

All served by one retriever: the bundled corpus's MiniLM Flat index on a free 127.0.0.1 port.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.build_qa_pool import write_gzip_jsonl  # noqa: E402  (byte-identical pool files, one writer)

MULTIHOP_DIR = ROOT / "data" / "qa" / "multihop"
POOL_V2_DIR = ROOT / "data" / "qa" / "pool_v2"
TOPK = 3
SLICE_SIZE = 160
SLICE_SEED = 0
DEMO_SEED = 0
DEMOS_TWO = 64  # two-search demonstrations
DEMOS_ONE_MULTIHOP = 28  # one-search demonstrations from multi-hop questions the first search answers
DEMOS_ONE_POOL = 36  # one-search demonstrations from the single-hop training pool (qa_pool)
#: The third starter's mix (issue 53: the second starter searched twice on 98% of reader-slice questions, so more
#: rows answer after one search, from the same multi-hop sources as the two-search rows, and every decision is
#: preceded by a think step naming what a passage shows).
MIX_V3 = {"two": 72, "one_multihop": 36, "one_compare": 12, "one_pool": 40}
POOL_ONE_PER_TWO = 1.0  # pool v2: one-search questions per two-search question

SLICE_RULE = ("HotpotQA dev questions of the bundled multi-hop file (RPT dev and test files; not the RPT 'train' rows, "
              "which are in the bundled hotpotqa train split) whose class on the bundled index is second_search "
              "(tasks.coverage.RULE, top-3): the supporting paragraphs are in the corpus, the first search for the question "
              "text does not show a gold answer, and a second search with a query written from what was shown does; not a "
              "question the first starter trained on nor a qa_pool question; the held-out split's questions first, then a "
              f"seeded sample (seed {SLICE_SEED}) up to {SLICE_SIZE}")
POOL_RULE = ("two-search-answerable (class second_search) and one-search-answerable (class first_search) multi-hop "
             "questions (tasks.coverage.RULE on the bundled index, top-3); where the one-search questions are fewer than "
             "the two-search ones, a seeded sample of qa_pool (one search answers by its own rule) fills up to one per "
             "two-search question; no question of a held-out split (tasks.heldout.heldout_questions: the recorded held-out "
             "split, the search slice)")
DEMO_RULE = ("trajectories replayed through agent.rollout.run_rollouts against the live retriever (rollout section of "
             "configs/sft_smollm2_starter_v2.yaml): two searches (the question text, then the recorded second query) "
             "when the first passages shown lack the gold and the second show it, one search when the first show it; "
             "'shown' = the observation tokens as decoded (after truncation), tasks.qa.gold_shown; no held-out question")
DEMO_V3_RULE = (DEMO_RULE.replace("sft_smollm2_starter_v2", "sft_smollm2_starter_v3") +
                "; plus one-search rows of 2Wiki 'A or B?' questions (class answer_in_question) whose first passages "
                "name the gold; each decision is preceded by a think step written from the passages shown "
                "(trainer.sft.multisearch.with_think: the doc naming the answer, 'it answers the question'; or the doc "
                "naming the bridge entity, 'the answer is not shown'), and the row is replayed again with it and kept "
                "only if still valid (each turn within the 64-token turn budget of the evaluation)")


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------- the multi-hop file, from ../shared/data

def multihop_rows(shared: Path) -> list[dict]:
    from tasks.datasets import load_dataset
    from tasks.heldout import question_key
    from tasks.multihop import MultiHopQuestion

    hotpot_ids = {question_key(ex.question): ex.id for ex in load_dataset("hotpotqa")}
    rows: list[MultiHopQuestion] = []
    for part in ("dev", "test", "train"):
        for line in (shared / "rpt_hotpotqa" / f"{part}.jsonl").read_text().splitlines():
            r = json.loads(line)
            bid = hotpot_ids.get(question_key(r["question"]))
            if bid is None:
                continue
            titles = list(dict.fromkeys(r["supporting_facts"]["title"]))
            rows.append(MultiHopQuestion(bid, r["question"].strip(), [r["answer"].strip()], f"hotpotqa_rpt_{part}",
                                         r["type"], titles))
    for r in json.loads((shared / "hipporag" / "musique_train.json").read_text()):
        paras = r["paragraphs"]
        decomp = [{"question": d["question"], "answer": d["answer"]} for d in r["question_decomposition"]]
        titles = [paras[d["paragraph_support_idx"]]["title"] for d in r["question_decomposition"]
                  if d.get("paragraph_support_idx") is not None]
        rows.append(MultiHopQuestion(f"musique-train-{r['id']}", r["question"].strip(),
                                     list(dict.fromkeys(a.strip() for a in [r["answer"], *r.get("answer_aliases", [])]
                                                        if a.strip())), "musique_train",
                                     r["id"].split("__")[0], titles, decomp))
    wiki = {ex.id: ex for ex in load_dataset("2wikimultihopqa")}
    for line in (shared / "wiki_mini_corpus" / "2wiki_dev_corpus_aligned.jsonl").read_text().splitlines():
        r = json.loads(line)
        ex = wiki.get(f"2wikimultihopqa-dev-{r['row_in_source']}")
        if ex is None or question_key(ex.question) != question_key(r["question"]):
            continue
        rows.append(MultiHopQuestion(ex.id, ex.question.strip(), list(ex.answers), "2wiki_aligned", "2wiki"))
    seen, out = set(), []
    for q in rows:  # RPT's files share a few questions: keep the first
        if q.id not in seen:
            seen.add(q.id)
            out.append(q.to_row())
    return out


# ---------------------------------------------------------------- slice, pool, demonstrations

def excluded_keys() -> dict[str, set[str]]:
    """Question keys the slice must avoid: the first starter's training questions and qa_pool and hotpotqa train."""
    from tasks.datasets import load_dataset
    from tasks.heldout import question_key

    return {"qa_pool": {question_key(ex.question) for ex in load_dataset("qa_pool", split="train")},
            "hotpotqa_train": {question_key(ex.question) for ex in load_dataset("hotpotqa", split="train")},
            "starter_v1": set(json.loads((ROOT / "data/starter/smollm2-135m-search-starter/record.json").read_text())
                              ["question_ids"])}


def build_slice(questions, coverage) -> dict:
    from tasks.datasets import load_dataset
    from tasks.heldout import question_key

    by_id = {q.id: q for q in questions}
    avoid = excluded_keys()
    heldout_ids = {ex.id for ex in load_dataset("hotpotqa", split="heldout")}
    cands = [c for c in coverage if c.klass == "second_search" and c.source in ("hotpotqa_rpt_dev", "hotpotqa_rpt_test")
             and question_key(by_id[c.id].question) not in avoid["qa_pool"] | avoid["hotpotqa_train"]
             and c.id not in avoid["starter_v1"]]
    first = sorted(c.id for c in cands if c.id in heldout_ids)
    rest = sorted(c.id for c in cands if c.id not in heldout_ids)
    random.Random(SLICE_SEED).shuffle(rest)
    ids = sorted(first + rest[:max(0, SLICE_SIZE - len(first))], key=lambda s: int(s.rsplit("-", 1)[1]))
    chosen = {c.id: c for c in cands if c.id in set(ids)}
    return {"rule": SLICE_RULE, "coverage_rule": None, "dataset": "hotpotqa", "size": len(ids), "candidates": len(cands),
            "from_heldout_split": len(first), "ids": ids,
            "types": dict(Counter(by_id[i].type for i in ids)),
            "questions": [{"id": i, "first_ids": chosen[i].first_ids, "second_query": chosen[i].second_query,
                           "second_ids": chosen[i].second_ids} for i in ids]}


def build_pool(questions, coverage, heldout: dict[str, str]) -> tuple[list[dict], dict]:
    from tasks.datasets import load_dataset
    from tasks.heldout import question_key

    by_id = {q.id: q for q in questions}
    rows, seen, dropped = [], set(), Counter()
    for c in coverage:
        if c.klass not in ("first_search", "second_search"):
            continue
        q = by_id[c.id]
        key = question_key(q.question)
        if key in heldout:
            dropped["held_out"] += 1
            continue
        if key in seen:
            continue
        seen.add(key)
        rows.append({"id": q.id, "question": q.question, "golden_answers": q.answers, "origin": q.source,
                     "type": q.type, "searches_needed": 1 if c.klass == "first_search" else 2,
                     "second_query": c.second_query,
                     "data_source": {"2wiki": "2wikimultihopqa"}.get(q.source.split("_")[0], q.source.split("_")[0])})
    two = sum(r["searches_needed"] == 2 for r in rows)
    one = len(rows) - two
    want_pool = max(0, round(POOL_ONE_PER_TWO * two) - one)
    extra = [ex for ex in load_dataset("qa_pool", split="train") if question_key(ex.question) not in seen
             and question_key(ex.question) not in heldout]
    for ex in random.Random(DEMO_SEED).sample(extra, min(want_pool, len(extra))):
        seen.add(question_key(ex.question))
        rows.append({"id": ex.id, "question": ex.question, "golden_answers": list(ex.answers),
                     "origin": ex.meta.get("origin", "qa_pool"), "type": "single", "searches_needed": 1,
                     "second_query": None, "data_source": ex.data_source})
    rows.sort(key=lambda r: r["id"])
    mix = Counter((r["origin"], r["searches_needed"]) for r in rows)
    record = {"rule": POOL_RULE, "size": len(rows),
              "searches_needed": dict(Counter(r["searches_needed"] for r in rows)),
              "mix": {f"{o} / {n} search{'es' if n > 1 else ''}": v for (o, n), v in sorted(mix.items())},
              "dropped_as_heldout": dropped["held_out"]}
    return rows, record


def bridge_entities(q) -> tuple[str, ...]:
    """What a two-search question's second query is about: hop 1's answer (MuSiQue), else the supporting titles' names."""
    from tasks.multihop import entity_name

    if q.decomposition:
        return (q.decomposition[0]["answer"],)
    return tuple(entity_name(t) for t in q.support_titles)


def build_demos(questions, coverage, heldout: dict[str, str], retriever, *, v3: bool = False,
                mix: dict[str, int] | None = None) -> tuple[list[dict], dict]:
    """Candidate scripts (seeded order) replayed through the rollout loop against the live retriever
    (:func:`trainer.sft.multisearch.build_demonstrations`); the verified ones are kept, up to the mix's counts.
    ``v3``: the third starter's mix and config, "A or B?" rows, and think steps."""
    from emapg.config import load_config
    from emapg.models import resolve_model
    from tasks.datasets import load_dataset
    from tasks.heldout import question_key
    from trainer.sft.config import SFTConfig
    from trainer.sft.multisearch import Demo, build_demonstrations, script, searches_by_type
    from transformers import AutoTokenizer

    cfg = load_config(SFTConfig, ROOT / "configs" / f"sft_smollm2_starter_{'v3' if v3 else 'v2'}.yaml",
                      ["data.source=construct", "data.datasets=[qa_pool]", "data.path=null"])  # its rollout section
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(cfg.model.policy))
    by_id = {q.id: q for q in questions}
    rng = random.Random(DEMO_SEED)
    ok = [c for c in coverage if question_key(by_id[c.id].question) not in heldout]
    two = [c for c in ok if c.klass == "second_search"]
    one = [c for c in ok if c.klass == "first_search"]
    rng.shuffle(two)
    rng.shuffle(one)
    pool = [ex for ex in load_dataset("qa_pool", split="train") if question_key(ex.question) not in heldout]
    rng.shuffle(pool)
    want = dict(mix or MIX_V3) if v3 else {"two": DEMOS_TWO, "one_multihop": DEMOS_ONE_MULTIHOP, "one_pool": DEMOS_ONE_POOL}
    cands = [Demo(c.id, by_id[c.id].question, script(by_id[c.id].question, c.second_gold, c.second_query),
                  by_id[c.id].answers, "two", f"{c.source}/{c.type}", bridges=bridge_entities(by_id[c.id]))
             for c in two[:want["two"] * 2]]
    cands += [Demo(c.id, by_id[c.id].question, script(by_id[c.id].question, c.first_gold), by_id[c.id].answers,
                   "one_multihop", f"{c.source}/{c.type}") for c in one[:want["one_multihop"] * 2]]
    if v3:  # "A or B?" (2Wiki comparison): the gold is one the question names; its passage must be shown
        compare = [c for c in ok if c.klass == "answer_in_question" and c.source == "2wiki_aligned"]
        rng.shuffle(compare)
        cands += [Demo(c.id, by_id[c.id].question, script(by_id[c.id].question, by_id[c.id].answers[0]),
                       by_id[c.id].answers, "one_compare", f"{c.source}/compare", gold_in_question=True)
                  for c in compare[:want["one_compare"] * 3]]
    cands += [Demo(ex.id, ex.question.strip(), script(ex.question, ex.answers[0]), list(ex.answers), "one_pool",
                   f"qa_pool/{ex.meta.get('origin', '')}") for ex in pool[:want["one_pool"] * 2]]
    kept, dropped = build_demonstrations(cands, want, tokenizer, retriever, cfg.rollout, think=v3,
                                         max_model_len=cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens)
    rows = [d.to_row(t.num_searches) for d, t in kept]
    record = {"rule": DEMO_V3_RULE if v3 else DEMO_RULE, "mix": want, "kept": dict(Counter(r["kind"] for r in rows)), "dropped": dropped,
              "candidates": len(cands), "searches_per_question_by_type": searches_by_type(rows),
              "mean_searches": round(sum(r["searches"] for r in rows) / max(1, len(rows)), 4)}
    return rows, record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shared", default=None, help="the shared data folder (rebuilds data/qa/multihop/questions.jsonl)")
    p.add_argument("--only", choices=["multihop", "coverage", "slice", "pool", "demos", "demos_v3"], action="append",
                   help="build only these parts (repeatable; default all; later parts read the earlier parts' files)")
    p.add_argument("--mix", default=None, help="demos_v3: the mix as kind=count,... (default: MIX_V3)")
    p.add_argument("--suffix", default="", help="demos_v3: written as demonstrations_v3{suffix}.jsonl (a variant)")
    args = p.parse_args(argv)
    mix = {k: int(v) for k, v in (x.split("=") for x in args.mix.split(","))} if args.mix else None
    parts = set(args.only or ["multihop", "coverage", "slice", "pool", "demos", "demos_v3"])

    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever
    from tasks.coverage import RULE, CorpusMatcher, Coverage, classify, corpus_passages, table
    from tasks.datasets import BUNDLED_CORPUS
    from tasks.heldout import heldout_questions
    from tasks.multihop import MULTIHOP_FILE, load_multihop

    t0 = time.perf_counter()
    if "multihop" in parts:
        if not args.shared:
            raise SystemExit("--shared is needed to build the multi-hop file")
        rows = multihop_rows(Path(args.shared))
        MULTIHOP_FILE.parent.mkdir(parents=True, exist_ok=True)
        MULTIHOP_FILE.write_text("".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows))
        print(f"{len(rows)} multi-hop questions -> {MULTIHOP_FILE}", flush=True)
    questions = load_multihop()
    index = ensure_bundled_index()
    cov_file = MULTIHOP_DIR / "coverage.json"
    with open_retriever(index_dir=index, topk=TOPK) as retriever:
        if "coverage" in parts:
            corpus = CorpusMatcher(corpus_passages(BUNDLED_CORPUS))
            coverage = classify(questions, retriever, topk=TOPK, corpus=corpus,
                                progress=lambda n: print(f"classified {n}/{len(questions)}", flush=True))
            write_json(cov_file, {"rule": RULE.format(topk=TOPK), "topk": TOPK,
                                  "index": json.loads((index / "meta.json").read_text()).get("corpus"),
                                  "by_source": table(coverage), "by_type": table(coverage, "type"),
                                  "questions": [c.to_dict() for c in coverage]})
            print(json.dumps(table(coverage), indent=1), flush=True)
        recorded = json.loads(cov_file.read_text())
        coverage = [Coverage(**c) for c in recorded["questions"]]
        if "slice" in parts:
            from tasks.multihop import SEARCH_SLICE_FILE, starter_digests

            sl = build_slice(questions, coverage)
            sl["coverage_rule"] = recorded["rule"]
            sl["starters"] = starter_digests()
            write_json(SEARCH_SLICE_FILE, sl)
            print(f"search slice: {sl['size']} of {sl['candidates']} candidates ({sl['from_heldout_split']} from the "
                  f"held-out split) -> {SEARCH_SLICE_FILE}", flush=True)
        heldout = heldout_questions()  # now with the search slice
        if "pool" in parts:
            rows, record = build_pool(questions, coverage, heldout)
            write_gzip_jsonl(POOL_V2_DIR / "train.jsonl.gz", rows)
            record["coverage_rule"] = recorded["rule"]
            write_json(POOL_V2_DIR / "record.json", record)
            print(json.dumps(record, indent=1), flush=True)
        if "demos" in parts:
            rows, record = build_demos(questions, coverage, heldout, retriever)
            path = MULTIHOP_DIR / "demonstrations.jsonl"
            path.write_text("".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows))
            write_json(MULTIHOP_DIR / "demonstrations_record.json", record)
            print(json.dumps(record, indent=1), flush=True)
        if "demos_v3" in parts:
            t_demos = time.perf_counter()
            rows, record = build_demos(questions, coverage, heldout, retriever, v3=True, mix=mix)
            record["seconds"] = round(time.perf_counter() - t_demos, 1)
            path = MULTIHOP_DIR / f"demonstrations_v3{args.suffix}.jsonl"
            path.write_text("".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows))
            write_json(MULTIHOP_DIR / f"demonstrations_v3{args.suffix}_record.json", record)
            print(json.dumps(record, indent=1), flush=True)
    print(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
