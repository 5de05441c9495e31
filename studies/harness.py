"""What every pre-registered study shares: the committed protocol, the environment, seeds and resuming, the
per-question and seed-level intervals, the pooled report and its plot.

A study (one file in ``studies/``) writes its protocol in its docstring and commits it before the run. The harness:

* **protocol**: :func:`start` refuses a run while the study's file, this harness or the statistics it uses
  (:data:`PROTOCOL_FILES`) differ from the commit (``git status --porcelain``), so every result comes from code that is
  in the history; ``--allow-dirty`` (development) and ``--quick`` (smoke runs) let it run, and the report records which
  (:func:`provenance`: the commit, the files, dirty or not);
* **seeds and resuming**: a finished run leaves its record in the work folder (:func:`finished`, :func:`record`), a rerun
  with the same folder keeps it; :func:`take_finished` puts an earlier report's run records back into an empty work
  folder (a lost folder costs nothing again); :func:`seeds_first` orders (arm, seed) so that an interrupted study has
  every arm at the same number of seeds; :func:`arm_runs` runs an arms-by-seeds study's loop on these and
  :func:`import_runs` is its ``--resume-from``;
* **statistics**: per-question scores of QA evaluations (:func:`per_question`), their mean over seeds
  (:func:`seed_mean`), the per-question paired interval (:func:`difference`, :func:`eval.significance.paired_bootstrap`
  over the seed-averaged scores: these seeds) and the seed-level interval (:func:`seed_difference`,
  :func:`eval.significance.hierarchical_bootstrap`: seeds, then questions, resampled: the recipe);
* **servers**: :func:`servers`, the retriever over the bundled index and one generation server for the whole study;
* **report**: :func:`write_report` writes the JSON (and the plot beside it), :func:`figure`/:func:`save_figure` the
  plot's set-up, :func:`now` the date.

Results stay in ``benchmarks/results/`` (:data:`RESULTS`): documentation, the performance page and earlier checks read
them there.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: besides the study's own file: the code a study's numbers depend on, in the protocol's commit
PROTOCOL_FILES = ("studies/harness.py", "eval/significance.py")
#: the environment every study runs in (offline, quiet tokenizers, the vLLM CPU cache), set where not already set
ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "3"}


# --------------------------------------------------------------------------------------------------- the protocol
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The harness's options on a study's parser (``--allow-dirty``; every study has its own ``--quick``)."""
    parser.add_argument("--allow-dirty", action="store_true",
                        help="run although the study's protocol files differ from the commit (development only: the report "
                             "records it; a pre-registered run starts from a committed protocol)")


def _git(args: list[str], root: Path) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def protocol_files(study: str | Path, root: Path = ROOT, also: Sequence[str] = ()) -> list[str]:
    """The files a study's numbers depend on, relative to ``root``: its own file, :data:`PROTOCOL_FILES` and ``also``
    (the other studies or suites whose code it runs)."""
    return [str(Path(study).resolve().relative_to(root.resolve())), *PROTOCOL_FILES, *also]


def uncommitted(study: str | Path, root: Path = ROOT, also: Sequence[str] = ()) -> list[str]:
    """The :func:`protocol_files` of ``study`` that ``git status --porcelain`` lists: changed, staged or untracked."""
    status = _git(["status", "--porcelain", "--untracked-files=all", "--", *protocol_files(study, root, also)], root)
    return [line[3:] for line in status.splitlines()]


def provenance(study: str | Path, root: Path = ROOT, also: Sequence[str] = ()) -> dict[str, Any]:
    """The commit a run starts from and whether its protocol files differ from it."""
    try:
        changed = uncommitted(study, root, also)
        commit = _git(["rev-parse", "HEAD"], root).strip()
    except (OSError, subprocess.CalledProcessError) as e:
        return {"commit": None, "dirty": None, "error": f"not a git checkout with a commit ({e.__class__.__name__})"}
    return {"commit": commit, "dirty": bool(changed), "uncommitted": changed, "protocol_files": protocol_files(study, root, also)}


