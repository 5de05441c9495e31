"""QA metrics on tricky cases: the paper's SQuAD rule reproduced exactly, limits included."""

import pytest

from tasks.qa import (
    cover_exact_match,
    exact_match,
    extract_answer,
    normalize_answer,
    qa_reward,
    qa_scores,
    retrieval_recall,
    token_f1,
)

PAPER_PROMPT = (
    "Answer the given question. ... For example, <answer> Beijing </answer>. Question: what is the capital of France?\n"
)


@pytest.mark.parametrize(
    "raw, norm",
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("  a   cat,  an  owl; the END. ", "cat owl end"),
        ("Theater", "theater"),  # "the" only as a whole word
        ("U.S.A.", "usa"),
        ("rock-'n'-roll!", "rocknroll"),
        ("“Quoted” café", "“quoted” café"),  # non-ASCII punctuation is kept, as in the paper
        ("ÉCOLE Normale", "école normale"),
        ("", ""),
        ("the a an", ""),
        ("1,000,000", "1000000"),
    ],
)
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


def test_exact_match_multiple_golds_and_articles():
    assert exact_match("the Beatles", ["Rolling Stones", "Beatles"]) == 1.0
    assert exact_match("Beatles band", ["Beatles"]) == 0.0
    assert exact_match("Beatles", "The Beatles.") == 1.0
    assert exact_match(None, ["x"]) == 0.0
    # empty prediction only matches a gold that normalises to empty
    assert exact_match("", ["x"]) == 0.0
    assert exact_match("the", [""]) == 1.0
    with pytest.raises(ValueError, match="at least one gold"):
        exact_match("x", [])


def test_cover_em_and_f1():
    assert cover_exact_match("It was Paris, France", ["paris"]) == 1.0
    assert cover_exact_match("Parisian", ["Paris"]) == 1.0  # substring, as Search-R1's subem
    assert cover_exact_match("anything", ["the"]) == 0.0  # empty gold never covers
    assert token_f1("Barack Obama", ["Obama"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert token_f1("Barack Obama", ["George Bush", "Barack Hussein Obama"]) == pytest.approx(2 * 1 * (2 / 3) / (1 + 2 / 3))
    assert token_f1("", ["the"]) == 1.0  # both empty after normalisation
    assert token_f1("x", ["the"]) == 0.0
    assert token_f1("a b c", ["d e"]) == 0.0


def test_extract_answer_response_only_and_paper_rule():
    response = "<think>hm</think><search>q</search><information>…</information><answer> Paris </answer>"
    assert extract_answer(response) == "Paris"
    # The paper's rule on prompt + response: the prompt's example is match #1.
    assert extract_answer(PAPER_PROMPT + response, paper_prompt_included=True) == "Paris"
    # Answer tag only in the prompt: the paper's rule gives nothing; so does response-only.
    assert extract_answer(PAPER_PROMPT + "<think>no idea</think>", paper_prompt_included=True) is None
    assert extract_answer("<think>no idea</think>") is None
    # A bare response with one answer: response-only scores it, the paper rule would not.
    assert extract_answer("<answer>x</answer>", paper_prompt_included=True) is None
    assert extract_answer("<answer>x</answer>") == "x"


def test_extract_answer_last_nested_malformed():
    assert extract_answer("<answer>a</answer> then <answer>b</answer>") == "b"
    assert extract_answer("<answer>multi\nline</answer>") == "multi\nline"
    assert extract_answer("<answer>unclosed") is None
    assert extract_answer("</answer>x<answer>") is None
    # the paper's non-greedy regex: nested opening tags stay in the content
    assert extract_answer("<answer><answer>x</answer>") == "<answer>x"
    assert extract_answer("<answer></answer>") == ""
    assert extract_answer("<ANSWER>x</ANSWER>") is None  # case-sensitive, like the paper


def test_qa_reward_matches_paper_reward_on_prompt_plus_response():
    cases = [
        ("<answer>The Louvre</answer>", ["Louvre"], 1.0),
        ("<answer>louvre museum</answer>", ["Louvre"], 0.0),
        ("no tag at all: Louvre", ["Louvre"], 0.0),
        ("<answer>x</answer><answer>Louvre!</answer>", ["Louvre"], 1.0),
    ]
    for response, golds, expected in cases:
        assert qa_reward(response, golds) == expected
        paper = exact_match(extract_answer(PAPER_PROMPT + response, paper_prompt_included=True), golds)
        assert paper == expected


def test_retrieval_recall_token_bounded():
    passages = ['"Paris"\nParis is the capital of France.', "Population 2,100,000"]
    assert retrieval_recall(passages, ["France"]) == 1.0
    assert retrieval_recall(passages, ["Fran"]) == 0.0  # not a token
    assert retrieval_recall(passages, ["2100000"]) == 1.0
    assert retrieval_recall([], ["France"]) == 0.0
    assert retrieval_recall(passages, ["the"]) == 0.0


def test_qa_scores_bundle():
    s = qa_scores("<answer>Paris France</answer>", ["Paris"], passages=["Paris is nice"])
    assert s == {"em": 0.0, "f1": pytest.approx(2 / 3), "cover_em": 1.0, "has_answer": 1.0, "retrieval_recall": 1.0}


def test_gold_shown_leaves_out_answers_the_question_names_and_matches_whole_tokens():
    from tasks.qa import gold_shown, golds_outside_question

    q = "Who was born first, Gene Mayer or Serena Williams?"
    assert golds_outside_question(q, ["Gene Mayer"]) == []
    assert gold_shown(["Gene Mayer (born 1956) is an American tennis player."], ["Gene Mayer"], q) is None
    assert retrieval_recall(["Gene Mayer (born 1956) is an American tennis player."], ["Gene Mayer"]) == 1.0  # the old count
    # a gold the question does not name still counts, whole tokens only
    assert golds_outside_question(q, ["Gene Mayer", "Eugene Mayer"]) == ["Eugene Mayer"]
    assert gold_shown(["Eugene Mayer was born in 1956."], ["Gene Mayer", "Eugene Mayer"], q) == "Eugene Mayer"
    assert gold_shown(["A hare's nest is called a form."], ["Form"], "What is the name for a hare's nest?") == "Form"
    assert gold_shown(["It was formed in 1990."], ["Form"], "What is the name for a hare's nest?") is None
    assert gold_shown(["In 1990 ..."], ["1"], "How many?") is None
