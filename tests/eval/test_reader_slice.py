"""The recorded reader slice (data/qa/reader_slice.json, eval.reader_slice): built from the shipped starter, inside the
held-out split, disjoint from every training set, and its rule recomputed from the record on a sample."""

import json

import pytest

from eval.reader_slice import (READER_SLICE_FILE, RULE, RULES, in_slice, load_reader_slice, rule_name, shown_text,
                               starter_digest)
from tasks.datasets import QA_DATASETS, heldout_ids, load_dataset
from tasks.heldout import question_key
from tasks.qa import golds_outside_question


@pytest.fixture(scope="module")
def recorded():
    return load_reader_slice()


def test_the_slice_is_recorded_with_its_rule_and_the_shipped_starters_digest(recorded):
    from emapg.models import STARTER

    # recorded by the rule of its day, kept as recorded; slices built from now on leave out golds the question names
    assert json.loads(READER_SLICE_FILE.read_text())["rule"] == recorded.rule == RULES["gold_in_passages"] != RULE
    assert rule_name(recorded.rule) == "gold_in_passages"
    assert recorded.starter == STARTER
    # rebuilt only with the starter: a new starter fails here until scripts/build_reader_slice.py runs again
    assert recorded.starter_digest == starter_digest()
    assert recorded.protocol["name"] == "qa_quick" and recorded.protocol["temperature"] == 0.0
    assert set(recorded.ids) == set(QA_DATASETS)
    for ds in QA_DATASETS:
        rows = recorded.questions[ds]
        assert {q["id"] for q in rows} == set(heldout_ids(ds))  # the whole held-out split was scored
        assert recorded.ids[ds] == [q["id"] for q in rows if q["in_slice"]]
    assert 50 <= recorded.size <= 700


def test_the_slice_is_disjoint_from_every_training_set(recorded):
    from emapg.models import STARTER_ADAPTER
    from tasks.contamination import read_trained_questions

    keys = {question_key(ex.question) for ds in QA_DATASETS for ex in load_dataset(ds, split="heldout")
            if ex.id in set(recorded.ids[ds])}
    assert len(keys) >= recorded.size - 5  # a few held-out questions share a text across sets
    for train_set in ("qa_pool", "qa_pool_informative"):
        assert not keys & {question_key(ex.question) for ex in load_dataset(train_set, split="train")}
    starter_trained = read_trained_questions(STARTER_ADAPTER)
    assert starter_trained is not None
    slice_questions = [ex.question for ds in QA_DATASETS for ex in load_dataset(ds, split="heldout") if ex.id in set(recorded.ids[ds])]
    assert not any(starter_trained.contains(q) for q in slice_questions)


def test_the_rule_recomputed_from_the_record_gives_the_recorded_membership(recorded):
    """For a sample of questions in and out of the slice: the passages the record names, formatted and cut to the
    protocol's observation budget as the rollout showed them, contain a gold answer exactly for the slice's."""
    from transformers import AutoTokenizer

    from emapg.models import resolve_model
    from emapg.paths import BUNDLED_CORPUS
    from retriever.corpus import iter_corpus

    sample = []
    for ds in QA_DATASETS:
        searched = [q for q in recorded.questions[ds] if q["retrieved_ids"]]
        sample += [q for q in searched if q["in_slice"]][:2] + [q for q in searched if not q["in_slice"]][:2]
    assert sum(q["in_slice"] for q in sample) >= 7 and sum(not q["in_slice"] for q in sample) >= 7
    wanted = {pid for q in sample for ids in q["retrieved_ids"] for pid in ids}
    passages = {p.id: p.contents for p in iter_corpus(BUNDLED_CORPUS) if p.id in wanted}
    assert set(passages) == wanted
    examples = {ex.id: ex for ds in QA_DATASETS for ex in load_dataset(ds, split="heldout")}
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))  # the starter's own tokenizer
    budget = recorded.protocol["max_obs_tokens"]
    for q in sample:
        searches = [[passages[pid] for pid in ids] for ids in q["retrieved_ids"]]
        ex = examples[q["id"]]
        assert in_slice(searches, ex.question, ex.answers, tokenizer, budget, rule="gold_in_passages") == q["in_slice"], q["id"]
        if golds_outside_question(ex.question, ex.answers) == list(ex.answers):  # no gold in the question: the rules agree
            assert in_slice(searches, ex.question, ex.answers, tokenizer, budget) == q["in_slice"], q["id"]
    # the budget matters: the observation is cut, so a passage's tail can be out of view
    long = [[passages[pid] for pid in ids] for q in sample for ids in q["retrieved_ids"]][:1]
    assert len(tokenizer(shown_text(long, tokenizer, budget)[0])["input_ids"]) <= budget + 2


def test_todays_rule_leaves_out_the_slice_questions_that_name_their_answer(recorded):
    """The recorded slice's comparison questions in the slice ("Who was born first, X or Y?" -> "Y"): by today's rule
    they are in only when a passage shows a gold the question does not name (none is)."""
    from transformers import AutoTokenizer

    from emapg.models import resolve_model
    from eval.reader_slice import corpus_passages

    examples = {ex.id: ex for ds in QA_DATASETS for ex in load_dataset(ds, split="heldout")}
    named = [q for ds in QA_DATASETS for q in recorded.questions[ds]
             if q["in_slice"] and golds_outside_question(examples[q["id"]].question, examples[q["id"]].answers) == []]
    assert len(named) >= 3
    passages = corpus_passages({pid for q in named for ids in q["retrieved_ids"] for pid in ids})
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    for q in named:
        ex = examples[q["id"]]
        searches = [[passages[pid] for pid in ids] for ids in q["retrieved_ids"]]
        assert in_slice(searches, ex.question, ex.answers, tokenizer, recorded.protocol["max_obs_tokens"]) is False
    with pytest.raises(ValueError, match="unknown reader-slice rule 'x'"):
        in_slice([], "q", ["a"], tokenizer, 10, rule="x")


def test_a_new_slice_is_built_by_todays_rule(tmp_path):
    """slice_from_eval on a greedy run's items: membership recomputed from the retrieved passage ids, a gold the
    question names left out (a passage about the number 0 shows "0" for the second question but not the first)."""
    from transformers import AutoTokenizer

    from emapg.models import resolve_model
    from eval.items import append_items
    from eval.reader_slice import slice_from_eval

    def record(i, question, golds):
        sample = {"retrieved_ids": [["vital-0", "vital-2"]], "queries": ["zero"], "scores": {"em": 0.0, "retrieval_recall": 1.0}}
        return {"id": f"nq-{i}", "question": question, "golds": golds, "scores": sample["scores"], "samples": [sample]}

    (tmp_path / "items").mkdir()
    append_items(tmp_path, "nq", [record(1, "Which is smaller, 0 or 1?", ["0"]), record(2, "What is the additive identity?", ["0"]),
                                  record(3, "Which race is the shortest sprint?", ["200 metres"])])
    protocol = {"name": "qa_quick", "max_obs_tokens": 256}
    made = slice_from_eval(tmp_path, ["nq"], protocol=protocol, starter="x",
                           tokenizer=AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct")))
    assert made["rule"] == RULE and made["ids"] == {"nq": ["nq-2"]} and made["size"] == 1
    assert [q["in_slice"] for q in made["questions"]["nq"]] == [False, True, False]
