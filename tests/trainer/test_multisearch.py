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
        _assert_file_replay_is_token_exact(tmp_path, kept, tok, client, rollout, max_len)


def test_shipped_demonstrations_mix_one_and_two_searches():
    from tasks.heldout import heldout_questions, question_key
    from trainer.sft.multisearch import searches_by_type

    rows, record = _shipped(DEMOS, "demonstrations_record.json")
    assert {r["searches"] for r in rows} == {1, 2} and all(len(r["turns"]) == r["searches"] + 1 for r in rows)
    assert record["searches_per_question_by_type"] == searches_by_type(rows)
    held = heldout_questions()
    assert not [r["id"] for r in rows if question_key(r["question"]) in held]
    assert len({question_key(r["question"]) for r in rows}) == len(rows)


DEMOS_V3 = REPO / "data" / "qa" / "multihop" / "demonstrations_v3.jsonl"


def test_think_steps_name_what_the_passages_shown_hold():
    """with_think writes each decision's think step from the observation as shown: the doc naming the answer before
    an answer, the doc naming the bridge (not a first-hop title) before a second search, nothing when no doc names it."""
    from trainer.sft.multisearch import THINK_NOTHING, Demo, doc_naming, script, shown_titles, with_think

    from agent.actions import format_passages, information_text

    first = information_text(format_passages([{"contents": '"Bordan Tkachuk"\nBordan Tkachuk is a British businessman, '
                                                           'the CEO of Viglen.'}, {"contents": '"Leeds"\nA city.'}]))
    second = information_text(format_passages([{"contents": '"Acorn"\nUnrelated.'},
                                               {"contents": '"Viglen"\nViglen Ltd provides IT products and services.'}]))
    assert shown_titles(first) == ["Bordan Tkachuk", "Leeds"]
    assert doc_naming(second, "it products and services!") == 2 and doc_naming(second, "products and services ltd") is None
    q = "Bordan Tkachuk was the CEO of a company that provides what sort of products?"
    two = Demo("t", q, script(q, "IT products and services", "Viglen products"), ["IT products and services"], "two", "bridge",
               bridges=("Bordan Tkachuk", "Viglen"))
    turns = with_think(two, [first, second]).turns
    assert turns == [f"<search> {q} </search>",
                     "<think> Doc 1 names Viglen; the answer is not shown. </think>\n<search> Viglen products </search>",
                     "<think> Doc 2 names IT products and services; it answers the question. </think>\n"
                     "<answer> IT products and services </answer>"]
    # the bridge named only by the question: no doc to point at
    lone = with_think(Demo("t", q, two.turns, two.answers, "two", "bridge", bridges=("Acme",)), [first, second])
    assert lone.turns[1].startswith(THINK_NOTHING)
    one = with_think(Demo("o", "Who runs Viglen?", script("Who runs Viglen?", "Bordan Tkachuk"), ["Bordan Tkachuk"], "one", "s"),
                     [first])
    assert one.turns[-1].startswith("<think> Doc 1 names Bordan Tkachuk; it answers the question. </think>\n<answer>")
    assert one.searches == 1 and one.written_answer == "Bordan Tkachuk"
    assert with_think(Demo("n", "Who?", script("Who?", "Nobody"), ["Nobody"], "one", "s"), [first]) is None


