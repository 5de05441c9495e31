"""The evaluation runner: a model, a suite of datasets, a protocol -> per-item JSONL, results, report.

Evaluation goes through the training stack itself (``provision.engines.build_engine`` and
``agent.rollout.run_rollouts``), so a score means what the training reward means: QA is
the Search-R1 multi-turn loop against a real retrieval server, math is one turn; both are scored by the
task's own graders (:class:`tasks.task.Task`, the training rewards' functions) on the text the model
generated (:mod:`eval.scoring`). The per-item files are :mod:`eval.items`.

Layout of ``out_dir``::

    run.json               settings of the run and the index fingerprint (both checked on resume)
    retrievals.jsonl       every distinct (query, top-k) searched and the passages returned (eval.replay)
    items/<dataset>.jsonl  one line per question: prompt, full trajectory text, prediction,
                           golds, scores, searches, turns (all samples when n > 1)
    results.json           per-dataset metrics, unweighted average, model, protocol, grader, time,
                           index ``fingerprint`` and ``protocol_card`` (eval.provenance), ``contamination``
                           (eval.contamination) and, with ``--score-trained-apart``, ``trained_on``
    report.md, *.png       the table and plots (eval.report)

Resume: questions are processed in fixed batches (batch b of a dataset is always the same
questions, in the same order, with a seed derived from the protocol seed, the dataset and
b), and a batch's lines are appended in one write once the batch is finished. A rerun with
the same settings skips questions already in ``items/``; because batches are fixed, a
resumed run produces the same samples as an uninterrupted one (also at T > 0). A torn last
line (killed mid-write) is dropped and its question redone.
"""

from __future__ import annotations

import hashlib
import sys
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from agent.engines import EngineKind, check_engine_urls
from emapg.errors import UserError
from emapg.console import echo
from emapg.config import ConfigError, option
from emapg.jsonl import append_jsonl
from eval.contamination import check_contamination
from eval.items import ITEMS_DIR, append_items, ordered, read_items
from eval.protocols import EvalProtocol, protocol_dict
from eval.provenance import eval_protocol_card
from eval.scoring import notes, score_items
from tasks.task import Grading, get_task


RUN_FILE = "run.json"


