"""studies/distill.py --quick end to end: tiny teacher, perturbed tiny student, real retriever and engine servers,
the reader slice scored greedy and sampled, the cost phase (distill vs RL step on the same rows, teacher throughput in
process vs remote) and 2 distillation steps with the teacher in process and remote; the report carries the contract
keys of benchmarks/results/distill.json."""

import json

import pytest

from studies.distill import CONTRACT, main


@pytest.mark.slow
def test_distill_benchmark_quick_writes_the_contract_keys(tmp_path):
    out = tmp_path / "distill.json"
    assert main(["--quick", "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    report = json.loads(out.read_text())
    assert set(CONTRACT) <= set(report) and report["complete"] and report["mode"] == "quick" and report["steps"] == 2
    assert report["provenance"]["allowed_by"] == "quick"
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


def _seed_report(seed: int, end: dict[str, float], **changes) -> dict:
    from studies.distill import POOL_KEYS

    report = {k: f"same-{k}" for k in POOL_KEYS}
    teacher = {"nq/1": 1.0, "nq/2": 0.5, "popqa/3": 0.0, "popqa/4": 1.0}
    start = {k: 0.0 for k in teacher}
    report.update(seed=seed, student_sampled_em_end=100 * sum(end.values()) / len(end), per_question_em={
        "teacher_sampled": teacher, "start_sampled": start, "in_process_sampled": end,
        "teacher_greedy": teacher, "start_greedy": start, "in_process_greedy": end}, **changes)
    return report


def test_pool_seeds_averages_each_question_over_seeds_and_refuses_mixed_settings(tmp_path):
    from studies.distill import pool_line, pool_seeds

    ends = [{"nq/1": 1.0, "nq/2": 0.5, "popqa/3": 0.0, "popqa/4": 0.0}, {"nq/1": 0.0, "nq/2": 0.5, "popqa/3": 0.5, "popqa/4": 1.0}]
    files = []
    for seed, end in enumerate(ends):
        files.append(tmp_path / f"s{seed}.json")
        files[-1].write_text(json.dumps(_seed_report(seed, end)))
    pooled = pool_seeds(files)
    # per question over seeds: 0.5, 0.5, 0.25, 0.5 -> 43.75%; teacher 62.5%; start 0
    assert pooled["seeds"] == [0, 1] and pooled["reader_questions"] == 4
    assert pooled["student_sampled_em_end"] == pytest.approx(43.75) and pooled["teacher_sampled_em"] == pytest.approx(62.5)
    assert pooled["student_sampled_em_end_per_seed"] == {"0": pytest.approx(37.5), "1": pytest.approx(50.0)}
    assert pooled["student_end_over_teacher"] == pytest.approx(0.7)
    assert pooled["student_end_minus_start_ci"]["mean"] == pytest.approx(43.75)
    seed_level = pooled["student_end_minus_start_seed_level"]  # the seeds' own differences: 37.5 and 50 pp
    assert seed_level["per_seed"] == pytest.approx([37.5, 50.0]) and seed_level["mean"] == pytest.approx(43.75)
    assert pooled["student_end_minus_teacher_ci"]["mean"] == pytest.approx(-18.75)
    assert pooled["student_greedy_em_end"] == pytest.approx(43.75)
    assert pooled["targets"]["student_sampled_em_end_at_least_80pct_of_teacher"] is False
    assert "2 seeds pooled" in pool_line(pooled) and "70% of the teacher" in pool_line(pooled)
    (tmp_path / "other.json").write_text(json.dumps(_seed_report(2, ends[0], steps="other")))
    with pytest.raises(SystemExit, match="other settings .*steps"):
        pool_seeds([files[0], tmp_path / "other.json"])
    with pytest.raises(SystemExit, match="repeat a seed"):
        pool_seeds([files[0], files[0]])


def test_pool_against_pairs_two_settings_by_question_over_the_same_seeds(tmp_path):
    from studies.distill import main, pool_against, pool_seeds

    def write(name, seed, end, **changes):
        f = tmp_path / name
        f.write_text(json.dumps(_seed_report(seed, end, **changes)))
        return f

    mine = [write("m0.json", 0, {"nq/1": 1.0, "nq/2": 1.0, "popqa/3": 0.0, "popqa/4": 0.5}),
            write("m1.json", 1, {"nq/1": 1.0, "nq/2": 0.0, "popqa/3": 0.5, "popqa/4": 0.5})]
    theirs = [write("t0.json", 0, {"nq/1": 0.0, "nq/2": 1.0, "popqa/3": 0.0, "popqa/4": 0.0}, distill="other"),
              write("t1.json", 1, {"nq/1": 1.0, "nq/2": 0.0, "popqa/3": 0.0, "popqa/4": 0.0}, distill="other")]
    pooled = pool_seeds(mine)
    block = pool_against(pooled, mine, theirs)
    # mine per question 1, .5, .25, .5 -> 56.25%; theirs .5, .5, 0, 0 -> 25%
    assert block["sampled_em_end"] == pytest.approx(25.0) and block["distill"] == "other"
    assert block["sampled_em_end_per_seed"] == {"0": pytest.approx(25.0), "1": pytest.approx(25.0)}
    assert block["sampled_end_minus_against_ci"]["mean"] == pytest.approx(31.25)
    assert block["greedy_end_minus_against_ci"]["mean"] == pytest.approx(31.25)
    with pytest.raises(SystemExit, match="seeds"):
        pool_against(pooled, mine, theirs[:1])
    with pytest.raises(SystemExit, match="other settings .*steps"):
        pool_against(pooled, mine, [theirs[0], write("t2.json", 1, {"nq/1": 0.0, "nq/2": 0.0, "popqa/3": 0.0, "popqa/4": 0.0},
                                                          steps="other")])
    out = tmp_path / "pooled.json"
    assert main(["--pool", *map(str, mine), "--against", *map(str, theirs), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["against"]["sampled_end_minus_against_ci"]["mean"] == pytest.approx(31.25)
    with pytest.raises(SystemExit):
        main(["--against", str(theirs[0])])
