"""studies/stability.py's pieces (intervals, the summary of synthetic runs, the plot) and its --quick mode end to end."""

from __future__ import annotations

import json

import pytest

from studies.stability import ARMS, CONTRACT_ARMS, GUARDED, newcombe, plot, run_record, summarise, wilson
from tests.trainer.test_guard import HEALTHY, degenerating


def test_wilson_interval_matches_published_values():
    assert wilson(0, 5) == pytest.approx([0.0, 0.4345], abs=1e-4)
    assert wilson(5, 10) == pytest.approx([0.2366, 0.7634], abs=1e-4)
    assert wilson(0, 0) == [0.0, 1.0]


def test_newcombe_difference_interval_matches_newcombe_1998():
    assert newcombe(56, 70, 48, 80) == pytest.approx([0.0524, 0.3339], abs=1e-4)  # his example, method 10


def test_the_arms_are_the_two_algorithms_and_their_halves():
    assert "algorithm.kl.type=k3" in ARMS["grpo"] and "algorithm.ema.decay=1.0" in ARMS["grpo"]
    assert "algorithm.kl.type=topk_reverse" in ARMS["emapg"] and "algorithm.ema.decay=0.9" in ARMS["emapg"]
    assert "algorithm.kl.type=k3" in ARMS["ema_k3"] and "algorithm.ema.decay=0.9" in ARMS["ema_k3"]
    assert "algorithm.kl.type=topk_reverse" in ARMS["frozen_topk"] and "algorithm.ema.decay=1.0" in ARMS["frozen_topk"]
    assert set(CONTRACT_ARMS) <= set(ARMS) and "algorithm.entropy_target=0.3" in ARMS["grpo_entropy_ctl"]


def test_the_protocol_is_written_in_the_docstring():
    import studies.stability as st

    doc = st.__doc__
    assert "PRE-REGISTERED PROTOCOL" in doc and "Collapse" in doc and "Wilson" in doc and "sweep" in doc


def healthy_run(n: int = 12) -> list[dict[str, float]]:
    return [{**HEALTHY, "response/length_drift": 0.0} for _ in range(n)]


def test_summary_of_synthetic_runs():
    collapsing, healthy = run_record(degenerating()), run_record(healthy_run())
    assert collapsing["collapse_step"] == 8 and healthy["collapse_step"] is None  # reward 0.5 -> 0.05 from step 8
    runs = {"grpo": {0: collapsing, 1: collapsing, 2: healthy}, "emapg": {0: healthy, 1: healthy, 2: healthy},
            GUARDED: {0: collapsing}}
    s = summarise(runs)
    assert "consecutive" in s["collapse_definition"]
    assert s["grpo"]["seeds"] == [0, 1, 2] and s["grpo"]["collapse_rate"] == 2 / 3
    assert s["grpo"]["collapse_rate_ci"] == wilson(2, 3) and s["grpo"]["steps_to_collapse"] == [8, 8]
    assert s["emapg"]["collapse_rate"] == 0.0 and s["emapg"]["minus_grpo_collapse_rate_ci"] == newcombe(0, 3, 2, 3)
    signals = {x["name"]: x for x in s["signals"]}
    # the guarded arm is left out: 2 collapsed and 4 healthy runs
    assert s["runs_pooled"] == {"collapsed": 2, "healthy": 4}
    assert signals["repetition"]["median_lead_steps"] == 1 and signals["repetition"]["false_trip_rate"] == 0.0
    assert signals["reward_drop"]["median_lead_steps"] == 0  # the reward itself trips when it falls
    assert signals["kl_to_start"]["median_lead_steps"] == -1 and signals["kl_to_start"]["seen_2_ahead_frac"] == 0.0


def test_plot_draws_every_arm(tmp_path):
    from matplotlib.image import imread

    runs = {"grpo": {0: run_record(degenerating()), 1: run_record(healthy_run())}, "emapg": {0: run_record(healthy_run())}}
    img = imread(plot(runs, tmp_path / "stability.png", "synthetic"))
    assert img.shape[0] > 300 and img.shape[1] > 300


