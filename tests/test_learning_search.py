"""benchmarks/learning_search.py's pieces (the benchmark itself runs minutes: see its --quick mode)."""

import json

import pytest

from benchmarks.learning_search import ALGOS, per_question_em, plot
from tasks.datasets import QA_DATASETS


def _eval_dir(root, name, ems):
    items = root / name / "items"
    items.mkdir(parents=True)
    for ds in QA_DATASETS:
        rows = [{"id": f"{ds}-{i}", "scores": {"em": em}, "samples": [{"stop_reason": "answer"}]} for i, em in enumerate(ems)]
        (items / f"{ds}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / name


def test_per_question_em_averages_seeds(tmp_path):
    a = _eval_dir(tmp_path, "seed0", [1.0, 0.0])
    b = _eval_dir(tmp_path, "seed1", [1.0, 1.0])
    em = per_question_em([a, b])
    assert len(em) == 14 and em["nq/nq-0"] == 1.0 and em["bamboogle/bamboogle-1"] == 0.5


def test_algorithms_are_the_papers_baseline_and_emapg():
    assert "algorithm.kl.type=k3" in ALGOS["grpo"] and "algorithm.ema.decay=1.0" in ALGOS["grpo"]
    assert "algorithm.kl.type=topk_reverse" in ALGOS["emapg"] and "algorithm.ema.decay=0.9" in ALGOS["emapg"]


def test_plot_draws_every_run(tmp_path):
    from matplotlib.image import imread

    run = {"eval_steps": [0, 2], "heldout_em": [10.0, 12.0], "train_steps": [1, 2], "train_reward": [0.1, 0.2]}
    report = {"policy": "p", "heldout": {"questions": 14}, "runs": {"grpo": {"0": run, "1": run}, "emapg": {"0": run}}}
    img = imread(plot(report, tmp_path / "curves.png"))
    assert img.shape[0] > 100 and img.shape[1] > 300


@pytest.mark.slow
def test_quick_mode_runs_to_the_end_and_writes_the_contract_keys(tmp_path):
    """The whole benchmark on tiny-qwen2 (2 seeds x 2 algorithms x 2 steps, one shared engine server): a run must
    not fail at its end, where the report is put together, after hours of default-mode training."""
    import os
    import subprocess
    import sys

    from emapg.paths import REPO_ROOT

    pytest.importorskip("matplotlib")
    out = tmp_path / "ls.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "learning_search.py"), "--quick", "--out", str(out),
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["heldout_questions"] == 14
    for alg in ("grpo", "emapg"):
        r = report[alg]
        assert r["seeds"] == [0, 1] and len(r["end_minus_start_ci"]) == 2
        assert {"heldout_em_start", "heldout_em_end"} <= set(r)
        assert len(report["misses"][f"{alg}_end"]) == 2
    start = report["misses"]["start"]
    assert start["right"] + start["wrong_shown"] + start["wrong_not_shown"] == start["questions"] == 14


@pytest.mark.slow
def test_one_algorithm_run_reports_only_that_algorithm(tmp_path):
    """``--algorithms emapg`` (a dose-response run): only EMA-PG is trained and reported, with no EMA-PG - GRPO row.
    ``--keep-final`` keeps the last checkpoint's weights (not its optimizer or anchor), and greedy_vs_sampled.py scores
    that real checkpoint against the model it started from."""
    import os
    import subprocess
    import sys

    from emapg.paths import REPO_ROOT

    pytest.importorskip("matplotlib")
    out = tmp_path / "one.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "learning_search.py"), "--quick", "--algorithms", "emapg",
                           "--seeds", "0", "--out", str(out), "--work", str(tmp_path / "work"), "--keep-final",
                           "--override", "rollout.temperature=0.9"],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"emapg"} and "grpo" not in report and "emapg_minus_grpo_end" not in report
    assert report["emapg"]["seeds"] == [0] and len(report["misses"]["emapg_end"]) == 1
    (changes,) = report["answer_changes"]["emapg_end"]  # every held-out question in exactly one transition and one kind
    assert changes["kept_right"] + changes["lost"] + changes["gained"] + changes["kept_wrong"] == changes["questions"] == 14
    assert sum(k["questions"] for k in changes["by_kind"].values()) == 14 and 0 <= changes["changed"] <= 14
    assert report["overrides"] == ["rollout.temperature=0.9"] and report["rollout"]["temperature"] == 0.9  # as trained

    run = tmp_path / "work" / "emapg-seed0"
    assert not (run / "step_1").exists()  # not the last: removed
    kept = run / "step_2"
    assert not (kept / "optimizer.pt").exists() and not (kept / "anchor.safetensors").exists() and not (kept / "state").exists()
    assert list((kept / "policy").glob("*.safetensors")) and (kept / "policy" / "trained_questions.json").is_file()

    gvs = tmp_path / "gvs.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "greedy_vs_sampled.py"), "--quick", "--trained",
                           str(kept / "policy"), "--per-dataset", "1", "--out", str(gvs)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    g = json.loads(gvs.read_text())
    assert g["trained"] == str(kept / "policy") and g["sampled"]["n"] == 2
    for decoding in ("greedy", "sampled"):
        r = g["results"][decoding]
        assert r["questions"] == 7 and set(r["per_dataset"]) == set(QA_DATASETS)
        d = r["trained_minus_start"]
        assert d["low"] <= d["mean"] <= d["high"] and abs(d["mean"] - (r["trained"] - r["start"])) < 1e-9
    changes = g["results"]["greedy"]["answer_changes"]
    assert changes["questions"] == 7 and sum(k["questions"] for k in changes["by_kind"].values()) == 7


def test_one_algorithm_may_not_overwrite_the_contract_file():
    from benchmarks.learning_search import main

    with pytest.raises(SystemExit):
        main(["--algorithms", "emapg", "--reduced", "--seeds", "0"])
