"""Parts of the demo's report, from hand-made evaluation folders (the whole demo runs in tests/test_demo.py)."""

import json
from pathlib import Path

from app.demo import _two_search_trajectories


def _write(folder: Path, dataset: str, records: list[dict]) -> None:
    (folder / "items").mkdir(parents=True)
    (folder / "items" / f"{dataset}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _sample(searches: int, em: float, queries: list[str], gold: list[int]) -> dict:
    return {"searches": searches, "queries": queries, "search_gold": gold, "prediction": "Paris" if em else "Lyon",
            "response": f"<search>{queries[0]}</search> ... <answer>{'Paris' if em else 'Lyon'}</answer>", "scores": {"em": em}}


def _record(qid: str, samples: list[dict]) -> dict:
    return {"id": qid, "dataset": "hotpotqa", "question": f"question {qid}?", "golds": ["Paris"], "samples": samples}


def test_the_two_search_section_counts_every_trajectory_and_shows_a_right_one_of_the_trained_policy(tmp_path):
    _write(tmp_path / "eval_base", "nq", [_record("b1", [_sample(1, 1.0, ["q"], [1])])])
    _write(tmp_path / "eval_base_sampled", "nq", [_record("b1", [_sample(2, 0.0, ["q", "q2"], [0, 0]), _sample(1, 0.0, ["q"], [0])])])
    _write(tmp_path / "eval_trained_search", "hotpotqa", [_record("t1", [_sample(2, 0.0, ["wrong one", "x"], [0, 0])]),
                                                          _record("t2", [_sample(2, 1.0, ["first", "bridge entity"], [0, 1])])])
    _write(tmp_path / "eval_trained", "nq", [_record("t3", [_sample(1, 0.0, ["q"], [0])])])
    counts, lines = _two_search_trajectories(tmp_path)
    assert counts == {"trained": {"trajectories": 3, "searched_twice": 2}, "base": {"trajectories": 3, "searched_twice": 1}}
    text = "\n".join(lines)
    assert lines[0] == "## A held-out trajectory with two searches"
    assert "trained 2 of 3, starter 1 of 3" in text
    # the right answer is preferred over the first found, and its second query is marked as showing the gold
    assert "`t2`" in text and "a search-slice question" in text and "greedy" in text
    assert "`first` → `bridge entity` (its passages show the gold)" in text and "EM 1.0" in text


def test_the_two_search_section_says_so_when_no_trajectory_searched_twice(tmp_path):
    _write(tmp_path / "eval_base", "nq", [_record("b1", [_sample(1, 1.0, ["q"], [1])])])
    _write(tmp_path / "eval_trained", "nq", [_record("t1", [_sample(1, 0.0, ["q"], [0]), _sample(0, 0.0, ["-"], [])])])
    counts, lines = _two_search_trajectories(tmp_path)
    assert counts == {"trained": {"trajectories": 2, "searched_twice": 0}, "base": {"trajectories": 1, "searched_twice": 0}}
    assert "None of the 2 trained and 1 starter trajectories evaluated (greedy and sampled) searched twice." in lines


def test_a_trajectory_that_writes_its_own_fence_stays_inside_the_block(tmp_path):
    """A response holding ``` (or longer runs) cannot end the report's block and have the rest rendered as Markdown."""
    from app.demo import _text_block

    response = "<search>a</search>\n```\n<script>alert(1)</script>\n````\n# heading"
    block = _text_block(response)
    fence = block.split("text\n", 1)[0]
    assert fence == "`````" and block.endswith("\n" + fence) and response in block
    assert _text_block("plain").startswith("```text\n")
