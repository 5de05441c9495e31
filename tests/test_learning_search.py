"""studies/learning_search.py's pieces (the benchmark itself runs minutes: see its --quick mode)."""

import json

import pytest

from studies import harness
from studies.learning_search import ALGOS, per_question_em, plot
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


def test_arms_are_the_papers_baseline_emapg_and_a_shuffled_reward_control():
    assert "algorithm.kl.type=k3" in ALGOS["grpo"] and "algorithm.ema.decay=1.0" in ALGOS["grpo"]
    assert "algorithm.kl.type=topk_reverse" in ALGOS["emapg"] and "algorithm.ema.decay=0.9" in ALGOS["emapg"]
    assert "reward.shuffle_control=true" in ALGOS["control"] and set(ALGOS["emapg"]) < set(ALGOS["control"])
    assert not any("shuffle" in o for o in ALGOS["emapg"] + ALGOS["grpo"])
    # the off-protocol LoRA arm: EMA-PG's settings plus LoRA at 10x the config's full fine-tuning lr (2e-5)
    lora = ALGOS["emapg_lora"]
    assert set(ALGOS["emapg"]) < set(lora) and "model.lora.enabled=true" in lora and "optim.lr=2e-4" in lora
    assert "model.lora.engine_weights=merged" in lora  # the shared engine serves no adapters


def test_the_default_arms_are_the_protocols_and_the_contract_file_refuses_others(capsys):
    from studies.learning_search import PROTOCOL_ARMS, main

    assert PROTOCOL_ARMS == ("grpo", "emapg", "control")
    with pytest.raises(SystemExit):
        main(["--algorithms", "grpo", "emapg", "control", "emapg_lora"])
    assert "learning_search.json holds the protocol's run" in capsys.readouterr().err


def test_the_protocol_is_written_in_the_docstring():
    import studies.learning_search as ls

    doc = ls.__doc__
    assert "PRE-REGISTERED PROTOCOL" in doc and "mean@4" in doc and "Seeds 0, 1, 2" in doc and "reader slice" in doc.lower()


def test_plot_draws_every_run(tmp_path):
    from matplotlib.image import imread

    run = {"steps": 2, "reader_sampled_em_end": 30.0, "train_steps": [1, 2], "train_reward": [0.1, 0.2], "informative_frac": [0.5, 0.6]}
    report = {"policy": "p", "reader_questions": 14, "reader_sampled_em_start_seed_a": 25.0, "reader_sampled_em_start_seed_b": 26.0,
              "runs": {"grpo": {"0": run, "1": run}, "emapg": {"0": run}, "control": {"0": run}}}
    img = imread(plot(report, tmp_path / "curves.png"))
    assert img.shape[0] > 100 and img.shape[1] > 300


@pytest.mark.slow
def test_quick_mode_runs_to_the_end_and_writes_the_contract_keys(tmp_path):
    """The whole benchmark on tiny-qwen2 (2 seeds x 3 arms x 2 steps, one shared engine server): a run must
    not fail at its end, where the report is put together, after hours of default-mode training."""
    import os
    import subprocess
    import sys

    from emapg.paths import REPO_ROOT

    pytest.importorskip("matplotlib")
    out = tmp_path / "ls.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "studies" / "learning_search.py"), "--quick", "--out", str(out),
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["heldout_questions"] == 14 and report["reader_questions"] == 7  # one slice question per QA set
    assert report["trajectories_per_min"] > 0
    for alg in ("grpo", "emapg", "control"):
        r = report[alg]
        assert r["seeds"] == [0, 1] and len(r["reader_sampled_end_minus_start_ci"]) == 2
        assert len(r["reader_sampled_end_minus_start_seed_ci"]) == 2 and len(r["heldout_end_minus_start_seed_ci"]) == 2
        assert {"reader_sampled_em_start", "reader_sampled_em_end", "heldout_em_start", "heldout_em_end"} <= set(r)
        assert len(r["reader_sampled_end_minus_start_per_seed"]) == 2
        assert len(report["misses"][f"{alg}_end"]) == 2
    assert "emapg_minus_grpo_reader_sampled" in report and "starter_seed_b_minus_seed_a" in report
    assert report["provenance"]["allowed_by"] == "quick" and len(report["provenance"]["commit"]) == 40
    start = report["misses"]["start"]
    assert start["right"] + start["wrong_shown"] + start["wrong_not_shown"] == start["questions"] == 14


