"""Multi-search demonstrations (trainer.sft.multisearch): replayed through the rollout loop against a live retriever,
token-exact on the SFT file path, kept only when the passages shown hold the gold; and the shipped file's rows."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from emapg.config import load_config

REPO = Path(__file__).resolve().parents[2]
DEMOS = REPO / "data" / "qa" / "multihop" / "demonstrations.jsonl"


@pytest.fixture(scope="module")
def v2_rollout():
    from trainer.sft.config import SFTConfig

    cfg = load_config(SFTConfig, REPO / "configs" / "sft_smollm2_starter_v2.yaml",
                      ["data.source=construct", "data.datasets=[qa_pool]", "data.path=null"])
    return cfg.rollout


def test_demonstrations_are_replayed_token_exact_and_show_the_gold(coverage_corpus, smollm2_dir, v2_rollout, tmp_path):
    from transformers import AutoTokenizer

    from retriever.client import RetrieverClient
    from tasks.coverage import classify
    from trainer.sft.data import file_trajectories
    from trainer.sft.multisearch import Demo, build_demonstrations, script, shown_texts

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    rollout = replace(v2_rollout, topk=1)
    max_len = rollout.max_prompt_tokens + rollout.max_response_tokens
    qs = {q.id: q for q in coverage_corpus.questions}
    with RetrieverClient(coverage_corpus.url, timeout=20, retries=1) as client:
        cov = {c.id: c for c in classify(list(qs.values()), client, topk=1)}
        two, one = cov["q-two"], cov["q-one"]
        cands = [Demo("q-two", qs["q-two"].question, script(qs["q-two"].question, two.second_gold, two.second_query),
                      qs["q-two"].answers, "two", "bridge"),
                 Demo("q-one", qs["q-one"].question, script(qs["q-one"].question, one.first_gold), qs["q-one"].answers,
                      "one", "single"),
                 # a second query whose passages lack the gold, and a one-search script where the gold is not shown
                 Demo("q-bad2", qs["q-decomp"].question, script(qs["q-decomp"].question, "Mira Okafor", "Apple pie"),
                      qs["q-decomp"].answers, "two", "bridge"),
                 Demo("q-bad1", qs["q-hidden"].question, script(qs["q-hidden"].question, "1911"), ["1911"], "one", "single")]
        kept, dropped = build_demonstrations(cands, {"two": 5, "one": 5}, tok, client, rollout, max_model_len=max_len)
        assert [d.id for d, _ in kept] == ["q-two", "q-one"]
        assert dropped == {"two: gold not in the passages shown (after truncation)": 1,
                           "one: gold not in the passages shown (after truncation)": 1}
        for d, t in kept:
            assert t.num_searches == d.searches and t.queries == [x[len("<search> "):-len(" </search>")]
                                                                  for x in d.turns if x.startswith("<search>")]
            shown = shown_texts(tok, t)
            assert "Tulsa" in shown[-1] if d.id == "q-two" else "volcano" in shown[-1]
            if d.id == "q-two":
                assert "Tulsa" not in shown[0] and t.retrieved_ids == [["p-album"], ["p-band"]]
            # the model's spans are exactly the scripted turns
            assert [tok.decode(ids) for ids in t.span_ids("model")] == [x for x in d.turns]
        # the SFT file path (emapg sft, data.source=file) replays each row to the very same tokens
        rows = tmp_path / "demos.jsonl"
        rows.write_text("".join(json.dumps(d.to_row(t.num_searches)) + "\n" for d, t in kept))
        again, counts = file_trajectories(rows, tok, client, rollout, max_model_len=max_len)
    assert counts["kept"] == 2
    for (_, t), u in zip(kept, again):
        assert (u.prompt_ids, u.response_ids, u.loss_mask) == (t.prompt_ids, t.response_ids, t.loss_mask)


def test_shipped_demonstrations_mix_one_and_two_searches():
    from tasks.heldout import heldout_questions, question_key
    from trainer.sft.multisearch import searches_by_type

    rows = [json.loads(line) for line in DEMOS.read_text().splitlines()]
    record = json.loads((DEMOS.parent / "demonstrations_record.json").read_text())
    assert record["kept"] == {k: sum(r["kind"] == k for r in rows) for k in record["kept"]}
    assert {r["searches"] for r in rows} == {1, 2} and all(len(r["turns"]) == r["searches"] + 1 for r in rows)
    assert record["searches_per_question_by_type"] == searches_by_type(rows)
    held = heldout_questions()
    assert not [r["id"] for r in rows if question_key(r["question"]) in held]
    assert len({question_key(r["question"]) for r in rows}) == len(rows)