def start(study: str | Path, *, quick: bool, allow_dirty: bool, root: Path = ROOT, also: Sequence[str] = ()) -> dict[str, Any]:
    """Before a study's runs: its :func:`provenance`, refusing (``SystemExit``) when the protocol is not committed, unless
    ``quick`` or ``allow_dirty``. ``also``: other files (relative to ``root``) whose code the study runs. The caller keeps
    the returned record in its report."""
    record = provenance(study, root, also)
    if not (quick or allow_dirty):
        if record["commit"] is None:
            raise SystemExit(f"{Path(study).name}: cannot tell whether the protocol is committed ({record['error']}); "
                             "run from a git checkout, or pass --allow-dirty for a development run")
        if record["dirty"]:
            raise SystemExit(f"{Path(study).name}: the protocol is not committed: {', '.join(record['uncommitted'])} "
                             "differ from the commit. Commit them before the run (pre-registration), or pass --allow-dirty "
                             "for a development run")
    record["allowed_by"] = "quick" if quick else "allow-dirty" if allow_dirty else None
    return record


def environment(**extra: str) -> None:
    """:data:`ENVIRONMENT` and ``extra`` into ``os.environ`` where not already set."""
    for key, value in {**ENVIRONMENT, **extra}.items():
        os.environ.setdefault(key, value)


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------------------------------- seeds and resuming
def seeds_first(arms: Iterable[str], seeds: Iterable[int]) -> list[tuple[str, int]]:
    """(arm, seed) in seed-major order: an interrupted study has every arm at the same number of seeds."""
    arms = list(arms)
    return [(arm, seed) for seed in seeds for arm in arms]


def finished(path: Path) -> dict[str, Any] | None:
    """A finished run's record (written by :func:`record` when the run ended), or None."""
    return json.loads(path.read_text()) if path.is_file() else None


def record(path: Path, data: dict[str, Any], *, indent: int | None = None) -> None:
    """Mark a run finished: its record, written last (a run killed before has none and runs again)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")


def take_finished(records: dict[Path, dict[str, Any]]) -> list[Path]:
    """``--resume-from``: write an earlier report's run records where the work folder has none; returns those written.
    The caller first checks that the earlier report ran the same protocol (:func:`same_protocol`)."""
    taken = []
    for path, data in records.items():
        if not path.is_file():
            record(path, data)
            taken.append(path)
    return taken


def same_protocol(earlier: dict[str, Any], report: dict[str, Any], keys: Sequence[str], *, what: str = "--resume-from") -> None:
    """Refuse (``SystemExit``) an earlier report whose protocol fields ``keys`` differ from this run's."""
    differ = [k for k in keys if earlier.get(k) != report.get(k)]
    if differ:
        raise SystemExit(f"{what}: the earlier report ran another protocol (differs in {', '.join(differ)})")


def import_runs(earlier: dict[str, Any], report: dict[str, Any], work: Path, algos: Sequence[str], seeds: Sequence[int],
                keys: Sequence[str]) -> list[str]:
    """``--resume-from`` for an arms-by-seeds study (:func:`arm_runs`): copy an earlier report's recorded starter scores
    (``report["starter"]``) and finished runs (``runs[arm][seed]`` with ``per_question``) into ``work`` where it has
    none, after checking that both reports describe the same protocol (``keys``) and the same settings per arm
    (``algorithms``). Returns what was taken ("starter", "grpo seed 0", ...)."""
    same_protocol(earlier, report, keys)
    if "starter" not in earlier:
        raise SystemExit("--resume-from: the earlier report records no per-question scores (written before they were kept)")
    changed = [alg for alg in algos
               if alg in earlier.get("algorithms", {}) and earlier["algorithms"][alg] != report.get("algorithms", {}).get(alg)]
    if changed:
        raise SystemExit(f"--resume-from: the earlier report ran other settings for {', '.join(changed)}")
    records = {work / "starter.json": earlier["starter"]}
    for alg, seed in seeds_first(algos, seeds):
        run = earlier.get("runs", {}).get(alg, {}).get(str(seed))
        if run and "per_question" in run:
            records[run_folder(work, alg, seed) / "run.json"] = run
    return [("starter" if p.name == "starter.json" else p.parent.name.replace("-seed", " seed ")) for p in take_finished(records)]