def test_partial_runs_may_not_overwrite_the_contract_file():
    from studies.learning_search import main

    for argv in (["--algorithms", "emapg", "--seeds", "0", "1"], ["--reduced", "--seeds", "0"], ["--override", "optim.lr=1e-4"]):
        with pytest.raises(SystemExit):
            main(argv)


def _recorded(reader_em, heldout_em):
    """An evaluation's recorded scores (studies.learning_search.recorded_scores) from per-question EMs."""
    reader = {f"nq/q{i}": x for i, x in enumerate(reader_em)}
    return {"reader": {"em": reader, "f1": dict(reader), "pass": dict(reader)},
            "heldout": {"em": {f"nq/h{i}": x for i, x in enumerate(heldout_em)}}}


def _misses(n):
    return {"questions": n, "right": 0, "wrong_shown": 0, "wrong_not_shown": n, "searches": {}}


def _run(reader_em, heldout_em):
    rec = _recorded(reader_em, heldout_em)
    return {"per_question": rec, "misses_end": _misses(len(heldout_em)), "trajectories_per_min": 30.0, "informative_frac": [0.5],
            "reader_sampled_em_end": 100 * sum(reader_em) / len(reader_em), "heldout_em_end": 100 * sum(heldout_em) / len(heldout_em),
            "reader_sampled_end_minus_start": {"mean": 0.0}, "train_s": 60.0, "trajectories_sampled": 30.0}


def test_summarise_pools_recorded_scores_and_compares_arms_on_common_seeds():
    """The estimates come from the recorded per-question scores alone (no work folder): the pooled end averages each
    question over seeds; between-arm differences use only the seeds both arms finished."""
    from studies.learning_search import summarise

    start = _recorded([0, 0, 1, 1], [0, 1])
    report = {"starter": {"reader_a": start["reader"], "reader_b": start["reader"], "heldout": start["heldout"], "misses": _misses(2)},
              "runs": {"grpo": {"0": _run([1, 0, 1, 1], [1, 1]), "1": _run([1, 1, 1, 1], [0, 1])},
                       "emapg": {"0": _run([0, 0, 1, 1], [0, 1])}, "control": {}}}
    out = summarise(report, ["grpo", "emapg", "control"], 90.0, 180.0, complete=False)
    assert out["grpo"]["reader_sampled_em_end"] == pytest.approx(100 * (1 + 0.5 + 1 + 1) / 4)  # per question over 2 seeds
    assert out["grpo"]["reader_sampled_end_minus_start"]["mean"] == pytest.approx(100 * 1.5 / 4)
    assert out["grpo"]["heldout_em_end"] == pytest.approx(75.0) and out["emapg"]["seeds"] == [0]
    d = out["emapg_minus_grpo_reader_sampled"]  # seed 0 only: emapg [0,0,1,1] - grpo [1,0,1,1]
    assert d["seeds"] == [0] and d["mean"] == pytest.approx(-25.0)
    assert "grpo_minus_control_reader_sampled" not in out and "control" not in out  # the control finished no run
    assert out["trajectories_per_min"] == pytest.approx(30.0) and len(out["misses"]["grpo_end"]) == 2
    seed_level = out["grpo"]["reader_sampled_end_minus_start_seed_level"]  # seeds +25 and +50 pp: the seed-level interval
    assert seed_level["per_seed"] == pytest.approx([25.0, 50.0]) and seed_level["mean"] == pytest.approx(37.5)
    assert out["grpo"]["reader_sampled_end_minus_start_seed_ci"] == [seed_level["low"], seed_level["high"]]
    assert out["emapg"]["heldout_end_minus_start_seed_ci"] == [0.0, 0.0]  # one seed that changed nothing


