"""End to end: `emapg eval` on real tiny models through the real engines and the real retriever
server, producing items, results.json, report.md and plots; `emapg eval compare`; resume.

Models (tests/fixtures/agent.py): ``searcher_dir`` always emits ``<search> capital of France
</search>`` and ``answerer_dir`` always answers ``<answer> Paris </answer>`` -- real weights run
by the real transformers engine, so the scores below are known exactly.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from emapg.errors import UserError
from app.cli import main as emapg_main
from emapg.paths import REPO_ROOT
from tasks.datasets import QA_DATASETS
from eval.protocols import get_protocol
from emapg.jsonl import read_jsonl_repairing as read_items
from eval.runner import EvalConfig, run_eval

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _eval(*args: str) -> int:
    return emapg_main(["eval", *map(str, args), "--engine", "hf", "--no-progress"])


def test_qa_suite_through_real_retriever(tmp_path, searcher_dir, retriever_server):
    out = tmp_path / "searcher"
    rc = _eval("--model", searcher_dir, "--suite", "qa", "--protocol", "qa_quick", "--limit", 2,
               "--retriever-url", retriever_server.url, "--out", out, "--name", "searcher")
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["name"] == "searcher" and results["suite"] == "qa" and results["engine"] == "hf"
    assert results["protocol"]["name"] == "qa_quick" and results["primary_metric"] == "em"
    assert list(results["datasets"]) == list(QA_DATASETS)
    for ds, vals in results["datasets"].items():
        assert vals["n_items"] == 2
        # the scripted searcher searches on every turn: max_turns searches, then the final turn
        assert vals["searches"] == 2 and vals["turns"] == 3
        assert vals["em"] == 0.0 and vals["has_answer"] == 0.0
        assert set(results["metric_names"]) <= set(vals)
        items = read_items(out / "items" / f"{ds}.jsonl")
        assert len(items) == 2
        for item in items:
            assert item["prompt"].count("<answer> Beijing </answer>") == 1  # the Search-R1 prompt
            assert item["response"].count("<information>") == 2
            assert item["samples"][0]["queries"] == ["capital of France"] * 2
            assert all(len(ids) == 3 for ids in item["samples"][0]["retrieved_ids"])  # top-3 hits
            assert item["golds"] and item["prediction"] is None
    assert results["average"]["searches"] == 2
    report = (out / "report.md").read_text()
    assert "| **average** | 14 |" in report and "qa_quick" in report
    assert (out / "em.png").read_bytes().startswith(PNG_MAGIC)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_scores_and_compare_against_paper(tmp_path, answerer_dir, searcher_dir, retriever_server, retriever_index):
    bamboogle = _write_jsonl(tmp_path / "b.jsonl", [
        {"id": "q1", "question": "capital of France", "golden_answers": ["Paris"]},
        {"id": "q2", "question": "city of light", "golden_answers": ["The city of Paris", "Paris, France"]},
        {"id": "q3", "question": "capital of Italy", "golden_answers": ["Rome"]},
        {"id": "q4", "question": "a reserve", "golden_answers": ["Nerviens", "paris."]},
    ])  # fmt: skip
    hotpot = _write_jsonl(tmp_path / "h.jsonl", [
        {"id": "h1", "question": "where is the Louvre", "golden_answers": ["Paris"]},
        {"id": "h2", "question": "capital of China", "golden_answers": ["Beijing"]},
    ])  # fmt: skip
    runs = {}
    # the answerer talks to the session's server; the searcher's run starts its own on the index
    for label, model, where in (("answerer", answerer_dir, ["--retriever-url", retriever_server.url]),
                                ("searcher", searcher_dir, ["--index", retriever_index.index_dir])):
        runs[label] = tmp_path / label
        rc = _eval("--model", model, "--suite", "qa", "--protocol", "qa_quick", "--datasets", "bamboogle,hotpotqa",
                   "--data-path", f"bamboogle={bamboogle}", "--data-path", f"hotpotqa={hotpot}",
                   *where, "--out", runs[label], "--name", label)
        assert rc == 0
    assert json.loads((runs["searcher"] / "results.json").read_text())["retriever"].startswith("started on")
    ans = json.loads((runs["answerer"] / "results.json").read_text())
    bam = ans["datasets"]["bamboogle"]
    # "Paris" vs golds: q1 exact; q2's golds normalise to "city of paris" / "paris france" (EM 0,
    # F1 max(1/2, 2/3), no gold inside the prediction so cover 0); q3 wrong; q4 "paris." exact.
    assert bam["n_items"] == 4
    assert bam["em"] == pytest.approx(2 / 4)
    assert bam["f1"] == pytest.approx((1 + 2 / 3 + 0 + 1) / 4)
    assert bam["cover_em"] == pytest.approx(2 / 4)
    assert bam["has_answer"] == 1.0 and bam["searches"] == 0 and bam["turns"] == 1
    assert ans["datasets"]["hotpotqa"]["em"] == 0.5
    assert ans["average"]["em"] == pytest.approx((0.5 + 0.5) / 2)
    # the per-slice table reads the same scores as the per-dataset one (greedy: one sample a question)
    n = sum(v["n_items"] for v in ans["datasets"].values())
    assert ans["search"]["all"]["em"] == pytest.approx(sum(v["em"] * v["n_items"] for v in ans["datasets"].values()) / n, abs=1e-4)
    # The searcher's top hit for "capital of France" is titled "Carrière des Nerviens Regional
    # Nature Reserve"; nothing it is shown mentions Rome: retrieval recall 1 for q4, 0 for q3.
    recall = {r["id"]: r["scores"]["retrieval_recall"] for r in read_items(runs["searcher"] / "items" / "bamboogle.jsonl")}
    assert recall["q4"] == 1.0 and recall["q3"] == 0.0

    cmp_dir = tmp_path / "cmp"
    assert emapg_main(["eval", "compare", str(runs["searcher"]), str(runs["answerer"]), "--out", str(cmp_dir)]) == 0
    report = (cmp_dir / "report.md").read_text()
    assert "| dataset | searcher | answerer |" in report and "| searcher | answerer | paper" not in report
    assert "| bamboogle | 0.0 | 50.0 |" in report and "| hotpotqa | 0.0 | 50.0 |" in report
    assert "| **average** | **0.0** | **50.0** |" in report
    # the paper's numbers: a table of their own, after ours, headed as another model at another scale
    paper = report.index("### Published numbers of the EMA-PG paper: another model, another scale")
    assert paper > report.index("| **average** | **0.0** | **50.0** |")
    assert "| bamboogle | 12.8 | 33.1 |" in report[paper:] and "| hotpotqa | 29.7 | 44.1 |" in report[paper:]
    assert "not produced by this code" in report[paper:]
    comparison = json.loads((cmp_dir / "comparison.json").read_text())
    assert [r["name"] for r in comparison["runs"]] == ["searcher", "answerer"]
    assert comparison["paper_reference"]["columns"]["paper EMA-PG"]["2wikimultihopqa"] == 40.1
    assert (cmp_dir / "em.png").read_bytes().startswith(PNG_MAGIC)


def _math_cfg(model, out: Path) -> EvalConfig:
    protocol = get_protocol("math_quick", n=2, max_tokens=12)
    return EvalConfig(model=str(model), out=str(out), protocol=protocol, datasets=["aime2024", "amc"], limit=5,
                      engine="hf", batch_size=2, progress=False, grader_workers=1)


def test_math_suite_resume_after_interruption(tmp_path, tiny_model_dir):
    """Sampled (T=0.8, n=2) so that a resumed run equal to a clean one shows seeds are per batch."""
    clean = run_eval(_math_cfg(tiny_model_dir, tmp_path / "clean"))
    assert clean["primary_metric"] == "pass@1" and clean["metric_names"][:2] == ["pass@1", "pass@2"]
    assert clean["grader"] == "math_verify"
    assert (tmp_path / "clean" / "pass_at_k.png").read_bytes().startswith(PNG_MAGIC)

    out = tmp_path / "resumed"
    batches: list[tuple[str, int]] = []

    def stop_after_two(ds, n_done):
        batches.append((ds, n_done))
        if len(batches) == 2:
            raise KeyboardInterrupt  # what Ctrl-C does mid-run

    with pytest.raises(KeyboardInterrupt):
        run_eval(_math_cfg(tiny_model_dir, out), on_batch=stop_after_two)
    assert not (out / "results.json").exists()
    first_part = (out / "items" / "aime2024.jsonl").read_bytes()
    assert len(read_items(out / "items" / "aime2024.jsonl")) == 4
    # a write torn by a kill: half a record at the end is dropped and that question redone
    with open(out / "items" / "aime2024.jsonl", "ab") as f:
        f.write(b'{"id": "aime2024-torn", "dataset": "aime')

    batches.clear()
    resumed = run_eval(_math_cfg(tiny_model_dir, out), on_batch=lambda ds, n: batches.append((ds, n)))
    # only the missing questions ran: aime2024 has 1 left (one batch), amc all 5 (three batches)
    assert batches == [("aime2024", 5), ("amc", 2), ("amc", 4), ("amc", 5)]
    assert (out / "items" / "aime2024.jsonl").read_bytes().startswith(first_part)
    for ds in ("aime2024", "amc"):
        a = read_items(tmp_path / "clean" / "items" / f"{ds}.jsonl")
        b = read_items(out / "items" / f"{ds}.jsonl")
        assert [r["id"] for r in a] == [r["id"] for r in b]
        assert [[s["response"] for s in r["samples"]] for r in a] == [[s["response"] for s in r["samples"]] for r in b]
    assert resumed["datasets"] == clean["datasets"]

    # a finished run reruns instantly (nothing to do) and refuses changed settings
    batches.clear()
    again = run_eval(_math_cfg(tiny_model_dir, out), on_batch=lambda ds, n: batches.append((ds, n)))
    assert batches == [] and again["datasets"] == clean["datasets"]
    with pytest.raises(UserError, match="protocol.temperature"):
        run_eval(EvalConfig(**{**_math_cfg(tiny_model_dir, out).__dict__,
                               "protocol": get_protocol("math_quick", n=2, max_tokens=12, temperature=0.5)}))


def test_cli_user_errors(tmp_path, capsys):
    assert _eval("--model", "tiny-qwen2", "--suite", "qa", "--datasets", "nope", "--out", tmp_path / "x") == 2
    assert "unknown dataset 'nope'" in capsys.readouterr().err
    assert _eval("--model", "tiny-qwen2", "--suite", "qa", "--datasets", "math500", "--out", tmp_path / "x") == 2
    assert "belongs to the math suite" in capsys.readouterr().err
    assert _eval("--model", "tiny-qwen2", "--suite", "qa", "--protocol", "math_paper", "--out", tmp_path / "x") == 2
    assert "is for the math suite" in capsys.readouterr().err
    assert _eval("--model", "tiny-qwen2", "--suite", "math", "--n", "0", "--out", tmp_path / "x") == 2
    assert "n must be >= 1" in capsys.readouterr().err
    assert _eval("--model", "tiny-qwen2", "--suite", "qa", "--data-path", "bad", "--out", tmp_path / "x") == 2
    assert _eval("--model", tmp_path / "no-such-model", "--suite", "math", "--datasets", "aime2024", "--limit", "1",
                 "--out", tmp_path / "x") == 2
    assert f"--model {str(tmp_path / 'no-such-model')!r}: no such model folder" in capsys.readouterr().err
    assert emapg_main(["eval", "compare", str(tmp_path), "--out", str(tmp_path / "c")]) == 2
    assert "no results.json" in capsys.readouterr().err


def test_resume_after_sigkill(tmp_path, tiny_model_dir):
    """A real `emapg eval` process killed mid-run; the rerun does only what is missing."""
    out = tmp_path / "killed"
    argv = [sys.executable, "-m", "app.cli", "eval", "--model", str(tiny_model_dir), "--suite", "math",
            "--protocol", "math_quick", "--n", "2", "--max-tokens", "12", "--datasets", "aime2024", "--limit", "6",
            "--batch-size", "1", "--engine", "hf", "--grader-workers", "1", "--no-progress", "--out", str(out)]
    items = out / "items" / "aime2024.jsonl"
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (items.exists() and items.read_bytes().count(b"\n") >= 2):
            assert proc.poll() is None, "the eval finished or died before it could be killed"
            assert time.monotonic() < deadline, "no progress within 5 minutes"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    before = read_items(items)
    assert 2 <= len(before) < 6 and not (out / "results.json").exists()

    cfg = EvalConfig(model=str(tiny_model_dir), out=str(out), datasets=["aime2024"], limit=6, engine="hf",
                     protocol=get_protocol("math_quick", n=2, max_tokens=12), batch_size=1, progress=False)
    ran: list[int] = []
    resumed = run_eval(cfg, on_batch=lambda ds, n: ran.append(n))
    after = read_items(items)
    assert ran == list(range(len(before) + 1, 7))  # one batch per missing question, nothing redone
    assert after[: len(before)] == before and len(after) == 6

    clean = run_eval(EvalConfig(**{**cfg.__dict__, "out": str(tmp_path / "clean")}))
    assert resumed["datasets"] == clean["datasets"]
    assert [r["samples"] for r in after] == [r["samples"] for r in read_items(tmp_path / "clean" / "items" / "aime2024.jsonl")]


def test_failed_searches_are_reported(tmp_path, searcher_dir, fault_proxy):
    """A retriever that answers HTTP 500: the run completes, and the report says why scores are low."""
    fault_proxy.mode = "500"
    data = _write_jsonl(tmp_path / "q.jsonl", [{"id": "a", "question": "x", "golden_answers": ["y"]},
                                                {"id": "b", "question": "z", "golden_answers": ["w"]}])
    out = tmp_path / "run"
    assert _eval("--model", searcher_dir, "--suite", "qa", "--protocol", "qa_quick", "--datasets", "nq",
                 "--data-path", f"nq={data}", "--retriever-url", fault_proxy.url, "--out", out) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["datasets"]["nq"]["search_failures"] == 4  # 2 questions x 2 searches
    assert results["datasets"]["nq"]["rollout_errors"] == 0
    assert "4 search(es) failed" in (out / "report.md").read_text()
