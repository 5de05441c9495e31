"""benchmarks/distill.py --quick end to end: tiny teacher, perturbed tiny student, real retriever and engine servers,
2 distillation steps; the report carries the contract keys of benchmarks/results/distill.json."""

import json

from benchmarks.distill import CONTRACT, main


def test_distill_benchmark_quick_writes_the_contract_keys(tmp_path):
    out = tmp_path / "distill.json"
    assert main(["--quick", "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    report = json.loads(out.read_text())
    assert set(CONTRACT) <= set(report) and report["mode"] == "quick" and report["steps"] == 2
    for key in ("teacher_sampled_em", "student_sampled_em_start", "student_sampled_em_end"):
        assert 0.0 <= report[key] <= 100.0
    ci = report["student_end_minus_start_ci"]
    assert ci["low"] <= ci["mean"] <= ci["high"] and ci["confidence"] == 0.95
    assert report["heldout"]["questions"] == 14 and len(report["distill_reverse_kl"]) == 2
    assert report["teacher_scoring_s"] > 0 and (tmp_path / "work" / "run" / "step_2" / "policy").is_dir()
