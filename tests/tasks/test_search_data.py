"""The search slice and the training pool v2 (scripts/build_search_data.py): recomputed from their recorded rules on a
sample through the bundled index served for real, and disjoint from each other and from every held-out and training
question."""

import json
import random
from pathlib import Path

import pytest

from tasks.heldout import question_key

REPO = Path(__file__).resolve().parents[2]
SLICE = REPO / "data" / "qa" / "search_slice.json"
POOL_RECORD = REPO / "data" / "qa" / "pool_v2" / "record.json"


@pytest.fixture(scope="module")
def recorded():
    from tasks.datasets import load_dataset
    from tasks.multihop import load_multihop

    sl = json.loads(SLICE.read_text())
    return {"slice": sl, "pool": load_dataset("qa_pool_v2", split="train"), "pool_record": json.loads(POOL_RECORD.read_text()),
            "multihop": {q.id: q for q in load_multihop()},
            "coverage": {c["id"]: c for c in json.loads((REPO / "data/qa/multihop/coverage.json").read_text())["questions"]}}


def test_slice_contract_and_disjointness(recorded):
    from tasks.datasets import QA_DATASETS, load_dataset

    sl, pool = recorded["slice"], recorded["pool"]
    assert sl["rule"] and len(sl["ids"]) >= 150 and sl["size"] == len(sl["ids"]) == len(set(sl["ids"]))
    assert set(sl["starters"]) >= {"smollm2-135m-search-starter"}
    hotpot = {ex.id: ex for ex in load_dataset("hotpotqa")}
    slice_keys = {question_key(hotpot[i].question) for i in sl["ids"]}
    assert len(slice_keys) == len(sl["ids"])
    pool_keys = {question_key(ex.question) for ex in pool}
    assert not slice_keys & pool_keys, "the search slice and the pool v2 share questions"
    # no training question: the first pool, the bundled train splits, the first starter's data, the demonstrations
    train_keys = {question_key(ex.question) for name in ("qa_pool", "qa_pool_informative") for ex in load_dataset(name, split="train")}
    train_keys |= {question_key(ex.question) for name in ("nq", "hotpotqa") for ex in load_dataset(name, split="train")}
    demos = [json.loads(line) for name in ("demonstrations.jsonl", "demonstrations_v3.jsonl")
             for line in (REPO / "data/qa/multihop" / name).read_text().splitlines()]
    train_keys |= {question_key(r["question"]) for r in demos}
    assert not slice_keys & train_keys
    starter = json.loads((REPO / "data/starter/smollm2-135m-search-starter/record.json").read_text())
    assert not set(sl["ids"]) & set(starter["question_ids"])
    # the pool holds no held-out question of any set, nor a reader-slice one
    held = {question_key(ex.question) for name in QA_DATASETS for ex in load_dataset(name, split="heldout")}
    assert not pool_keys & held
    from eval.reader_slice import load_reader_slice

    reader = {i for ids in load_reader_slice().ids.values() for i in ids}
    assert not reader & set(sl["ids"]) and not reader & {ex.id for ex in pool}
    # the held-out rule of every training path now includes the slice
    from tasks.heldout import heldout_questions

    assert slice_keys <= set(heldout_questions())


def test_pool_mix_is_recorded(recorded):
    pool, record = recorded["pool"], recorded["pool_record"]
    assert record["size"] == len(pool) and record["rule"]
    needed = [ex.meta["searches_needed"] for ex in pool]
    assert record["searches_needed"] == {"1": needed.count(1), "2": needed.count(2)}
    assert needed.count(2) >= 100 and sum(record["mix"].values()) == len(pool)


@pytest.mark.slow
def test_slice_and_pool_recomputed_from_their_rules(recorded):
    """A seeded sample of slice and pool questions, classified again through the bundled index on a real server."""
    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever
    from tasks.coverage import classify

    mh, cov = recorded["multihop"], recorded["coverage"]
    rng = random.Random(0)
    slice_ids = rng.sample(recorded["slice"]["ids"], 12)
    pool_multi = [ex for ex in recorded["pool"] if ex.id in mh]
    pool_ids = [ex.id for ex in rng.sample(pool_multi, 12)]
    pool_single = [ex for ex in recorded["pool"] if ex.id not in mh][:4]
    with open_retriever(index_dir=ensure_bundled_index(), topk=3) as retriever:
        again = {c.id: c for c in classify([mh[i] for i in slice_ids + pool_ids], retriever, topk=3)}
        single_hits = retriever.retrieve([ex.question.strip() for ex in pool_single], 3)
    for i in slice_ids:
        assert again[i].klass == "second_search" and again[i].second_query == cov[i]["second_query"], i
        assert again[i].first_ids == cov[i]["first_ids"] and again[i].second_ids == cov[i]["second_ids"]
    for i in pool_ids:
        assert again[i].klass == cov[i]["klass"] in ("first_search", "second_search"), i
    from tasks.qa import retrieval_recall

    for ex, hits in zip(pool_single, single_hits):  # qa_pool rows: its own rule (gold in the top-3 for the question)
        assert retrieval_recall([h["contents"] for h in hits], ex.answers)
