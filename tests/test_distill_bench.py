"""benchmarks/distill.py --quick end to end: tiny teacher, perturbed tiny student, real retriever and engine servers,
the reader slice scored greedy and sampled, the cost phase (distill vs RL step on the same rows, teacher throughput in
process vs remote) and 2 distillation steps with the teacher in process and remote; the report carries the contract
keys of benchmarks/results/distill.json."""

import json

import pytest

from benchmarks.distill import CONTRACT, main


@pytest.mark.slow
def test_distill_benchmark_quick_writes_the_contract_keys(tmp_path):
    out = tmp_path / "distill.json"
    assert main(["--quick", "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    report = json.loads(out.read_text())
    assert set(CONTRACT) <= set(report) and report["complete"] and report["mode"] == "quick" and report["steps"] == 2
    for key in ("teacher_sampled_em", "student_sampled_em_start", "student_sampled_em_end", "teacher_greedy_em",
                "student_greedy_em_start", "student_greedy_em_end"):
        assert 0.0 <= report[key] <= 100.0
    ci = report["student_end_minus_start_ci"]
    assert ci["low"] <= ci["mean"] <= ci["high"] and ci["confidence"] == 0.95
    assert 0 < report["reader_questions"] <= 14
    for arm in ("in_process", "remote"):
        block = report["arms"][arm]
        assert len(block["distill_reverse_kl"]) == 2 and block["teacher_scoring_s"] > 0 and "sampled_em_end" in block
    assert (tmp_path / "work" / "arm_in_process" / "step_2" / "policy").is_dir()
    cost = report["cost"]
    assert cost["distill_over_rl_step_time"]["median"] > 0 and cost["rows"] > 0
    scoring = cost["teacher_scoring"]
    assert scoring["in_process_tokens_per_s"]["median"] > 0 and scoring["remote_tokens_per_s"]["median"] > 0
    assert scoring["max_abs_logp_difference"] < 1e-3  # the remote teacher's scores are the in-process teacher's
    assert "distill_step_at_most_1_5x_rl_step" in report["targets"]
