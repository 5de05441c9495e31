"""`emapg eval --format tool_calls`: the tool-call agent scored by the same QA metrics, the format recorded.

Real parts: the scripted tiny tool-call models (tests/fixtures/toolcalls.py) on the transformers engine,
the real retriever server, the real CLI.
"""

import json

from app.cli import main as emapg_main
from emapg.jsonl import read_jsonl_repairing as read_items


def test_tool_call_eval_scores_the_plain_answer_and_records_the_format(tmp_path, tool_answerer_dir, retriever_server):
    out = tmp_path / "answerer"
    rc = emapg_main(["eval", "--model", str(tool_answerer_dir), "--suite", "qa", "--protocol", "qa_quick", "--limit", "2",
                     "--datasets", "nq", "--format", "tool_calls", "--retriever-url", retriever_server.url, "--out", str(out),
                     "--engine", "hf", "--no-progress"])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["protocol"]["format"] == "tool_calls" and results["protocol"]["tool_parser"] == "hermes"
    assert results["protocol_card"]["settings"]["format"] == "tool_calls"
    for item in read_items(out / "items" / "nq.jsonl"):
        assert item["prediction"] == "Paris" and item["samples"][0]["searches"] == 0
        assert '"name": "search"' in item["prompt"]  # the tool declared by the chat template
        assert item["scores"]["em"] == float(any(g.lower() == "paris" for g in item["golds"]))
    report = (out / "report.md").read_text()
    assert "format=tool_calls (parser hermes)" in report and "final plain-text answer" in report


def test_tags_runs_record_no_tool_call_settings(tmp_path):
    from eval.protocols import get_protocol, protocol_dict

    assert "format" not in protocol_dict(get_protocol("qa_quick"))  # results from before the option compare as before
    assert protocol_dict(get_protocol("qa_quick", format="tool_calls"))["format"] == "tool_calls"
