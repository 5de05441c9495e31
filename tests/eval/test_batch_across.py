"""eval.batch_across_datasets: batches over all datasets in order, resumable, same greedy results."""

from __future__ import annotations

from dataclasses import replace

import pytest

from emapg.errors import UserError
from eval.protocols import get_protocol
from emapg.jsonl import read_jsonl_repairing as read_items
from eval.runner import EvalConfig, run_eval


def _cfg(model, out, **kw) -> EvalConfig:
    base = dict(model=str(model), out=str(out), protocol=get_protocol("math_quick", n=2, max_tokens=12),
                datasets=["aime2024", "amc"], limit=3, engine="hf", batch_size=4, progress=False, grader_workers=1,
                batch_across_datasets=True)
    return EvalConfig(**{**base, **kw})


def _responses(out, ds):
    return [[s["response"] for s in r["samples"]] for r in read_items(out / "items" / f"{ds}.jsonl")]


def test_batches_span_datasets_and_resume_to_the_clean_result(tmp_path, tiny_model_dir):
    calls: list[tuple[str, int]] = []
    clean = run_eval(_cfg(tiny_model_dir, tmp_path / "clean"), on_batch=lambda ds, n: calls.append((ds, n)))
    # 6 questions in batches of 4: [aime x3, amc x1], [amc x2]
    assert calls == [("aime2024", 3), ("amc", 1), ("amc", 3)]

    out = tmp_path / "resumed"

    def stop_after_first_batch(ds, n):
        if ds == "amc":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_eval(_cfg(tiny_model_dir, out), on_batch=stop_after_first_batch)
    assert len(read_items(out / "items" / "aime2024.jsonl")) == 3 and len(read_items(out / "items" / "amc.jsonl")) == 1
    calls.clear()
    resumed = run_eval(_cfg(tiny_model_dir, out), on_batch=lambda ds, n: calls.append((ds, n)))
    assert calls == [("amc", 3)]  # only the second batch ran, with its own seed: sampled results equal the clean run
    for ds in ("aime2024", "amc"):
        assert _responses(out, ds) == _responses(tmp_path / "clean", ds)
    assert resumed["datasets"] == clean["datasets"]
    # per-dataset batching is another fingerprint: a resume with it is refused
    with pytest.raises(UserError, match="batch_across_datasets"):
        run_eval(_cfg(tiny_model_dir, out, batch_across_datasets=False))


def test_greedy_results_do_not_depend_on_the_batching(tmp_path, tiny_model_dir):
    greedy = get_protocol("math_quick", n=1, max_tokens=12, temperature=0.0)
    across = run_eval(_cfg(tiny_model_dir, tmp_path / "across", protocol=greedy))
    per_ds = run_eval(_cfg(tiny_model_dir, tmp_path / "per", protocol=greedy, batch_across_datasets=False, batch_size=2))
    for ds in ("aime2024", "amc"):
        assert _responses(tmp_path / "across", ds) == _responses(tmp_path / "per", ds)
    assert across["datasets"] == per_ds["datasets"]
