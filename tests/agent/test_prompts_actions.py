"""Prompt templates and action parsing: exact texts, truncation policies, malformed input."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agent.actions import (
    INFO_CLOSE,
    INVALID_ACTION_MESSAGE,
    format_passages,
    information_text,
    observation_ids,
    parse_action,
)
from agent.prompts import PromptTooLongError, build_prompt, load_template, normalize_question, register_template, render

SEARCH_R1_PARQUET = Path(__file__).resolve().parents[3] / "shared" / "data" / "search_r1_nq_search" / "test.parquet"

# Rendered by Search-R1's make_prefix (the first NQ test row of its parquet).
EXPECTED_NQ0 = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: who got the first nobel prize in physics?\n"
)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_search_template_matches_search_r1_text():
    assert render(load_template("search_r1"), normalize_question(" who got the first nobel prize in physics ", "search_r1")) == EXPECTED_NQ0


@pytest.mark.skipif(not SEARCH_R1_PARQUET.is_file(), reason="Search-R1 parquet not present")
def test_search_template_matches_every_search_r1_nq_prompt():
    import pandas as pd

    df = pd.read_parquet(SEARCH_R1_PARQUET)
    template = load_template("search_r1")
    mismatches = [
        q for q, p in zip(df.question, df.prompt)
        if render(template, normalize_question(q, "search_r1")) != p[0]["content"]
    ]  # fmt: skip
    assert len(df) > 3000 and mismatches == []


def test_chat_template_applied_once_and_raw_mode(tok):
    chat = build_prompt(tok, "capital of france")
    text = tok.decode(chat.token_ids)
    assert text.count("<|im_start|>user") == 1 and text.endswith("<|im_start|>assistant\n")
    assert chat.question == "capital of france?"
    raw = build_prompt(tok, "capital of france", chat="raw")
    assert tok.decode(raw.token_ids) == raw.text and "<|im_start|>" not in raw.text


def test_math_templates_keep_braces(tok):
    assert build_prompt(tok, "What is 1+1?", "math", chat="raw").text == "What is 1+1?"
    boxed = build_prompt(tok, "What is 1+1?", "math_boxed", chat="raw").text
    assert boxed.startswith("What is 1+1?\n") and "\\boxed{}" in boxed


def test_template_from_file_and_registry(tmp_path, tok):
    f = tmp_path / "t.txt"
    f.write_text("Q: {question} A:", encoding="utf-8")
    assert build_prompt(tok, "x", str(f), chat="raw").text == "Q: x A:"
    with pytest.raises(ValueError, match="exactly once"):
        register_template("bad", "no placeholder")
    with pytest.raises(ValueError, match="unknown prompt template"):
        load_template("nope")


def test_prompt_truncation_policies(tok):
    long_q = "who " + "really " * 400 + "wrote hamlet"
    with pytest.raises(PromptTooLongError):
        build_prompt(tok, long_q, max_tokens=300)
    cut = build_prompt(tok, long_q, max_tokens=300, truncation="truncate_question")
    assert len(cut.token_ids) <= 300 and cut.truncated_question_tokens > 0
    assert cut.question.endswith("wrote hamlet?")  # the end of the question is kept
    full = build_prompt(tok, long_q, max_tokens=300, truncation="truncate_question")
    assert full.token_ids == cut.token_ids  # deterministic
    with pytest.raises(PromptTooLongError, match="template alone"):
        build_prompt(tok, "q", max_tokens=20, truncation="truncate_question")
    with pytest.raises(ValueError, match="empty question"):
        build_prompt(tok, "   ")


@pytest.mark.parametrize(
    "text,kind,content",
    [
        ("<think>hm</think> <search>  capital of France </search>", "search", "capital of France"),
        ("<answer> Paris </answer> <search>x</search>", "answer", "Paris"),
        ("<search>a</search><answer>b</answer>", "search", "a"),
        ("<search> multi\nline </search>", "search", "multi\nline"),
        ("<search> Zürich 東京 café </search>", "search", "Zürich 東京 café"),
        ("<search>   </search>", "invalid", ""),
        ("<search>\x00\x07</search>", "invalid", ""),
        ("<search> x </answer>", "invalid", ""),
        ("<search> unterminated", "invalid", ""),
        ("no tags at all", "invalid", ""),
        ("<answer></answer>", "answer", ""),
        ("<Search> x </Search>", "invalid", ""),
    ],
)
def test_parse_action(text, kind, content):
    a = parse_action(text)
    assert (a.kind, a.content) == (kind, content)


def test_parse_action_caps_query_length():
    assert parse_action("<search>" + "a" * 5000 + "</search>", max_query_chars=100).content == "a" * 100


def test_passage_format_and_observation_text():
    hits = [{"id": "1", "contents": '"Paul Walker"\nPaul William Walker was an actor.'}, {"id": "2", "contents": "NoNewline"}]
    body = format_passages(hits)
    assert body == 'Doc 1(Title: "Paul Walker") Paul William Walker was an actor.\nDoc 2(Title: NoNewline) \n'
    assert information_text(body) == "\n\n<information>" + body.strip() + "</information>\n\n"
    assert INVALID_ACTION_MESSAGE.startswith("\nMy previous action is invalid.") and INVALID_ACTION_MESSAGE.endswith("Let me try again.\n")


def test_observation_truncation(tok):
    text = information_text(format_passages([{"id": "1", "contents": "T\n" + "lorem ipsum " * 300}]))
    whole = tok(text, add_special_tokens=False)["input_ids"]
    ids, truncated = observation_ids(tok, text, len(whole))
    assert ids == whole and not truncated  # fits: the plain tokenization, as Search-R1
    kept, truncated = observation_ids(tok, text, 50, "keep_tags")
    assert truncated and len(kept) <= 50 and tok.decode(kept).endswith(INFO_CLOSE)
    cut, truncated = observation_ids(tok, text, 50, "cut")
    assert truncated and cut == whole[:50]


def test_rollout_config_loads_and_validates():
    from agent.rollout import RolloutConfig
    from emapg.config import ConfigError, load_config

    cfg = load_config(RolloutConfig, None, ["max_turns=2", "mode=async", "allowed_token_ids=[1,2]", "seed=null"])
    assert (cfg.max_turns, cfg.mode, cfg.allowed_token_ids, cfg.seed) == (2, "async", [1, 2], None)
    assert RolloutConfig().template_name == "search_r1" and RolloutConfig(task="math").template_name == "math"
    for bad in (["mode=parallel"], ["max_tokens_per_turn=0"], ["top_p=0"], ["max_turns=-1"], ["max_context_tokens=100"]):
        with pytest.raises(ConfigError):
            load_config(RolloutConfig, None, bad)