def test_resume_from_takes_recorded_runs_of_the_same_protocol_only(tmp_path):
    from studies.learning_search import PROTOCOL_KEYS

    proto = {k: f"value of {k}" for k in PROTOCOL_KEYS}
    earlier = {**proto, "starter": {"reader_a": {}}, "runs": {"grpo": {"0": _run([1], [1]), "1": {"no": "per_question"}}}}

    def take(earlier: dict, report: dict, work, algos, seeds):
        return harness.import_runs(earlier, report, work, algos, seeds, PROTOCOL_KEYS)

    assert take(earlier, dict(proto), tmp_path, ["grpo", "emapg"], [0, 1]) == ["starter", "grpo seed 0"]
    assert json.loads((tmp_path / "grpo-seed0" / "run.json").read_text())["per_question"]["heldout"]["em"] == {"nq/h0": 1}
    assert take(earlier, dict(proto), tmp_path, ["grpo"], [0]) == []  # already in the work folder: kept
    with pytest.raises(SystemExit, match="differs in steps"):
        take(earlier, {**proto, "steps": 99}, tmp_path / "other", ["grpo"], [0])
    with pytest.raises(SystemExit, match="other settings for grpo"):
        take({**earlier, "algorithms": {"grpo": "old"}}, {**proto, "algorithms": {"grpo": "new"}}, tmp_path / "o", ["grpo"], [0])
    with pytest.raises(SystemExit, match="no per-question scores"):
        take({**proto, "runs": {}}, dict(proto), tmp_path / "other", ["grpo"], [0])


def test_arm_runs_keeps_finished_runs_and_trains_the_rest_seeds_first(tmp_path):
    """The study loop: a finished run's record is kept, an unfinished run's folder is emptied and trained again, every
    arm reaches a seed before any arm reaches the next; a record without per-question scores is refused."""
    harness.record(tmp_path / "grpo-seed0" / "run.json", {"per_question": {"em": 1}})
    (tmp_path / "emapg-seed0").mkdir()
    (tmp_path / "emapg-seed0" / "stale.bin").write_text("left by a killed run")
    trained = []

    def train(arm, seed, folder):
        assert not folder.exists()  # emptied before training again
        trained.append((arm, seed))
        return {"per_question": {"em": seed}}

    runs = list(harness.arm_runs(tmp_path, ["grpo", "emapg"], [0, 1], train))
    assert [(a, s, kept) for a, s, _, kept in runs] == [("grpo", 0, True), ("emapg", 0, False), ("grpo", 1, False), ("emapg", 1, False)]
    assert trained == [("emapg", 0), ("grpo", 1), ("emapg", 1)]
    assert harness.finished(tmp_path / "emapg-seed1" / "run.json") == {"per_question": {"em": 1}}
    harness.record(tmp_path / "old" / "grpo-seed0" / "run.json", {"em": 1})
    with pytest.raises(SystemExit, match="per-question scores"):
        list(harness.arm_runs(tmp_path / "old", ["grpo"], [0], train))


def test_summarise_only_recomputes_a_report_from_its_recorded_scores(tmp_path):
    """``--summarise-only``: no run, the estimates (with the seed-level interval) from the report's own records; its
    measured trajectories per minute kept."""
    from studies.learning_search import main

    start = _recorded([0, 0, 1, 1], [0, 1])
    report = {"starter": {"reader_a": start["reader"], "reader_b": start["reader"], "heldout": start["heldout"], "misses": _misses(2)},
              "runs": {"grpo": {"0": _run([1, 0, 1, 1], [1, 1]), "1": _run([1, 1, 1, 1], [0, 1])}}, "trajectories_per_min": 12.5}
    (tmp_path / "old.json").write_text(json.dumps(report))
    assert main(["--summarise-only", str(tmp_path / "old.json"), "--out", str(tmp_path / "new.json")]) == 0
    new = json.loads((tmp_path / "new.json").read_text())
    assert new["grpo"]["reader_sampled_end_minus_start_seed_level"]["per_seed"] == pytest.approx([25.0, 50.0])
    assert new["trajectories_per_min"] == 12.5 and new["grpo"]["reader_sampled_em_end"] == pytest.approx(87.5)
    (tmp_path / "older.json").write_text(json.dumps({"runs": {}}))
    with pytest.raises(SystemExit, match="no per-question scores"):
        main(["--summarise-only", str(tmp_path / "older.json"), "--out", str(tmp_path / "x.json")])