@pytest.mark.slow
def test_quick_mode_runs_to_the_end_and_writes_the_contract_keys(tmp_path):
    """The whole benchmark on tiny-qwen2 (5 arms x 2 seeds x 3 steps, the toy task): it must not fail at its end,
    where the report is put together, after hours of default-mode training."""
    import os
    import subprocess
    import sys

    from emapg.paths import REPO_ROOT

    out = tmp_path / "stability.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "studies" / "stability.py"), "--quick", "--out", str(out),
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert isinstance(report["collapse_definition"], str) and report["stress"] == {
        "lr": 1e-3, "beta": 0.001, "steps": 3, "chosen_by": "argument"}
    for arm in CONTRACT_ARMS:
        r = report[arm]
        assert r["seeds"] == [0, 1] and 0.0 <= r["collapse_rate"] <= 1.0
        assert len(r["collapse_rate_ci"]) == 2 and r["collapse_rate_ci"][0] <= r["collapse_rate"] <= r["collapse_rate_ci"][1]
    assert {s["name"] for s in report["signals"]} >= {"repetition", "gibberish", "length_drift", "kl_to_start", "reward_drop"}
    for s in report["signals"]:
        assert {"name", "median_lead_steps", "false_trip_rate"} <= set(s)
    run = report["toy"]["runs"]["emapg"]["0"]
    assert len(run["reward"]) == 3 and all(x is not None for x in run["kl_to_start"])
    assert out.with_suffix(".png").is_file()
    assert report["provenance"]["allowed_by"] == "quick"  # the harness: a smoke run may start from a dirty tree


def write_run(folder, name: str, history: list[dict[str, float]]) -> None:
    d = folder / name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, **h}) + "\n" for i, h in enumerate(history, 1)))