def run_folder(work: Path, arm: str, seed: int) -> Path:
    """The work folder of one (arm, seed) run."""
    return work / f"{arm}-seed{seed}"


def arm_runs(work: Path, algos: Sequence[str], seeds: Sequence[int],
             train: Callable[[str, int, Path], dict[str, Any]]) -> Iterator[tuple[str, int, dict[str, Any], bool]]:
    """Every (arm, seed) run of a study, seeds first (:func:`seeds_first`): yields ``(arm, seed, record, kept)``.
    A run whose record is in ``work`` (:func:`finished`) is kept (``kept`` True); any other is trained again from
    an empty folder by ``train(arm, seed, folder)``, which returns the run's record, written last (:func:`record`).
    A run kept from before per-question scores were recorded is refused: it cannot be pooled."""
    for alg, seed in seeds_first(algos, seeds):
        folder = run_folder(work, alg, seed)
        run = finished(folder / "run.json")
        if run is not None:
            if "per_question" not in run:
                raise SystemExit(f"{folder / 'run.json'} was written before runs recorded their per-question scores: "
                                 "train it again (remove the file)")
            yield alg, seed, run, True
            continue
        shutil.rmtree(folder, ignore_errors=True)  # an unfinished run is trained again from the start
        run = train(alg, seed, folder)
        record(folder / "run.json", run, indent=1)
        yield alg, seed, run, False


def keep_policy_only(ckpt: Path) -> None:
    """Remove a checkpoint's training state (optimizer, anchor, sharded state), keeping ``policy/`` (weights, tokenizer)
    and the manifest/provenance files beside it, so the trained weights stay evaluable after the run."""
    for f in ckpt.iterdir():
        if f.name == "policy" or (f.is_file() and f.suffix in (".json", ".yaml", ".txt")):
            continue
        shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink()