@dataclass
class EvalConfig:
    """What to evaluate and where the results go (``emapg eval``)."""

    model: str = option(help="checkpoint folder, alias (tiny-qwen2, smollm2-135m-instruct) or hub name")
    out: str = option(help="output folder (created; a rerun resumes)")
    protocol: EvalProtocol = option(default_factory=EvalProtocol, help="sampling and scoring settings")
    datasets: list[str] = option(default_factory=list, help="dataset names, space- or comma-separated, e.g. nq,hotpotqa,bamboogle (default: every dataset of the suite)")
    data_paths: dict[str, str] = option(default_factory=dict, help="NAME=FILE: use FILE (jsonl/json/parquet; FlashRAG or Search-R1 layout) for dataset NAME; repeatable")
    limit: int | None = option(None, help="questions per dataset (a deterministic, seeded sample); None: all")
    data_seed: int = option(0, help="seed of the --limit sample")
    slice: Literal["none", "reader", "search"] = option(
        "none", help="qa: evaluate only a recorded slice of held-out questions: reader = the held-out questions whose gold "
        "answer the shipped starter was shown in its greedy evaluation (data/qa/reader_slice.json, eval.reader_slice; "
        "where small-compute RL shows first); search = held-out multi-hop questions whose first search (the question text) "
        "does not show the gold and a second search can (data/qa/search_slice.json, tasks.multihop; HotpotQA, the default "
        "datasets then); with --limit, a seeded sample (--data-seed) of at most that many slice questions per dataset")
    name: str | None = option(None, help="run label in reports (default: the output folder's name)")
    engine: EngineKind = option(
        "vllm", help="generation engine: vllm (falls back to hf, transformers, when vLLM is missing), hf, or remote "
        "(running `emapg engine serve` servers at engine_urls, given --model's weights first)")
    engine_urls: list[str] = option(
        default_factory=list, help="remote: base URLs of running generation servers started with a model of --model's "
        "architecture; the run loads --model's weights into them before generating, so they serve exactly --model "
        "(the CLI reads their API key from EMAPG_ENGINE_API_KEY)")
    engine_api_key: str | None = option(None, help="remote: API key of the generation servers, if they need one (the CLI reads EMAPG_ENGINE_API_KEY)")
    engine_wait: float = option(60.0, ge=0, help="remote: seconds to wait at start-up for the servers' /health (they may still be loading)")
    batch_size: int = option(32, help="questions per rollout batch (each batch is one resumable unit)")
    batch_across_datasets: bool = option(
        False, help="form the rollout batches over all datasets in order instead of within each: fewer, fuller batches "
        "when the datasets are smaller than --batch-size (vLLM generates a batch together); seeds are then per batch of "
        "the whole run, so sampled (not greedy) results differ from per-dataset batching")
    retriever_url: str | None = option(None, help="qa: URL of a running retrieval server (emapg serve)")
    index: str | None = option(None, help="qa: index folder to serve for this run when no retriever URL is given (default: the bundled Wikipedia index, built on first use)")
    retriever_api_key: str | None = option(None, help="qa: API key of the retrieval server, if it needs one (the CLI reads EMAPG_RETRIEVER_API_KEY)")
    retriever_timeout: float = option(30.0, gt=0, help="qa: seconds per retrieval request")
    retriever_retries: int = option(5, help="qa: retries per retrieval request before the search counts as failed")
    retriever_batch_invariant: bool = option(
        False, help="qa: a query's passages never depend on the queries served beside it: the server launched on --index "
        "runs `emapg serve --batch-invariant`; a --retriever-url server must say so in /health")
    replay: str | None = option(None, help="qa: answer searches from the retrievals recorded in this earlier eval run's folder "
                                "(its retrievals.jsonl) instead of a server; a query it did not record is an error, unless "
                                "--retriever-url or --index is also given, which then answers it live")
    rollout_mode: Literal["batched", "async"] = option("batched", help="rollout driver (see agent.rollout)")
    grader_workers: int = option(2, help="math: grading worker processes")
    score_trained_apart: bool = option(
        False, help="when the model's folder lists questions it was trained on (trained_questions.json, written by emapg "
        "train and emapg sft) and some are in this run: evaluate them but keep them out of the per-dataset metrics and "
        "averages, reported apart (results.json `trained_on`, report.md), instead of refusing to run")
    progress: bool = option(True, help="show progress: a bar on a terminal, a line every 10 s when the output is not a terminal")

    def __post_init__(self) -> None:
        # Dataset names never contain commas ("hf:org/name:config@split" included), so "a,b" is two names.
        self.datasets = [d.strip() for item in self.datasets for d in str(item).split(",") if d.strip()]

    def validate(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit must be >= 1, got {self.limit}")
        if self.slice != "none" and self.data_paths:
            raise ConfigError(f"slice={self.slice} picks its own questions of the bundled held-out split; drop data_paths")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.grader_workers < 1:
            raise ConfigError(f"grader_workers must be >= 1, got {self.grader_workers}")
        if self.retriever_retries < 0:
            raise ConfigError("retriever_retries must be >= 0")
        check_engine_urls(self.engine, self.engine_urls, engine_key="engine", urls_key="engine_urls")


# --------------------------------------------------------------------------- batches


def _batch_seed(seed: int, dataset: str, batch_index: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{dataset}/{batch_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


# --------------------------------------------------------------------------- setup helpers


def _fingerprint(cfg: EvalConfig, engine_kind: str) -> dict[str, Any]:
    """Settings that must match for a rerun to resume (labels and progress may change)."""
    return {
        "model": cfg.model,
        "suite": cfg.protocol.suite,
        "engine": engine_kind,
        "protocol": protocol_dict(cfg.protocol),
        "limit": cfg.limit,
        "data_seed": cfg.data_seed,
        "data_paths": dict(cfg.data_paths),
        "slice": cfg.slice,
        "batch_size": cfg.batch_size,
        "rollout_mode": cfg.rollout_mode,
        "replay": cfg.replay,
        **({"score_trained_apart": True} if cfg.score_trained_apart else {}),  # absent when off: older runs resume
        # batches over all datasets depend on the dataset list's order (absent: per-dataset batches)
        **({"batch_across_datasets": list(cfg.datasets)} if cfg.batch_across_datasets else {}),
    }


def _check_resume(out_dir: Path, fingerprint: dict[str, Any]) -> None:
    path = out_dir / RUN_FILE
    if path.exists():
        old = json.loads(path.read_text()).get("fingerprint", {})
        # keys on either side: a setting recorded only when used (batch_across_datasets) must match too
        diffs = [k for k in [*fingerprint, *(k for k in old if k not in fingerprint)] if old.get(k) != fingerprint.get(k)]
        if "protocol" in diffs:
            p_old, p_new = old.get("protocol") or {}, fingerprint["protocol"]
            diffs.remove("protocol")
            diffs += [f"protocol.{k}" for k in p_new if p_old.get(k) != p_new[k]]
        if diffs:
            details = "; ".join(f"{d}: {_lookup(old, d)!r} -> {_lookup(fingerprint, d)!r}" for d in diffs)
            raise UserError(f"{out_dir} holds a run with different settings ({details}); "
                            "use another --out folder (or delete this one) to start fresh")


def _lookup(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _max_model_len(model_path: str, wanted: int) -> int:
    """The protocol's context length, capped by what the model supports."""
    try:
        from transformers import AutoConfig

        limit = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    except Exception:  # hub name without a hub: let the engine report it
        return wanted
    return min(wanted, limit) if limit else wanted


def _make_engine(cfg: EvalConfig):
    """The evaluation engine (``provision.engines``, like training's): vLLM, falling back to transformers
    where vLLM is not installed; returns (engine, the kind used)."""
    from emapg.models import resolve_model
    from provision.engines import EngineSpec, RemoteOptions, available_kind, build_engine

    try:
        path = resolve_model(cfg.model)
    except ValueError as e:
        raise UserError(f"--model {cfg.model!r}: {e}") from None
    # the reason goes to the run's log (stderr is the log under emapg.console); the CLI says on the console that it fell back
    kind = available_kind(cfg.engine, warn=lambda text: print(f"emapg eval: {text}", file=sys.stderr))
    remote = None
    if kind == "remote":
        remote = RemoteOptions(tuple(cfg.engine_urls), api_key=cfg.engine_api_key,
                               wait_s=cfg.engine_wait, load_model=True)
    spec = EngineSpec(kind, path, max_model_len=_max_model_len(path, cfg.protocol.max_model_len), seed=cfg.protocol.seed,
                      remote=remote)
    return build_engine(spec), kind


def _rollout_config(p: EvalProtocol, mode: str, seed: int):
    from agent.rollout import RolloutConfig

    task = get_task(p.suite)
    return RolloutConfig(
        task=task.rollout_name,
        template="search_tools" if p.format == "tool_calls" and p.template == "search_r1" else p.template,
        format=p.format,
        tool_parser=p.tool_parser,
        tool_chat_template=p.tool_chat_template,
        max_turns=p.max_turns,
        max_tokens_per_turn=p.max_tokens,
        max_obs_tokens=p.max_obs_tokens,
        max_response_tokens=p.max_response_tokens if task.searches else p.max_tokens,
        max_prompt_tokens=p.max_prompt_tokens,
        prompt_truncation="truncate_question",
        topk=p.retrieval_topk,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=seed,
        n_samples=p.n,
        mode=mode,
    )


def _progress(total: int, initial: int, desc: str, enabled: bool):
    """A bar on a terminal, a line every 10 s (and at the end) otherwise, nothing when ``enabled`` is false."""
    from emapg.progress import StepProgress

    return _Questions(StepProgress(f"eval {desc}", total, start=initial, mode="auto" if enabled else "off", unit="question",
                                   min_interval_s=10.0))


class _Questions:
    """The ``update(n)``/``close()`` face of a :class:`emapg.progress.StepProgress` counting questions."""

    def __init__(self, progress) -> None:
        self.progress = progress

    def update(self, n: int) -> None:
        self.progress.advance(n)

    def close(self) -> None:
        self.progress.close()


# --------------------------------------------------------------------------- the run


def _search_slices(records: list[dict[str, Any]]) -> dict[str, Any]:
    from eval.search_metrics import by_slice

    return by_slice(records)


def slice_ids(name: str) -> dict[str, list[str]]:
    """The recorded ``reader`` or ``search`` slice's question ids per dataset."""
    if name == "search":
        from tasks.multihop import SEARCH_SLICE_FILE, search_slice_ids

        ids = search_slice_ids()
        if not ids:
            raise UserError(f"slice=search: no search slice recorded at {SEARCH_SLICE_FILE} (scripts/build_search_data.py)")
        return ids
    from eval.reader_slice import load_reader_slice

    return load_reader_slice().ids


def reader_slice_examples(examples: dict[str, list[Any]], *, limit: int | None = None, seed: int = 0,
                          name: str = "reader") -> dict[str, list[Any]]:
    """``slice=reader`` (or ``search``): each dataset's examples cut to the recorded slice (:mod:`eval.reader_slice`,
    :mod:`tasks.multihop`); with ``limit``, at most that many of them, a seeded choice (sha256 of seed and id), in file order."""
    recorded = slice_ids(name)
    out = {}
    for ds, exs in examples.items():
        if ds not in recorded:
            raise UserError(f"slice={name}: the {name} slice has no dataset {ds!r} (it has {', '.join(recorded)})")
        wanted = set(recorded[ds])
        out[ds] = [ex for ex in exs if ex.id in wanted]
        if len(out[ds]) != len(wanted):
            raise UserError(f"slice={name}: {ds}: {len(wanted) - len(out[ds])} slice questions are not in the dataset file")
        if limit is not None and len(out[ds]) > limit:
            chosen = set(sorted(wanted, key=lambda i: hashlib.sha256(f"{seed}\x00{i}".encode()).digest())[:limit])
            out[ds] = [ex for ex in out[ds] if ex.id in chosen]
    return out


def run_eval(cfg: EvalConfig, *, on_batch: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Evaluate ``cfg.model`` on ``cfg.datasets``; returns the ``results.json`` content.

    ``on_batch(dataset, items_done)`` is called after every batch is written (for callers
    that show progress their own way).
    """
    from tasks.datasets import load_dataset, task_of

    cfg.validate()
    cfg.protocol.validate()
    p = cfg.protocol
    task = get_task(p.suite)
    datasets = list(cfg.datasets) or (list(slice_ids("search")) if cfg.slice == "search" else list(task.datasets))
    for ds in datasets:
        owner = task_of(ds)
        if owner is not None and owner != task.name:
            raise UserError(f"dataset {ds!r} belongs to the {owner} suite, not {task.name}")
    if len(set(datasets)) != len(datasets):
        raise UserError(f"datasets listed twice: {datasets}")
    if cfg.replay is not None and not task.searches:
        raise UserError(f"--replay answers searches; the {task.name} suite makes none")
    # Load every dataset before the (slow) engine, so a bad name fails fast.
    if cfg.slice in ("reader", "search"):
        examples = reader_slice_examples({ds: load_dataset(ds) for ds in datasets}, limit=cfg.limit, seed=cfg.data_seed,
                                         name=cfg.slice)
    else:
        examples = {ds: load_dataset(ds, path=cfg.data_paths.get(ds), limit=cfg.limit, seed=cfg.data_seed) for ds in datasets}
    for ds, exs in examples.items():
        if not exs:
            raise UserError(f"dataset {ds!r} has no questions")
    # The contamination guard (eval.contamination): before anything is written, refuse questions the model trained on.
    model_path = _model_path(cfg)
    contamination = check_contamination(model_path, examples, score_apart=cfg.score_trained_apart,
                                        model_label=repr(cfg.model))

    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ITEMS_DIR).mkdir(exist_ok=True)
    done = {ds: read_items(out_dir, ds) for ds in datasets}
    # The engine kind is part of the fingerprint; check against the requested one first so a
    # mismatch fails before the model loads (a vLLM -> hf fallback is re-checked below).
    _check_resume(out_dir, _fingerprint(cfg, cfg.engine))
    done_ids = {ds: {r["id"] for r in recs} for ds, recs in done.items()}
    n_todo = sum(ex.id not in done_ids[ds] for ds, exs in examples.items() for ex in exs)

    engine = engine_kind = retriever = pool = None
    retriever_desc = None
    index_fp: dict[str, Any] | None = None
    index_fps: dict[str, Any] = {}
    t_start = time.perf_counter()
    t_ready = t_start
    try:
        if n_todo:
            # The retriever first: it is quick to check, the engine is not (vLLM: a minute).
            if task.searches:
                retriever, retriever_desc, index_fp, index_fps = _open_recorded_retriever(cfg)
                _check_index(out_dir, index_fp)
            engine, engine_kind = _make_engine(cfg)
            _check_resume(out_dir, _fingerprint(cfg, engine_kind))
            (out_dir / RUN_FILE).write_text(json.dumps({"fingerprint": _fingerprint(cfg, engine_kind), "retriever": retriever_desc,
                                                        "index_fingerprint": index_fp, "retriever_fingerprints": index_fps,
                                                        "started": _now()}, indent=2) + "\n")
            if not task.searches:  # math: one grader pool for the run
                from tasks.math import GraderPool

                pool = GraderPool(workers=cfg.grader_workers)
        elif (out_dir / RUN_FILE).exists():  # everything was done by an earlier run
            previous = json.loads((out_dir / RUN_FILE).read_text())
            engine_kind, retriever_desc = previous["fingerprint"]["engine"], previous.get("retriever")
            index_fp, index_fps = previous.get("index_fingerprint"), previous.get("retriever_fingerprints") or {}
        else:
            engine_kind = cfg.engine
        t_ready = time.perf_counter()
        if cfg.batch_across_datasets:
            _run_across(cfg, datasets, examples, done_ids, engine, retriever, pool, out_dir, on_batch)
        else:
            for ds in datasets:
                _run_dataset(cfg, ds, examples[ds], done_ids[ds], engine, retriever, pool, out_dir, on_batch)
        t_end = time.perf_counter()
    finally:
        if pool is not None:
            pool.close()
        if retriever is not None and retriever.live is not None:
            retriever.live.close()
        if engine is not None:
            engine.close()

    records = {ds: ordered(read_items(out_dir, ds), examples[ds]) for ds in datasets}
    parts = {ds: contamination.split(ds, recs) for ds, recs in records.items()}  # (unseen, trained on)
    per_ds = {ds: task.aggregate(unseen, p.n) for ds, (unseen, _) in parts.items() if unseen}
    trained_on = {ds: task.aggregate(seen, p.n) for ds, (_, seen) in parts.items() if seen}
    names = task.metric_names(p.n)
    results = {
        "name": cfg.name or out_dir.resolve().name,
        "model": cfg.model,
        "suite": task.name,
        "engine": engine_kind,
        "protocol": protocol_dict(p),
        "grader": task.scorer(p.grader),
        "retriever": retriever_desc,
        # provenance (eval.provenance): the index that answered the searches and the protocol card
        "fingerprint": index_fp,
        "retriever_fingerprints": index_fps,
        "protocol_card": eval_protocol_card(cfg, examples, model_path),
        "slice": cfg.slice,
        "limit": cfg.limit,
        "data_seed": cfg.data_seed,
        "timestamp": _now(),
        "primary_metric": task.primary_metric,
        "metric_names": names,
        "datasets": per_ds,
        # unweighted mean over datasets (the paper's "average"); totals are summed
        "average": {m: sum(v[m] for v in per_ds.values()) / (1 if m in task.totals else len(per_ds))
                    for m in names},
        # questions the model was trained on (eval.contamination): none scored here, or scored apart below
        "contamination": contamination.summary(),
        **({"trained_on": trained_on} if trained_on else {}),
        # how the agent searched, per slice (eval.search_metrics: search slice, reader slice, rest), unseen questions
        **({"search": _search_slices([r for unseen, _ in parts.values() for r in unseen])} if task.searches else {}),
        # this invocation only (a resumed run times the questions it ran)
        "timing": {
            "setup_s": t_ready - t_start,
            "eval_s": t_end - t_ready,
            "questions_run": n_todo,
            "questions_per_s": n_todo / (t_end - t_ready) if n_todo and t_end > t_ready else None,
        },
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    from eval.report import write_run_report

    warnings = notes(task, records)
    if warnings:
        echo(warnings.replace("**", ""))  # on the console even while library output goes to the run's log
    write_run_report(results, out_dir, notes=warnings)
    return results


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _model_path(cfg: EvalConfig) -> str | None:
    from emapg.models import resolve_model

    try:
        return resolve_model(cfg.model)
    except ValueError:
        return None


def _check_index(out_dir: Path, index_fp: dict[str, Any] | None) -> None:
    """A resumed run must search the index its first part searched."""
    path = out_dir / RUN_FILE
    old = json.loads(path.read_text()).get("index_fingerprint") if path.exists() else None
    if old is not None and index_fp is not None and old != index_fp:
        raise UserError(f"{out_dir} was started against index {old['id']}, but this retriever serves index {index_fp['id']}; "
                        "use another --out folder (or the original index) so one run does not mix two indexes")


def _open_recorded_retriever(cfg: EvalConfig):
    """The run's retriever wrapped in an :class:`eval.replay.RecordedRetriever` (live, replayed, or a
    replay that asks a live server for what was not recorded), its description, and the index
    fingerprint the searches are answered by (one, and per server URL)."""
    from eval.replay import RecordedRetriever, load_retrievals
    from provision.provenance import single_fingerprint

    live = None
    if cfg.replay is None or cfg.retriever_url or cfg.index:
        live = _open_retriever(cfg)
    try:
        fps = live.fingerprints() if live is not None else {}
        index_fp = single_fingerprint(fps) if fps else None
        if cfg.replay is None:
            return RecordedRetriever(live=live), live.description, index_fp, fps
        recorded = load_retrievals(cfg.replay)
        replayed_fp = _recorded_fingerprint(cfg.replay)
        if live is not None and replayed_fp is not None and index_fp is not None and replayed_fp != index_fp:
            raise UserError(f"--replay {cfg.replay} searched index {replayed_fp['id']}, but the live retriever serves index "
                            f"{index_fp['id']}; a replay may only fall back to the same index")
        desc = f"replayed from {cfg.replay}" + (f" (unrecorded queries: {live.description})" if live is not None else "")
        return RecordedRetriever(live=live, recorded=recorded), desc, replayed_fp or index_fp, fps
    except BaseException:
        if live is not None:
            live.close()
        raise


def _recorded_fingerprint(run_dir: str) -> dict[str, Any] | None:
    for name, key in (("results.json", "fingerprint"), (RUN_FILE, "index_fingerprint")):
        path = Path(run_dir) / name
        if path.is_file():
            value = json.loads(path.read_text()).get(key)
            if value is not None:
                return value
    return None


def _open_retriever(cfg: EvalConfig):
    """The run's retriever: ``--retriever-url``, else a server on ``--index`` or the bundled index."""
    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever

    if cfg.retriever_url:
        return open_retriever(urls=[cfg.retriever_url], api_key=cfg.retriever_api_key, timeout=cfg.retriever_timeout,
                              retries=cfg.retriever_retries, batch_invariant=cfg.retriever_batch_invariant)
    return open_retriever(index_dir=cfg.index or ensure_bundled_index(), topk=cfg.protocol.retrieval_topk,
                          api_key=cfg.retriever_api_key, timeout=cfg.retriever_timeout, retries=cfg.retriever_retries,
                          batch_invariant=cfg.retriever_batch_invariant)


def _run_batch(cfg, batch: list[tuple[str, Any]], seed: int, tag: str, engine, retriever, pool, out_dir) -> dict[str, int]:
    """Roll out, score and append one batch of (dataset, example) pairs; returns items written per dataset."""
    from agent.rollout import run_rollouts
    from eval.replay import RETRIEVALS_FILE

    p = cfg.protocol
    rcfg = _rollout_config(p, cfg.rollout_mode, seed)
    trajs = run_rollouts(engine, [ex for _, ex in batch], retriever, rcfg, batch_tag=tag)
    if retriever is not None:  # the searches before the items: an item never lacks its retrievals
        append_jsonl(out_dir / RETRIEVALS_FILE, retriever.finish_batch())
    per_item = [trajs[i * p.n : (i + 1) * p.n] for i in range(len(batch))]
    written: dict[str, int] = {}
    for ds in dict.fromkeys(d for d, _ in batch):
        idx = [i for i, (d, _) in enumerate(batch) if d == ds]
        exs, ts = [batch[i][1] for i in idx], [per_item[i] for i in idx]
        records = score_items(get_task(p.suite), exs, ts, engine.tokenizer,
                              Grading(grader=p.grader, timeout=p.grade_timeout, workers=cfg.grader_workers), pool)
        append_items(out_dir, ds, records)
        written[ds] = len(records)
    return written


def _run_across(cfg, datasets, examples, done_ids, engine, retriever, pool, out_dir, on_batch) -> None:
    """``batch_across_datasets``: batches of ``batch_size`` over every dataset's questions in order (fixed by
    position, so a resumed run forms the same batches and seeds), finished items left out."""
    flat = [(ds, ex) for ds in datasets for ex in examples[ds]]
    done = {ds: sum(ex.id in done_ids[ds] for ex in examples[ds]) for ds in datasets}
    bar = _progress(len(flat), sum(done.values()), "all datasets", cfg.progress)
    try:
        for b in range(0, len(flat), cfg.batch_size):
            batch = [(ds, ex) for ds, ex in flat[b : b + cfg.batch_size] if ex.id not in done_ids[ds]]
            if not batch:
                continue
            index = b // cfg.batch_size
            written = _run_batch(cfg, batch, _batch_seed(cfg.protocol.seed, "+".join(datasets), index), f"all-{index}",
                                 engine, retriever, pool, out_dir)
            for ds, n in written.items():
                done[ds] += n
                if on_batch is not None:
                    on_batch(ds, done[ds])
            bar.update(len(batch))
    finally:
        bar.close()


def _run_dataset(cfg, ds, examples, done_ids, engine, retriever, pool, out_dir, on_batch) -> None:
    """Batches of ``batch_size`` within one dataset (the default), finished items left out."""
    n_done = sum(ex.id in done_ids for ex in examples)
    if n_done == len(examples):
        return
    bar = _progress(len(examples), n_done, ds, cfg.progress)
    try:
        for b in range(0, len(examples), cfg.batch_size):
            batch = [(ds, ex) for ex in examples[b : b + cfg.batch_size] if ex.id not in done_ids]
            if not batch:
                continue
            index = b // cfg.batch_size
            _run_batch(cfg, batch, _batch_seed(cfg.protocol.seed, ds, index), f"{ds}-{index}", engine, retriever, pool, out_dir)
            n_done += len(batch)
            bar.update(len(batch))
            if on_batch is not None:
                on_batch(ds, n_done)
    finally:
        bar.close()