def test_replayed_false_trips_of_a_run_folder(tmp_path, capsys):
    """--false-trips-from: every detector replayed over <arm>-seed<N>/metrics.jsonl; rates over the runs that did not
    collapse, the control arm apart, runs still in progress left out, missing series named."""
    from studies.stability import main, replay_false_trips

    base = {k: v for k, v in HEALTHY.items() if k != "kl/to_start"}  # like runs/learning_search: no kl/to_start
    healthy = [dict(base) for _ in range(8)]
    dip = [dict(base) for _ in range(8)]
    dip[5]["actor/entropy"] = 0.01  # < 0.25 x 2.0 and below the gate 0.02: entropy_collapse trips at step 6
    loops = [dict(base) for _ in range(8)]
    loops[6]["response/repeated_ngram_share"] = 0.6  # above the absolute limit 0.5: repetition at step 7
    write_run(tmp_path, "grpo-seed0", dip)
    write_run(tmp_path, "grpo-seed1", healthy)
    write_run(tmp_path, "emapg-seed0", healthy)
    write_run(tmp_path, "emapg-seed1", [*healthy[:3], *({**base, "reward/mean": 0.05} for _ in range(5))])  # collapses at 4
    write_run(tmp_path, "control-seed0", loops)
    write_run(tmp_path, "grpo-seed2", healthy[:3])  # still running
    (tmp_path / "start_greedy").mkdir()  # not a run
    r = replay_false_trips(tmp_path)
    assert r["steps"] == 8 and r["in_progress"] == {"grpo-seed2": 3}
    assert r["per_run"]["emapg-seed1"]["collapse_step"] == 4
    t = r["training_arms"]
    assert t["runs"] == ["emapg-seed0", "emapg-seed1", "grpo-seed0", "grpo-seed1"] and t["collapsed"] == ["emapg-seed1"]
    assert t["healthy_runs"] == 3
    sig = {s["name"]: s for s in t["signals"]}
    assert sig["entropy_collapse"]["false_trips"] == 1 and sig["entropy_collapse"]["false_trip_rate"] == 1 / 3
    assert sig["entropy_collapse"]["tripped"] == {"grpo-seed0": 6}
    assert sig["entropy_collapse"]["false_trip_rate_ci"] == wilson(1, 3)
    assert sig["repetition"]["false_trip_rate"] == 0.0 and sig["reward_drop"]["false_trip_rate"] == 0.0
    assert sig["kl_to_start"]["runs_with_series"] == 0 and sig["kl_to_start"]["false_trip_rate"] is None
    c = {s["name"]: s for s in r["control_arms"]["signals"]}
    assert r["control_arms"]["runs"] == ["control-seed0"] and c["repetition"]["tripped"] == {"control-seed0": 7}
    assert c["entropy_collapse"]["false_trip_rate"] == 0.0
    assert r["per_run"]["control-seed0"]["trip_values"]["repetition"] == 0.6
    assert "kl/to_start" in r["missing_series"] and "probe/flip_rate" in r["missing_series"]
    assert "actor/entropy" not in r["missing_series"]
    out = tmp_path / "ft.json"
    assert main(["--replay-only", "--false-trips-from", str(tmp_path), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["training_arms"]["healthy_runs"] == 3
    printed = capsys.readouterr().out
    assert "kl/to_start" in printed and "1/3 = 0.33" in printed


def test_report_only_applies_the_sweep_rule_to_finished_runs_and_lists_the_missing(tmp_path):
    """--report-only trains nothing: the stress point from the finished sweep runs (the first grid point with a
    collapsed sweep seed), the arms' finished runs summarised with the contract keys, the rest listed as not run."""
    from studies.stability import main, sweep_name

    collapsing, healthy = run_record(degenerating()), run_record(healthy_run())

    def put(name: str, record: dict) -> None:
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "history.json").write_text(json.dumps(record))

    put(sweep_name(1e-3, 0.1, 100), healthy)
    put(sweep_name(1e-3, 0.1, 101), healthy)
    put(sweep_name(1e-3, 0.001, 100), collapsing)
    put(sweep_name(1e-3, 0.001, 101), healthy)
    put("toy/grpo_seed0", collapsing)
    put("toy/grpo_seed1", healthy)
    put("toy/emapg_seed0", healthy)
    out = tmp_path / "stability.json"
    assert main(["--report-only", "--seeds", "2", "--smollm2-seeds", "0", "--steps", "12", "--work", str(tmp_path),
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["stress"] == {"lr": 1e-3, "beta": 0.001, "steps": 12, "chosen_by": "sweep (protocol grid)"}
    assert [p["grpo_collapsed"] for p in report["sweep"]] == [0, 1]
    assert report["grpo"]["seeds"] == [0, 1] and report["grpo"]["collapse_rate"] == 0.5
    assert report["emapg"]["seeds"] == [0] and report["ema_k3"]["seeds"] == [] and report["ema_k3"]["collapse_rate"] is None
    assert report["complete"] is False and "toy/emapg_seed1" in report["not_run"] and "toy/ema_k3_seed0" in report["not_run"]
    assert report["smollm2"].startswith("not run") and isinstance(report["collapse_definition"], str)
    assert {"name", "median_lead_steps", "false_trip_rate"} <= set(report["signals"][0])
    # an unfinished sweep point: no stress setting, nothing written
    (tmp_path / sweep_name(1e-3, 0.001, 100) / "history.json").unlink()
    assert main(["--report-only", "--seeds", "2", "--smollm2-seeds", "0", "--work", str(tmp_path),
                 "--out", str(tmp_path / "again.json")]) == 1
    assert not (tmp_path / "again.json").exists()
    # the report alone (its work folder lost) resumes: its runs, sweep and stress setting carry over; another stress is refused
    fresh = tmp_path / "fresh"
    assert main(["--report-only", "--seeds", "2", "--smollm2-seeds", "0", "--steps", "12", "--work", str(fresh),
                 "--out", str(fresh / "resumed.json"), "--resume-from", str(out)]) == 0
    resumed = json.loads((fresh / "resumed.json").read_text())
    assert resumed["stress"] == report["stress"] and resumed["sweep"] == report["sweep"]
    assert resumed["complete"] is False  # runs missing, and no SmolLM2 arm
    assert resumed["grpo"] == report["grpo"] and resumed["emapg"] == report["emapg"] and resumed["not_run"] == report["not_run"]
    with pytest.raises(SystemExit, match="not lr 0.01"):
        main(["--report-only", "--steps", "12", "--lr", "1e-2", "--beta", "0.001", "--work", str(tmp_path / "other"),
              "--out", str(tmp_path / "other.json"), "--resume-from", str(out)])


def put_sweep_run(work, lr: float, seed: int, record: dict) -> None:
    """A finished sweep run at beta 0.001 in ``work``, as the benchmark leaves it."""
    from studies.stability import sweep_name

    (work / sweep_name(lr, 0.001, seed)).mkdir(parents=True)
    (work / sweep_name(lr, 0.001, seed) / "history.json").write_text(json.dumps(record))


def test_the_slow_grid_sweeps_lower_rates_and_its_runs_are_checked_against_it(tmp_path):
    """Amendment 4's grid: lr 1e-4, 2e-4, 4e-4 at beta 0.001, lr ascending; the first with a collapsed sweep seed is the
    stress point. --sweep-runs accepts only runs of the grid it names."""
    from studies.stability import main, parse_sweep_runs

    for lr, record in ((1e-4, run_record(healthy_run())), (2e-4, run_record(degenerating()))):
        for seed in (100, 101):
            put_sweep_run(tmp_path, lr, seed, record)
    out = tmp_path / "slow.json"
    assert main(["--report-only", "--grid", "slow", "--seeds", "1", "--smollm2-seeds", "0", "--steps", "12",
                 "--work", str(tmp_path), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["stress"] == {"lr": 2e-4, "beta": 0.001, "steps": 12, "chosen_by": "sweep (slow grid)"}
    assert [p["lr"] for p in report["sweep"]] == [1e-4, 2e-4] and [p["grpo_collapsed"] for p in report["sweep"]] == [0, 2]
    assert parse_sweep_runs("4e-4:0.001:100,1e-4:0.001:101", "slow") == [(4e-4, 0.001, 100), (1e-4, 0.001, 101)]
    with pytest.raises(ValueError, match="not a run of the sweep grid"):
        parse_sweep_runs("1e-3:0.001:100", "slow")
    with pytest.raises(SystemExit):
        main(["--grid", "slow", "--sweep-runs", "1e-3:0.1:100", "--work", str(tmp_path)])


def test_the_late_grid_counts_only_a_collapse_after_a_learning_phase(tmp_path):
    """Amendment 6's grid: lr 4e-4, 6e-4 at beta 0.001; a sweep seed that collapses before step 12 does not make a
    stress point, one that collapses at step >= 12 does."""
    from studies.stability import LATE_MIN_COLLAPSE_STEP, main

    early, late = run_record(degenerating(20, start=6)), run_record(degenerating(20, start=14))
    assert early["collapse_step"] == 8 < LATE_MIN_COLLAPSE_STEP <= late["collapse_step"] == 16
    for lr, seed, record in ((4e-4, 100, early), (4e-4, 101, run_record(healthy_run(20))), (6e-4, 100, late),
                             (6e-4, 101, early)):
        put_sweep_run(tmp_path, lr, seed, record)
    out = tmp_path / "late.json"
    assert main(["--report-only", "--grid", "late", "--seeds", "1", "--smollm2-seeds", "0", "--steps", "20",
                 "--work", str(tmp_path), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["stress"] == {"lr": 6e-4, "beta": 0.001, "steps": 20, "chosen_by": "sweep (late grid)"}
    assert [p["grpo_collapsed"] for p in report["sweep"]] == [0, 1]
    assert [p["collapse_steps"] for p in report["sweep"]] == [[8, None], [16, 8]]


def test_heldout_change_pools_seeds_per_question_and_compares_with_grpo():
    from studies.stability import heldout_change

    starter = {"greedy_em": {"nq/1": 0.0, "nq/2": 1.0}, "sampled_em": {"nq/1": 0.5, "nq/2": 0.5}}

    def run(greedy: list[float], sampled: list[float]) -> dict:
        return {"heldout": {"greedy_em": dict(zip(["nq/1", "nq/2"], greedy)), "sampled_em": dict(zip(["nq/1", "nq/2"], sampled))}}

    runs = {"grpo": {0: run([1.0, 1.0], [0.5, 0.5]), 1: run([0.0, 1.0], [0.0, 0.5])},
            "emapg": {0: run([0.0, 0.0], [1.0, 1.0])}}
    h = heldout_change(starter, runs)
    assert h["questions"] == 2 and h["start"] == {"greedy_em": 50.0, "sampled_em": 50.0}
    g = h["grpo"]
    assert g["seeds"] == [0, 1] and g["greedy_em_end"] == 75.0 and g["sampled_em_end"] == 37.5
    assert g["greedy_em_end_minus_start"]["mean"] == pytest.approx(25.0)
    assert g["sampled_em_end_minus_start"]["mean"] == pytest.approx(-12.5)
    assert g["greedy_em_end_minus_start_per_seed"][0]["mean"] == pytest.approx(50.0)
    assert "greedy_em_minus_grpo" not in g
    e = h["emapg"]  # against GRPO on the seeds both finished (seed 0): greedy 0 vs 100, sampled 100 vs 50
    assert e["greedy_em_minus_grpo"]["mean"] == pytest.approx(-100.0) and e["greedy_em_minus_grpo"]["seeds"] == [0]
    assert e["sampled_em_minus_grpo"]["mean"] == pytest.approx(50.0)


@pytest.mark.slow
def test_smollm2_arms_quick_score_every_end_checkpoint_against_the_starter(tmp_path):
    """--smollm2-only --quick: the SmolLM2 code path (shared engine server, training through it, reader-slice scoring
    greedy and sampled) on tiny-qwen2; then --report-only rebuilds the same estimates from the work folder."""
    import os
    import subprocess
    import sys

    from emapg.paths import REPO_ROOT

    work, out, again = tmp_path / "work", tmp_path / "smol.json", tmp_path / "again.json"
    cmd = [sys.executable, str(REPO_ROOT / "studies" / "stability.py"), "--smollm2-only", "--quick", "--work", str(work)]
    proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())["smollm2"]
    assert s["complete"] and s["stress"]["beta"] == 1.0 and s["policy"] == "tiny-qwen2"
    questions = s["heldout"]["questions"]
    assert questions >= 5  # the reader slice, one question per QA set at most
    for arm in ("grpo", "emapg"):
        run = s["runs"][arm]["0"]
        assert len(run["reward"]) == 2 and set(run["heldout"]) == {"greedy_em", "sampled_em"}
        assert len(run["heldout"]["greedy_em"]) == questions
        assert not (work / "smollm2" / f"{arm}_seed0" / "run" / "step_2").exists()  # scored, then removed
        h = s["heldout"][arm]
        assert {"greedy_em_end", "sampled_em_end", "greedy_em_end_minus_start", "sampled_em_end_minus_start"} <= set(h)
        assert 0.0 <= s[arm]["collapse_rate"] <= 1.0
    assert s["heldout"]["emapg"]["greedy_em_minus_grpo"]["seeds"] == [0]
    proc = subprocess.run([*cmd, "--report-only", "--out", str(again)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(again.read_text())["smollm2"]["heldout"] == s["heldout"]


@pytest.mark.slow
def test_collapse_anatomy_quick_dissects_a_run_and_its_guarded_twin(tmp_path):
    """studies/collapse_anatomy.py --quick (8 steps; the last step stands in for the collapse): the runs keep every
    checkpoint, the anchors are the run's own correct trajectories, and the token series, the breaking update and
    the guarded run are reported."""
    import os
    import subprocess
    import sys

    from emapg.paths import REPO_ROOT

    out = tmp_path / "anatomy.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "studies" / "collapse_anatomy.py"), "--quick", "--work",
                           str(tmp_path / "work"), "--out", str(out)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["quick"] and r["settings"]["steps"] == 8 and r["anchors"] >= 1 and r["flipped_token"]["anchor_positions"] >= 1
    assert isinstance(r["reproduced_stability_late"], bool)  # reported; bit-equal only on the recording's kind of CPU
    token = r["collapsed"]["token"]
    assert [x["step"] for x in token] == list(range(1, 9)) and all(x["logprob"] <= 0 for x in token)
    assert token[0]["update_norm"] is None and all(x["update_norm"] > 0 for x in token[1:])
    b = r["collapsed"]["breaking_update"]
    assert (b["from_step"], b["to_step"]) == (r["collapse_step"] - 2, r["collapse_step"] - 1)
    assert b["actual_change"] == pytest.approx(token[b["to_step"] - 1]["logprob"] - token[b["from_step"] - 1]["logprob"], abs=1e-5)
    assert len(r["guarded"]["reward"]) == 8 and isinstance(r["guarded"]["rollbacks"], list)
