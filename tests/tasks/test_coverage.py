"""The coverage audit (tasks.coverage, `emapg data audit`) on a hand-made corpus served for real, and the matcher."""

import json
import subprocess
import sys

import pytest

from tasks.qa import gold_shown


def test_gold_shown_is_token_bounded_and_ignores_answers_the_question_names():
    assert gold_shown(["He was born in 1911."], ["1911"]) == "1911"
    assert gold_shown(["Room 19115 is closed."], ["1911"]) is None  # not inside another token
    assert gold_shown(["The Beatles' album"], ["the beatles"]) == "the beatles"  # SQuAD-normalised
    # an option the question names shows nothing: left out; another alias still counts
    assert gold_shown(["Quiet Harbor is an album."], ["Quiet Harbor"], "Is it Quiet Harbor or Velvet Lanterns?") is None
    assert gold_shown(["by Mira Okafor"], ["Harbor", "Mira Okafor"], "Who set up Harbor?") == "Mira Okafor"
    assert gold_shown([], ["x"]) is None and gold_shown(["a b"], [""]) is None
    # a gold at the very end (or start) of a tagged observation: the tags are boundaries, not part of the gold's token
    assert gold_shown(["<information>Doc 1(Title: \"Emma\") A novel by Jane Austen</information>\n\n"],
                      ["Jane Austen"]) == "Jane Austen"
    assert gold_shown(["<tool_response>1911 was the year</tool_response>"], ["1911"]) == "1911"
    assert gold_shown(["<information>Austenite</information>"], ["Austen"]) is None


def test_corpus_matcher_finds_whole_token_answers_only():
    from tasks.coverage import CorpusMatcher

    m = CorpusMatcher(['"T"\nThe bridge was completed in 1911.', '"U"\nMira Okafor set it up.'])
    assert m.holds(["1911"]) and m.holds(["mira okafor"]) and not m.holds(["191"]) and not m.holds(["Okafor Mira"])
    assert not m.holds(["1911"], question="Was it 1911?")  # only in the question: not evidence


def test_second_queries_come_from_what_was_shown():
    from tasks.coverage import relation_words, second_queries
    from tasks.multihop import MultiHopQuestion

    q = MultiHopQuestion("x", "In which city did the band behind the album Quiet Harbor play its first concert?", ["Tulsa"],
                         "s", "bridge", ["Quiet Harbor (album)", "Velvet Lanterns"])
    shown = [{"id": "a", "contents": '"Quiet Harbor (album)"\nQuiet Harbor is the debut album of the band Velvet Lanterns.'}]
    queries, why = second_queries(q, shown)
    assert why == "" and queries[0].startswith("Velvet Lanterns ") and queries[1:] == ["Velvet Lanterns"]
    relation = ["city", "band", "behind", "play", "concert"]  # no stop words, nothing of the shown title or the entity
    assert relation_words(q.question, ["Quiet Harbor (album)"], "Velvet Lanterns") == relation
    assert queries[0] == "Velvet Lanterns " + " ".join(relation)
    assert relation_words(q.question, [], "Velvet Lanterns", limit=2) == ["play", "concert"]  # the end says what is asked
    not_shown = [{"id": "b", "contents": '"Quiet Harbor (album)"\nQuiet Harbor is a debut album.'}]
    assert second_queries(q, not_shown) == ([], "bridge_not_shown")  # a model could not write the entity
    both = [{"id": "c", "contents": '"Chess"\nChess is a game.'}]
    assert second_queries(q, both) == ([], "two_paragraphs_missing")


def test_classify_puts_every_handmade_question_in_its_class(coverage_corpus):
    from retriever.client import RetrieverClient
    from tasks.coverage import CLASSES, CorpusMatcher, classify, corpus_passages, table

    corpus = CorpusMatcher(corpus_passages(coverage_corpus.corpus_path))
    with RetrieverClient(coverage_corpus.url, timeout=20, retries=1) as client:
        records = classify(coverage_corpus.questions, client, topk=1, corpus=corpus, batch_size=3)
    got = {r.id: r.klass for r in records}
    assert got == coverage_corpus.expected
    by_id = {r.id: r for r in records}
    assert by_id["q-two"].first_ids == ["p-album"] and by_id["q-two"].second_ids == ["p-band"]
    assert by_id["q-two"].second_query.startswith("Velvet Lanterns") and by_id["q-two"].second_gold == "Tulsa"
    assert by_id["q-decomp"].second_query == "Who founded Zorblax Records?" and by_id["q-decomp"].second_ids == ["p-label"]
    assert by_id["q-one"].first_gold == "volcano" and by_id["q-hidden"].why == "bridge_not_shown"
    assert set(CLASSES) == set(coverage_corpus.expected.values())
    counts = table(records)
    assert counts["all"]["questions"] == len(records) and counts["all"]["second_search"] == 2


def test_data_audit_cli_writes_the_classes(coverage_corpus, tmp_path):
    rows = [q.to_row() for q in coverage_corpus.questions]
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "audit.json"
    proc = subprocess.run([sys.executable, "-m", "app.cli", "data", "audit", "--dataset", str(data), "--retriever-url",
                           coverage_corpus.url, "--corpus", str(coverage_corpus.corpus_path), "--topk", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    got = {r["id"]: r["klass"] for r in result["datasets"][str(data)]["questions"]}
    assert got == coverage_corpus.expected
    assert "second_search" in proc.stdout and "wrote" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "app.cli", "data", "audit", "--dataset", str(data), "--retriever-url",
                          coverage_corpus.url, "--corpus", str(tmp_path / "missing.jsonl"), "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "corpus: no such file" in bad.stderr and "Traceback" not in bad.stderr
