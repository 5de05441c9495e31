"""Report tables and plots from results dicts (the runner's own output is covered end to end)."""

import json

import pytest

from eval.report import comparison_table, compare_runs, plot_bars, plot_passk, results_table


def _results(name, values, suite="qa", n=1):
    metric = "em" if suite == "qa" else "pass@1"
    datasets = {d: {"n_items": 10, metric: v, "searches": 1.5} for d, v in values.items()}
    if suite == "math":
        for d, v in values.items():
            datasets[d].update({"pass@2": min(1.0, 1.5 * v), "timeouts": 1})
    names = [metric, "searches"] + (["pass@2", "timeouts"] if suite == "math" else [])
    return {
        "name": name, "model": "m", "suite": suite, "engine": "hf", "grader": "math_verify",
        "protocol": {"name": "p", "n": n, "temperature": 0.0, "top_p": 1.0, "max_tokens": 8, "seed": 0,
                     "max_turns": 4, "retrieval_topk": 3, "grade_timeout": 5.0},
        "timestamp": "t", "primary_metric": metric, "metric_names": names, "datasets": datasets,
        "average": {m: sum(v[m] for v in datasets.values()) / len(datasets) for m in names},
    }  # fmt: skip


def test_results_table_percent_and_counts():
    table = results_table(_results("a", {"nq": 0.25, "hotpotqa": 0.5}))
    assert "| dataset | n | em (%) | searches |" in table
    assert "| nq | 10 | 25.0 | 1.50 |" in table
    assert "| **average** | 20 | **37.5** | **1.50** |" in table


def test_comparison_table_and_mismatched_datasets():
    a = _results("a", {"nq": 0.1, "bamboogle": 0.2})
    b = _results("a", {"nq": 0.3})  # same label, fewer datasets
    table = comparison_table([a, b], "em")
    assert "| dataset | a | a#2 |" in table
    assert "| bamboogle | 20.0 | – |" in table
    # an average over different datasets would not compare: shown only for complete runs
    assert "| **average** | **15.0** | – |" in table


def test_compare_runs_writes_everything(tmp_path):
    dirs = []
    for name, vals in (("grpo", {"olympiadbench": 0.4, "math500": 0.6}), ("ema", {"olympiadbench": 0.5, "math500": 0.7})):
        d = tmp_path / name
        d.mkdir()
        (d / "results.json").write_text(json.dumps(_results(name, vals, suite="math", n=2)))
        dirs.append(d)
    data = compare_runs(dirs, tmp_path / "cmp")
    report = (tmp_path / "cmp" / "report.md").read_text()
    assert "| olympiadbench | 40.0 | 50.0 |" in report and "| olympiadbench | 50.8 | 53.9 |" in report  # ours, then the paper's apart
    assert report.index("| olympiadbench | 40.0 | 50.0 |") < report.index("another model, another scale") < report.index("| olympiadbench | 50.8 |")
    assert "DeepSeek-R1-Distill-Qwen-1.5B" in report
    assert data["metric"] == "pass@1" and [r["label"] for r in data["runs"]] == ["grpo", "ema"]
    for png in ("pass_at_1.png", "pass_at_k.png"):
        assert (tmp_path / "cmp" / png).read_bytes().startswith(b"\x89PNG")
    no_paper = compare_runs(dirs, tmp_path / "cmp2", with_paper=False)
    assert no_paper["paper_reference"] is None
    assert "paper" not in (tmp_path / "cmp2" / "report.md").read_text()


def test_compare_refuses_mixed_suites(tmp_path):
    from emapg.errors import UserError

    for name, suite in (("q", "qa"), ("m", "math")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(_results(name, {"x": 0.1}, suite=suite)))
    with pytest.raises(UserError, match="different suites"):
        compare_runs([tmp_path / "q", tmp_path / "m"], tmp_path / "out")


def test_plots_skip_when_nothing_to_draw(tmp_path):
    qa = _results("a", {"nq": 0.1})
    assert plot_passk([qa], tmp_path / "k.png") is None  # no pass@k beyond k=1 in a QA run
    assert plot_bars([qa], "em", tmp_path / "b.png").read_bytes().startswith(b"\x89PNG")


def test_learning_figure_is_800_px_with_both_protocols(tmp_path):
    """em.png of the demo: starter vs trained per dataset and pooled, greedy beside sampled, with n and intervals."""
    from matplotlib.image import imread

    from eval.report import plot_learning

    def block(n, base, trained):
        return {"n": n, "base": base, "trained": trained,
                "difference": {"mean": trained - base, "low": trained - base - 3, "high": trained - base + 3, "confidence": 0.95}}

    comp = {"datasets": {"nq": block(2, 50.0, 100.0), "bamboogle": block(2, 0.0, 0.0)}, "pooled": block(4, 25.0, 50.0)}
    img = imread(plot_learning({"greedy EM": comp, "sampled mean@2 EM": comp}, tmp_path / "em.png"))
    assert img.shape[1] == 800
