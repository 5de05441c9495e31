"""The documentation site (mkdocs.yml, docs/): it builds with ``mkdocs build --strict`` (no broken link, anchor or nav
entry), and its measured-performance tables are the ones ``scripts/gen_performance.py`` generates from
``benchmarks/results/*.json`` (a page that disagrees with the JSON fails)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _gen():
    spec = importlib.util.spec_from_file_location("gen_performance", REPO / "scripts" / "gen_performance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="needs mkdocs-material (requirements/cpu.txt)")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for page in ("tour", "retriever", "agent-formats", "training", "evaluation", "configuration", "performance", "learning",
                 "troubleshooting"):
        assert (tmp_path / "site" / f"{page}.html").is_file(), page
    # opened from disk, a link lands on a page, not on a folder listing: every internal link names an .html file
    index = (tmp_path / "site" / "index.html").read_text()
    assert 'href="tour.html"' in index and 'href="own-data.html"' in index and 'href="tour/"' not in index


def test_a_broken_link_fails_the_build(tmp_path):
    """The strict build is a real check: a copy of the site with one broken link does not build."""
    pytest.importorskip("mkdocs", reason="needs mkdocs-material (requirements/cpu.txt)")
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "tour.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode != 0 and "no-such-page.md" in proc.stdout + proc.stderr


def test_the_performance_tables_are_the_json():
    gen = _gen()
    assert gen.stale() == [], "run python scripts/gen_performance.py"
    page = (REPO / "docs" / "performance.md").read_text()
    assert "`kl_memory_full.json` `full_over_topk_peak_memory_ratio`" in page
    assert all(f"`{p.name}`" in page for p in (REPO / "benchmarks" / "results").glob("*.json"))


def test_a_page_that_disagrees_with_the_json_is_found(tmp_path):
    gen = _gen()
    results = tmp_path / "results"
    shutil.copytree(REPO / "benchmarks" / "results", results, ignore=shutil.ignore_patterns("*.png", "*.md"))
    page = tmp_path / "performance.md"
    page.write_text((REPO / "docs" / "performance.md").read_text())
    assert gen.stale((page,), results) == []
    data = json.loads((results / "rollout_throughput.json").read_text())
    data["vllm_over_hf_tokens_per_s_ratio"] = 9.99  # a rerun of the benchmark, the page not regenerated
    (results / "rollout_throughput.json").write_text(json.dumps(data))
    assert gen.stale((page,), results) == [str(page)]
    page.write_text(gen.render(page.read_text(), results))
    # the headline table and the benchmark's row (a bound figure) both follow the JSON
    assert page.read_text().count("**<!--@rollout_throughput:vllm_over_hf_tokens_per_s_ratio-->9.99×**") == 2
    assert gen.stale((page,), results) == []


def _index():
    spec = importlib.util.spec_from_file_location("gen_benchmarks_index", REPO / "scripts" / "gen_benchmarks_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmarks_index_is_current():
    """benchmarks/INDEX.md is what scripts/gen_benchmarks_index.py writes: every performance suite and study, its results
    and latest figure, and the trainer internals each still imports."""
    gen = _index()
    text = (REPO / "benchmarks" / "INDEX.md").read_text()
    assert text == gen.render(), "run python scripts/gen_benchmarks_index.py"
    for folder in ("benchmarks", "studies"):
        for script in gen.scripts(folder):
            assert f"[`{script.name}`](../{folder}/{script.name})" in text
    assert "harness.py" not in text.split("## Pre-registered studies")[1].split("## Trainer")[0]
    assert "`emapg.reader_sampled_end_minus_start.mean` 5.52" in text  # learning_search.json's headline


def test_the_index_follows_the_json_and_names_internals(tmp_path):
    gen = _index()
    results = tmp_path / "results"
    shutil.copytree(REPO / "benchmarks" / "results", results, ignore=shutil.ignore_patterns("*.png", "*.md"))
    data = json.loads((results / "kl_memory.json").read_text())
    data["full_over_topk_peak_memory_ratio"] = 77.7  # a rerun, the index not regenerated
    (results / "kl_memory.json").write_text(json.dumps(data))
    assert "`full_over_topk_peak_memory_ratio` 77.7" in gen.render(results)
    script = tmp_path / "probe.py"
    script.write_text("def f():\n    from trainer.batch import trajectory_batch\n    from trainer.config import TrainConfig\n"
                      "    from trainer import distributed as D\n")
    assert gen.trainer_imports(script) == [("trainer.batch", "trajectory_batch"), ("trainer.config", "TrainConfig"),
                                           ("trainer.distributed", "distributed")]
    assert [m for m, _ in gen.trainer_imports(script) if not gen.is_public(m)] == ["trainer.batch", "trainer.distributed"]


def test_the_learning_result_is_the_json_on_every_page_that_quotes_it():
    """README, learning.md and performance.md show one table generated from learning_search.json (issue #54: no page
    may report another run's numbers as the current result)."""
    gen = _gen()
    table = gen.learning_table()
    data = json.loads((REPO / "benchmarks" / "results" / "learning_search.json").read_text())
    assert f"{data['emapg']['reader_sampled_em_end']:.1f}" in table and f"{data['control']['reader_sampled_em_start']:.1f}" in table
    for page in ("README.md", "docs/learning.md", "docs/performance.md"):
        assert table in (REPO / page).read_text(), page
    assert "(current protocol)" not in (REPO / "docs" / "performance.md").read_text()


def test_no_page_tells_mkdocs_serve_to_take_the_retrievers_port():
    for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for line in page.read_text().splitlines():
            assert not ("mkdocs serve" in line and "8000" in line and "not 8000" not in line and "not port 8000" not in line), (page, line)
