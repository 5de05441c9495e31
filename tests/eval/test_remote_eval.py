"""`emapg eval --engine remote`: evaluation on a running `emapg engine serve` server, which is first given the
evaluated model's weights (the demo evaluates the starter and the trained policy on the engine the training
used). The server starts with the scripted *searcher* (always searches); the run evaluates the scripted
*answerer* (always answers Paris): only a run that really loaded the answerer's weights into the server can
answer, and its items must equal those of the local transformers engine on the same model.
"""

import json

import pytest

from agent.engines.launch import EngineServer
from app.cli import main as emapg_main
from emapg.jsonl import read_jsonl_repairing as read_items


def _eval(*args) -> int:
    return emapg_main(["eval", *map(str, args), "--no-progress"])


def _rows(path):
    return [{k: row[k] for k in ("id", "prediction", "response")} for row in read_items(path)]


@pytest.mark.slow
def test_remote_eval_serves_the_evaluated_model(tmp_path, searcher_dir, answerer_dir, retriever_server):
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "q1", "question": "capital of France", "golden_answers": ["Paris"]},
        {"id": "q2", "question": "capital of Italy", "golden_answers": ["Rome"]},
    ]))  # fmt: skip
    common = ["--model", answerer_dir, "--suite", "qa", "--protocol", "qa_quick", "--datasets", "bamboogle",
              "--data-path", f"bamboogle={data}", "--retriever-url", retriever_server.url]
    assert _eval(*common, "--engine", "hf", "--out", tmp_path / "local") == 0
    with EngineServer(searcher_dir, engine="hf", max_model_len=2048) as server:
        assert _eval(*common, "--engine", "remote", "--engine-urls", server.url, "--out", tmp_path / "remote") == 0
    local = _rows(tmp_path / "local" / "items" / "bamboogle.jsonl")
    remote = _rows(tmp_path / "remote" / "items" / "bamboogle.jsonl")
    assert [r["prediction"] for r in remote] == ["Paris", "Paris"]  # the answerer, not the searcher the server started with
    assert remote == local
    results = json.loads((tmp_path / "remote" / "results.json").read_text())
    assert results["engine"] == "remote" and results["datasets"]["bamboogle"]["em"] == 0.5


def test_remote_eval_config_errors(tmp_path, capsys):
    assert _eval("--model", "tiny-qwen2", "--suite", "qa", "--engine", "remote", "--out", tmp_path / "x") == 2
    assert "engine=remote needs engine_urls" in capsys.readouterr().err
    assert _eval("--model", "tiny-qwen2", "--suite", "qa", "--engine", "hf", "--engine-urls", "http://127.0.0.1:1",
                 "--out", tmp_path / "x") == 2
    assert "engine_urls is set but engine=hf" in capsys.readouterr().err
    assert _eval("--model", "tiny-qwen2", "--suite", "qa", "--engine", "remote", "--engine-urls", "ftp://x",
                 "--out", tmp_path / "x") == 2
    assert "is not an http(s) URL" in capsys.readouterr().err