def test_think_demonstrations_replay_token_exact_within_the_turn_budget(coverage_corpus, smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    from retriever.client import RetrieverClient
    from tasks.coverage import classify
    from trainer.sft.config import SFTConfig
    from trainer.sft.multisearch import Demo, build_demonstrations, script

    cfg = load_config(SFTConfig, REPO / "configs" / "sft_smollm2_starter_v3.yaml",
                      ["data.source=construct", "data.datasets=[qa_pool]", "data.path=null"])
    rollout = replace(cfg.rollout, topk=1)
    assert rollout.max_tokens_per_turn == 64  # the evaluation's turn budget (qa_quick)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    max_len = rollout.max_prompt_tokens + rollout.max_response_tokens
    qs = {q.id: q for q in coverage_corpus.questions}
    with RetrieverClient(coverage_corpus.url, timeout=20, retries=1) as client:
        cov = {c.id: c for c in classify(list(qs.values()), client, topk=1)}
        two, one, q2, q1 = cov["q-two"], cov["q-one"], qs["q-two"], qs["q-one"]
        cands = [Demo("q-two", q2.question, script(q2.question, two.second_gold, two.second_query), q2.answers, "two",
                      "bridge", bridges=("Quiet Harbor", "Velvet Lanterns")),
                 Demo("q-one", q1.question, script(q1.question, one.first_gold), q1.answers, "one", "single")]
        kept, dropped = build_demonstrations(cands, {"two": 5, "one": 5}, tok, client, rollout, max_model_len=max_len,
                                             think=True)
        assert [d.id for d, _ in kept] == ["q-two", "q-one"] and dropped == {}
        by_id = {d.id: d for d, _ in kept}
        assert by_id["q-two"].turns[1].startswith("<think> Doc 1 names Velvet Lanterns; the answer is not shown. </think>")
        assert by_id["q-two"].turns[2] == "<think> Doc 1 names Tulsa; it answers the question. </think>\n<answer> Tulsa </answer>"
        assert by_id["q-one"].turns[1].startswith("<think> Doc 1 names volcano; it answers the question. </think>")
        for d, t in kept:
            assert [tok.decode(ids) for ids in t.span_ids("model")] == d.turns and t.num_searches == d.searches
        # a turn budget the think step does not fit: valid without it, dropped with it
        small = replace(rollout, max_tokens_per_turn=24)
        kept_small, dropped_small = build_demonstrations(cands[1:], {"one": 5}, tok, client, small,
                                                         max_model_len=max_len, think=True)
        assert not kept_small and dropped_small and all(k.startswith("one: with think steps, ") for k in dropped_small)
        _assert_file_replay_is_token_exact(tmp_path, kept, tok, client, rollout, max_len)


def test_shipped_v3_demonstrations_think_before_each_decision():
    from tasks.heldout import heldout_questions, question_key
    from trainer.sft.multisearch import searches_by_type

    rows, record = _shipped(DEMOS_V3, "demonstrations_v3_record.json")
    assert all(record["kept"][k] <= n for k, n in record["mix"].items())
    assert {r["searches"] for r in rows} == {1, 2} and all(len(r["turns"]) == r["searches"] + 1 for r in rows)
    for r in rows:
        assert r["turns"][0].startswith("<search>")  # the first search is the question, with no think step
        assert "; it answers the question. </think>\n<answer>" in r["turns"][-1]
        if r["searches"] == 2:
            assert r["turns"][1].startswith("<think>") and "the answer is not shown. </think>\n<search>" in r["turns"][1]
    assert sum(r["searches"] == 1 for r in rows) > sum(r["searches"] == 2 for r in rows)  # one search is the majority
    assert record["searches_per_question_by_type"] == searches_by_type(rows)
    held = heldout_questions()
    assert not [r["id"] for r in rows if question_key(r["question"]) in held]
    assert len({question_key(r["question"]) for r in rows}) == len(rows)


def _assert_file_replay_is_token_exact(tmp_path, kept, tok, client, rollout, max_len: int) -> None:
    """The SFT file path (``emapg sft``, ``data.source=file``) replays each kept demonstration to the very same tokens."""
    from trainer.sft.data import file_trajectories

    rows = tmp_path / "demos.jsonl"
    rows.write_text("".join(json.dumps(d.to_row(t.num_searches)) + "\n" for d, t in kept))
    again, counts = file_trajectories(rows, tok, client, rollout, max_model_len=max_len)
    assert counts["kept"] == len(kept) == 2
    for (_, t), u in zip(kept, again):
        assert (u.prompt_ids, u.response_ids, u.loss_mask) == (t.prompt_ids, t.response_ids, t.loss_mask)


def _shipped(demos, record_name: str) -> tuple[list[dict], dict]:
    """A shipped demonstrations file's rows and its record, whose kept counts must match the rows."""
    rows = [json.loads(line) for line in demos.read_text().splitlines()]
    record = json.loads((demos.parent / record_name).read_text())
    assert record["kept"] == {k: sum(r["kind"] == k for r in rows) for k in record["kept"]}
    return rows, record
