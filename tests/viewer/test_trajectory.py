"""The trajectory renderer of ``emapg view`` (app.viewer.trajectory): spans, masks, gold highlighting, and text that
stays text (escaping is the page's text nodes; the renderer must hand over data, never markup)."""

from __future__ import annotations

import json

from agent.actions import INVALID_ACTION_MESSAGE
from app.viewer.trajectory import gold_spans, passages, pieces, render, split_response
from tests.fixtures.viewer import INJECTED, injected_sample


def test_gold_spans_are_whole_words_case_insensitive_and_merged():
    text = "In 1990 Paris hosted it; 1 more: paris, Paris Hilton."
    assert [text[a:b] for a, b in gold_spans(text, ["paris", "1"])] == ["Paris", "1", "paris", "Paris"]
    assert gold_spans("New  York city", ["new york", "York City"]) == [(0, 14)]  # overlapping golds merge; spaces flexible
    assert gold_spans("a.b.c", ["a.b"]) == [(0, 3)] and gold_spans("x", ["", "  "]) == []
    assert gold_spans("C++ rocks", ["c++"]) == [(0, 3)]  # a gold ending in a symbol: no word boundary to require


def test_pieces_cover_the_text_exactly():
    text = "Doc 1(Title: Lemur) Lemurs live on Madagascar; lemurs."
    got = pieces(text, ["Lemurs"])
    assert "".join(p["text"] for p in got) == text
    assert [p["text"] for p in got if p["gold"]] == ["Lemurs", "lemurs"]
    assert pieces("", []) == [{"text": "", "gold": False}]


def test_recorded_segments_keep_their_roles_tokens_masks_and_queries():
    row = {"question": "q", "golds": ["Madagascar"], "queries": ["where do lemurs live"], "reward": 1.0, "advantage": 0.7,
           "prompt": "<|im_start|>user q", "prompt_tokens": 5, "response_tokens": 30, "model_tokens": 12, "answer": "Madagascar",
           "segments": [
               {"role": "model", "action": "search", "tokens": 6, "masked": False, "text": "<search>where do lemurs live</search>"},
               {"role": "observation", "action": "information", "tokens": 18, "masked": True,
                "text": '\n\n<information>Doc 1(Title: "Lemur") Lemurs live on Madagascar.\nDoc 2(Title: "Ape") Apes do not.\n</information>\n\n'},
               {"role": "model", "action": "answer", "tokens": 6, "masked": False, "text": "<answer>Madagascar</answer>"}]}
    t = render(row)
    assert [(s["role"], s["tokens"], s["masked"]) for s in t["segments"]] == [("model", 6, False), ("observation", 18, True), ("model", 6, False)]
    assert [s["query"] for s in t["segments"]] == ["where do lemurs live", None, None]
    obs = t["segments"][1]
    assert len(obs["passages"]) == 2 and [p["has_gold"] for p in obs["passages"]] == [True, False]
    assert obs["passages"][0]["pieces"] == [{"text": 'Doc 1(Title: "Lemur") Lemurs live on ', "gold": False},
                                             {"text": "Madagascar", "gold": True}, {"text": ".", "gold": False}]
    assert t["gold_shown"] and not t["segments_inferred"] and t["advantage"] == 0.7
    assert t["answer_pieces"] == [{"text": "Madagascar", "gold": True}]
    assert t["tokens"] == {"prompt_tokens": 5, "response_tokens": 30, "model_tokens": 12}


def test_a_response_without_segments_is_split_at_its_observations():
    response = ("<search>a</search>\n\n<information>Doc 1(Title: T) gold here\n</information>\n\n<search>b</search>"
                + INVALID_ACTION_MESSAGE + "<answer>x</answer>")
    segs = split_response(response)
    assert "".join(s["text"] for s in segs) == response
    assert [(s["role"], s["action"]) for s in segs] == [("model", ""), ("observation", "information"), ("model", ""),
                                                          ("observation", "invalid"), ("model", "")]
    t = render({"response": response, "queries": ["a"], "golds": ["gold"], "prediction": "x"})
    # the search before the information block sent the query; the turn before the corrective message did not search
    assert [s["query"] for s in t["segments"]] == ["a", None, None, None, None]
    assert t["segments_inferred"] and t["gold_shown"] and t["answer"] == "x"
    tool = split_response("<tool_call>{}</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nDoc 1(Title: T) t\n</tool_response>")
    assert [s["role"] for s in tool] == ["model", "observation"]
    assert passages(tool[1]["text"]) == ["Doc 1(Title: T) t"]


def test_injected_markup_is_data_not_markup():
    """Every string the renderer returns is the recorded text itself, to be put in text nodes: the injections come
    back verbatim inside pieces, and nothing is ever pre-rendered as HTML."""
    t = render(injected_sample(7))
    texts = [p["text"] for s in t["segments"] for p in s["pieces"] + [q for d in s.get("passages", []) for q in d["pieces"]]]
    assert any(INJECTED in x for x in texts) and INJECTED in t["question"] and INJECTED in t["segments"][0]["query"]
    assert "&lt;" not in json.dumps(t)  # not escaped here either: escaping twice would show "&lt;" to the reader