def finish_checkpoint(ckpt: Path, *, keep_policy: bool) -> None:
    """After a run's last checkpoint is scored: keep its ``policy/`` (:func:`keep_policy_only`) or remove it."""
    keep_policy_only(ckpt) if keep_policy else shutil.rmtree(ckpt, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- servers
@dataclass(frozen=True)
class Served:
    """The URLs of a study's retriever and its shared generation server."""

    retriever_url: str
    engine_url: str


@contextlib.contextmanager
def servers(policy: str, *, engine: str, index_limit: int | None, max_model_len: int, folder: Path) -> Iterator[Served]:
    """The bundled index (its first ``index_limit`` passages; None: all) behind a retriever, and one ``emapg engine serve``
    of ``policy`` shared by every run and evaluation of a study (the trainer pushes its weights to it); logs in
    ``folder``; both stopped on exit."""
    from agent.engines.launch import EngineServer
    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever

    folder.mkdir(parents=True, exist_ok=True)
    with open_retriever(index_dir=ensure_bundled_index(index_limit), log_path=folder / "retriever.log") as retriever, \
            EngineServer(policy, engine=engine, max_model_len=max_model_len, omp_num_threads=os.cpu_count() or 1,
                         startup_timeout=900, log_path=folder / "engine.log") as served:  # fmt: skip
        yield Served(retriever.urls[0], served.url)


# ------------------------------------------------------------------------------------------------- statistics
def qa_sets() -> tuple[str, ...]:
    from tasks.datasets import QA_DATASETS

    return QA_DATASETS


def check_heldout(eval_dir: Path) -> None:
    """Every question an evaluation scored is in the recorded held-out split (data/qa/heldout.json)."""
    from eval.items import read_items
    from tasks.datasets import heldout_ids

    for ds in qa_sets():
        outside = {r["id"] for r in read_items(eval_dir, ds)} - set(heldout_ids(ds))
        if outside:
            raise RuntimeError(f"{eval_dir}: {len(outside)} evaluated {ds} questions are not held out, e.g. {sorted(outside)[:3]}")


def per_question(eval_dirs: Sequence[Path], metric: str = "em") -> dict[str, float]:
    """Question (``dataset/id``) -> its ``metric`` (:func:`eval.learning.question_score`) averaged over the given QA
    evaluations (seeds). Datasets an evaluation scored no question of are skipped."""
    from eval.items import read_items
    from eval.learning import question_score

    sums: dict[str, float] = {}
    for d in eval_dirs:
        for ds in qa_sets():
            for r in read_items(Path(d), ds):
                key = f"{ds}/{r['id']}"
                sums[key] = sums.get(key, 0.0) + question_score(r, metric) / len(eval_dirs)
    return sums


def seed_mean(records: Sequence[dict[str, float]]) -> dict[str, float]:
    """Question -> its score averaged over runs (seeds); every run must have scored the same questions."""
    keys = sorted(records[0])  # a fixed order: the sums are the same in every process
    if any(sorted(r) != keys for r in records):
        raise ValueError("the runs scored different questions")
    return {k: sum(r[k] for r in records) / len(records) for k in keys}


def pct(scores: dict[str, float]) -> float:
    return 100 * sum(scores.values()) / len(scores)


def _aligned(a: dict[str, float], b: dict[str, float]) -> list[str]:
    keys = sorted(a)
    if set(keys) != set(b):
        raise ValueError(f"the two sides scored different questions ({len(set(a) ^ set(b))} not in both)")
    return keys


def difference(a: dict[str, float], b: dict[str, float]) -> dict[str, Any]:
    """mean(b) − mean(a) in percentage points over the questions both score, with its paired bootstrap interval (the
    per-question interval: with seed-averaged scores it describes these seeds)."""
    from eval.significance import paired_bootstrap

    keys = _aligned(a, b)
    d = paired_bootstrap([a[k] for k in keys], [b[k] for k in keys])
    return {"mean": 100 * d.mean, "low": 100 * d.low, "high": 100 * d.high, "n": d.n, "confidence": d.confidence,
            "method": "paired bootstrap over questions (per question: the score averaged over seeds), percentile interval"}


def seed_difference(a: Sequence[dict[str, float]], b: Sequence[dict[str, float]]) -> dict[str, Any]:
    """mean(b) − mean(a) in percentage points, ``a`` and ``b`` one question -> score record per seed (``a`` may be one
    record: the starter), with the seed-level interval (:func:`eval.significance.hierarchical_bootstrap`: seeds, then
    questions, resampled) and each seed's own difference."""
    from eval.significance import hierarchical_bootstrap

    keys = _aligned(a[0], b[0])
    for r in [*a, *b]:
        _aligned(a[0], r)
    d = hierarchical_bootstrap([[r[k] for k in keys] for r in a], [[r[k] for k in keys] for r in b])
    return {"mean": 100 * d.mean, "low": 100 * d.low, "high": 100 * d.high, "n": d.n, "seeds_a": d.seeds_a,
            "seeds_b": d.seeds_b, "per_seed": [100 * x for x in d.seed_means], "confidence": d.confidence,
            "method": "hierarchical bootstrap: seeds, then questions (the same draw for every seed), resampled; "
                      "percentile interval"}


def intervals(a: Sequence[dict[str, float]], b: Sequence[dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Both intervals of mean(b) − mean(a), side by side: ``per_question`` (:func:`difference` of the seed means) and
    ``seed_level`` (:func:`seed_difference`)."""
    return {"per_question": difference(seed_mean(a), seed_mean(b)), "seed_level": seed_difference(a, b)}


# ------------------------------------------------------------------------------------------------- the report
def figure(rows: int = 1, cols: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    """A matplotlib figure and its axes, drawn off-screen (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, **kwargs)


def save_figure(fig: Any, path: Path, *, dpi: int = 120) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def write_report(report: dict[str, Any], out: Path, plot: Callable[[dict[str, Any], Path], Path] | None = None) -> Path:
    """The report as JSON at ``out``, and (``plot``) its plot beside it (``out`` with ``.png``), named in the report."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if plot is not None:
        report["plot"] = str(plot(report, out.with_suffix(".png")))
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out
