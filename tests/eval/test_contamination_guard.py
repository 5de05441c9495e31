"""The contamination guard end to end: a real 1-step ``emapg train`` (tiny math preset) records what it trained on
beside its weights; ``emapg eval`` of that checkpoint refuses a trained-on question, scores it apart with
``--score-trained-apart`` (and says so), and runs normally on untouched questions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from app.cli import main as emapg_main
from emapg.errors import UserError
from emapg.paths import CONFIG_DIR
from eval.contamination import check_contamination
from eval.learning import compare_learning
from eval.report import contamination_line
from tasks.contamination import TRAINED_QUESTIONS, TrainedQuestions, read_trained_questions
from tasks.datasets import load_dataset

TRAIN_LIMIT = 6
INHERITED = "An inherited warm-start problem: what is 6 times 7?"


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_model_dir) -> Path:
    """One EMA-PG step on 6 MATH train problems, from a policy folder that carries its own (SFT) record."""
    root = tmp_path_factory.mktemp("guard")
    initial = root / "initial"
    shutil.copytree(tiny_model_dir, initial)
    TrainedQuestions.from_questions({"sft": [INHERITED]}).write(initial)
    run = root / "run"
    rc = emapg_main(["train", "--config", str(CONFIG_DIR / "math_tiny_cpu.yaml"), f"run.output_dir={run}",
                     f"model.policy={initial}", "run.total_steps=1", "run.save_every=1", f"data.limit={TRAIN_LIMIT}",
                     "data.prompts_per_step=2", "rollout.n_samples=2", "algorithm.mini_batch_size=4",
                     "algorithm.micro_batch_size=4", "rollout.max_tokens_per_turn=8", "rollout.max_response_tokens=8",
                     "logging.progress=false", "logging.tensorboard=false"])
    assert rc == 0
    return run


def _train_problems() -> list:
    return load_dataset("math", split="train", limit=TRAIN_LIMIT, seed=0)  # what the run trained on (run.seed 0)


def _write_set(path: Path, problems: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"problem": q, "answer": a}) + "\n" for q, a in problems))
    return path


def _eval(model: Path, data: Path, out: Path, *extra: str) -> int:
    return emapg_main(["eval", "--model", str(model), "--suite", "math", "--protocol", "math_quick", "--n", "1",
                       "--max-tokens", "8", "--datasets", "mix", "--data-path", f"mix={data}", "--engine", "hf",
                       "--grader-workers", "1", "--batch-size", "4", "--no-progress", "--out", str(out), *extra])


def test_the_checkpoint_records_every_trainable_and_inherited_question(trained_run):
    step = trained_run / "step_1"
    record = read_trained_questions(step / "policy")
    assert (step / TRAINED_QUESTIONS).read_text() == (step / "policy" / TRAINED_QUESTIONS).read_text()
    assert all(record.contains(ex.question) for ex in _train_problems()) and record.contains(INHERITED)
    assert record.count == TRAIN_LIMIT + 1
    assert [s["source"] for s in record.sources] == ["math (train)", "sft"]
    manifest = json.loads((step / "manifest.json").read_text())["files"]
    assert TRAINED_QUESTIONS in manifest and f"policy/{TRAINED_QUESTIONS}" in manifest  # verified like the weights
    state = json.loads((step / "trainer_state.json").read_text())
    assert state["provenance"]["trained_questions"] == {"count": record.count, "digest": record.digest}


def test_eval_refuses_a_trained_question_scores_it_apart_on_request_and_runs_on_unseen_ones(trained_run, tmp_path, capsys,
                                                                                             tiny_model_dir):
    trained = _train_problems()[:2]
    unseen = load_dataset("math500", limit=2, seed=0)
    # one trained problem as written, one re-cased and re-spaced: the identity is the normalised text
    mixed = _write_set(tmp_path / "mixed.jsonl", [(trained[0].question, trained[0].answers[0]),
                                                  (f"  {trained[1].question.upper()} ", trained[1].answers[0]),
                                                  *[(ex.question, ex.answers[0]) for ex in unseen]])
    out = tmp_path / "refused"
    assert _eval(trained_run, mixed, out) == 2
    err = capsys.readouterr().err
    assert "refusing to score 2 question(s)" in err and "mix: 2 of 4" in err and "--score-trained-apart" in err
    assert not out.exists()  # nothing written

    apart = tmp_path / "apart"
    assert _eval(trained_run, mixed, apart, "--score-trained-apart") == 0
    assert "scored apart" in capsys.readouterr().out
    results = json.loads((apart / "results.json").read_text())
    record = read_trained_questions(trained_run / "step_1" / "policy")
    items = [json.loads(x) for x in (apart / "items" / "mix.jsonl").read_text().splitlines()]
    assert results["contamination"] == {"checked": True, "unchecked_because": None, "excluded": {"mix": 2},
                                        "trained_questions_count": record.count,
                                        "trained_questions_digest": record.digest,
                                        "excluded_ids": {"mix": sorted(r["id"] for r in items[:2])},
                                        "trained_questions_file": str(trained_run / "step_1" / "policy" / TRAINED_QUESTIONS)}
    assert results["datasets"]["mix"]["n_items"] == 2 and results["trained_on"]["mix"]["n_items"] == 2
    assert results["average"]["pass@1"] == results["datasets"]["mix"]["pass@1"]  # the average is over unseen ones
    assert len((apart / "items" / "mix.jsonl").read_text().splitlines()) == 4
    report = (apart / "report.md").read_text()
    assert "2 question(s) here were trained on" in report and "## Questions the model was trained on (scored apart)" in report

    # next to the initial model on the same questions: a paired comparison leaves the trained-on ones out, and
    # `eval compare` refuses to set the two runs' metrics side by side (they cover different questions)
    base = tmp_path / "base"
    assert _eval(tiny_model_dir, mixed, base) == 0
    assert compare_learning(base, apart, ["mix"], metric="accuracy")["pooled"]["n"] == 2
    capsys.readouterr()
    assert emapg_main(["eval", "compare", str(base), str(apart), "--out", str(tmp_path / "cmp"), "--no-paper"]) == 2
    assert "trained_on_excluded" in capsys.readouterr().err

    clean = _write_set(tmp_path / "unseen.jsonl", [(ex.question, ex.answers[0]) for ex in unseen])
    assert _eval(trained_run, clean, tmp_path / "unseen") == 0
    results = json.loads((tmp_path / "unseen" / "results.json").read_text())
    assert results["contamination"]["checked"] and results["contamination"]["excluded"] == {} and "trained_on" not in results
    assert results["datasets"]["mix"]["n_items"] == 2
    assert "no question here is one the model was trained on" in (tmp_path / "unseen" / "report.md").read_text()
    capsys.readouterr()
    # the flag is a run setting: a resumed run may not switch it
    assert _eval(trained_run, clean, tmp_path / "unseen", "--score-trained-apart") == 2
    assert "score_trained_apart" in capsys.readouterr().err


def test_models_without_a_record_are_unchecked_and_a_damaged_record_is_refused(tmp_path, tiny_model_dir, capsys):
    examples = {"math500": load_dataset("math500", limit=2, seed=0)}
    no_record = check_contamination(str(tiny_model_dir), examples, score_apart=False, model_label="x").summary()
    assert no_record == {"checked": False, "unchecked_because": no_record["unchecked_because"], "trained_questions_file": None,
                         "trained_questions_count": None, "trained_questions_digest": None, "excluded": {}, "excluded_ids": {}}
    assert "folder has no trained_questions.json" in no_record["unchecked_because"]
    assert "folder has no trained_questions.json" in contamination_line({"contamination": no_record})
    # a model that is no local folder (a hub name, or a name only the engine knows; eval.runner._model_path None) is
    # not blamed on a missing file
    for path in (None, "org/some-hub-model"):
        hub = check_contamination(path, examples, score_apart=False, model_label="org/some-hub-model").summary()
        assert not hub["checked"] and "org/some-hub-model is not a local folder" in hub["unchecked_because"]
        assert "not a local folder" in contamination_line({"contamination": hub})
        assert "trained_questions.json (a model" not in contamination_line({"contamination": hub})
    everything = TrainedQuestions.from_questions({"x": [ex.question for ex in examples["math500"]]})
    everything.write(tmp_path)
    with pytest.raises(UserError, match="nothing unseen is left to score"):
        check_contamination(str(tmp_path), examples, score_apart=True, model_label="x")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / TRAINED_QUESTIONS).write_text('{"version": 1}')
    data = _write_set(tmp_path / "q.jsonl", [(ex.question, ex.answers[0]) for ex in examples["math500"]])
    assert _eval(tmp_path / "model", data, tmp_path / "out") == 2
    assert f"{tmp_path / 'model' / TRAINED_QUESTIONS}: not a valid trained-questions record" in capsys.readouterr().err
