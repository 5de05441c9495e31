"""The fixed held-out split and the answerable training pool (scripts/build_qa_pool.py).

* the recorded held-out ids are the rule's seeded sample, and every demo/benchmark sample (``--limit n
  --data-seed 0``, n <= 100) lies inside them;
* the pool is disjoint from every held-out split by normalised question text, across every source;
* the pool's recorded answerability (top-3 passage ids, answer present) is recomputed from the real
  bundled index on a sample.
"""

import json

import pytest

from tasks.datasets import HELDOUT_FILE, HELDOUT_PER_DATASET, HELDOUT_SEED, QA_DATASETS, DatasetError, heldout_ids, load_dataset
from tasks.heldout import evaluation_questions, heldout_questions, question_key


def test_recorded_heldout_split_is_the_seeded_sample_and_contains_every_smaller_one():
    record = json.loads(HELDOUT_FILE.read_text())
    assert set(record["ids"]) == set(QA_DATASETS)
    for name in QA_DATASETS:
        sample = load_dataset(name, limit=HELDOUT_PER_DATASET, seed=HELDOUT_SEED)
        assert heldout_ids(name) == [ex.id for ex in sample]
        assert [ex.id for ex in load_dataset(name, split="heldout")] == heldout_ids(name)
        for n in (2, 15, 50):  # the tiny demo, the demo, the learning benchmark
            assert {ex.id for ex in load_dataset(name, limit=n, seed=0)} <= set(heldout_ids(name))
    with pytest.raises(DatasetError, match="held-out"):
        heldout_ids("nq_gold")


def test_pool_is_disjoint_from_every_heldout_split():
    pool = load_dataset("qa_pool", split="train")
    held = heldout_questions()
    assert len(held) >= 690  # 7 x 100, a few question texts repeat across sets
    keys = [question_key(ex.question) for ex in pool]
    assert not set(keys) & set(held)
    assert len(set(keys)) == len(keys)  # deduplicated by normalised text
    held_ids = {i for name in QA_DATASETS for i in heldout_ids(name)}
    assert not {ex.id for ex in pool} & held_ids
    # the pool draws on the test splits outside the held-out ones: that is what makes it answerable
    test_keys = evaluation_questions()
    assert sum(k in test_keys for k in keys) > 5000


def test_pool_record_matches_the_file_and_meets_the_answerability_floor():
    from emapg.paths import DATA_DIR

    record = json.loads((DATA_DIR / "qa" / "pool" / "record.json").read_text())
    pool = load_dataset("qa_pool", split="train")
    assert record["pool_size"] == len(pool)
    by_origin: dict[str, int] = {}
    for ex in pool:
        by_origin[ex.meta["origin"]] = by_origin.get(ex.meta["origin"], 0) + 1
    assert {k: v["answerable"] for k, v in record["sources"].items() if v["answerable"]} == by_origin
    assert record["pool_answerable_rate"] >= 0.6
    assert record["heldout"]["questions"] == 7 * HELDOUT_PER_DATASET


@pytest.mark.slow
def test_pool_answerability_recomputed_from_the_bundled_index():
    """A seeded sample of pool rows and held-out questions searched again on the real bundled index."""
    from emapg.paths import DATA_DIR
    from provision.indexes import ensure_bundled_index
    from retriever.searcher import Searcher
    from tasks.qa import retrieval_recall

    searcher = Searcher(ensure_bundled_index(None, log=lambda m: None), device="cpu", encode_threads=1)
    rows = load_dataset("qa_pool", split="train", limit=24, seed=3)
    hits = searcher.retrieve([ex.question.strip() for ex in rows], 3)
    for ex, h in zip(rows, hits):
        assert retrieval_recall([x["contents"] for x in h], ex.answers) == 1.0, ex.id
    # recorded top-3 ids: the same passages (ties at the 3rd place may swap order on another BLAS)
    same = sum(set(x["id"] for x in h) == set(ex.meta["top3_ids"]) for ex, h in zip(rows, hits))
    assert same >= len(rows) - 1
    record = json.loads((DATA_DIR / "qa" / "pool" / "record.json").read_text())
    nq = load_dataset("nq", split="heldout")
    answerable = sum(retrieval_recall([x["contents"] for x in h], ex.answers)
                     for ex, h in zip(nq, searcher.retrieve([ex.question.strip() for ex in nq], 3)))
    assert answerable == record["heldout"]["per_dataset"]["nq"]["answerable"]


def test_informative_subset_is_curated_from_the_pool_without_the_starters_warm_start_questions():
    """``qa_pool_informative`` (scripts/curate_pool.py): pool rows only, each solved by the starter in some but not
    all of its recorded samples, none of them warm-start questions; the record matches the file."""
    from emapg.models import STARTER, resolve_model
    from emapg.paths import DATA_DIR
    from tasks.contamination import read_trained_questions

    pool = {ex.id: ex for ex in load_dataset("qa_pool", split="train")}
    curated = load_dataset("qa_pool_informative", split="train")
    record = json.loads((DATA_DIR / "qa" / "pool" / "informative_record.json").read_text())
    assert len(curated) == record["kept"] > 0
    n = record["samples_per_question"]
    histogram = record["correct_count_histogram"]
    assert sum(histogram.values()) == record["questions_measured"]
    assert sum(histogram[str(c)] for c in range(1, n)) == record["kept"]
    trained = read_trained_questions(resolve_model(STARTER))
    for ex in curated:
        assert ex.id in pool and pool[ex.id].question == ex.question and pool[ex.id].answers == ex.answers
        correct, samples = ex.meta["starter_pass"]
        assert samples == n and 0 < correct < n
        assert not trained.contains(ex.question)


def test_curation_counts_exact_matches_per_sample(tmp_path):
    """scripts/curate_pool.py reads each QA item's samples: a sample counts when its exact match is 1."""
    import importlib.util

    from emapg.paths import REPO_ROOT

    spec = importlib.util.spec_from_file_location("curate_pool", REPO_ROOT / "scripts" / "curate_pool.py")
    curate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(curate)
    items = tmp_path / "eval" / "items"
    items.mkdir(parents=True)
    rows = [{"id": "a", "samples": [{"scores": {"em": 1.0}}, {"scores": {"em": 0.0}}, {"scores": {"em": 1.0}}]},
            {"id": "b", "samples": [{"scores": {"em": 0.0}}] * 3},
            {"id": "c", "scores": {"n_correct": 2, "n_samples": 4}}]  # a math item: not a QA sample list
    (items / "qa_pool.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert curate.correct_counts(tmp_path / "eval") == {"a": (2, 3), "b": (0, 3)}
