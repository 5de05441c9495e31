"""``emapg demo``: does training make the search agent better? The whole product on bundled data, on a CPU.

1. prepare the offline models: the starter search policy (:data:`STARTER`) and the encoder (MiniLM);
2. build a FAISS index of the bundled Wikipedia corpus (:func:`provision.indexes.ensure_bundled_index`:
   cached, reused only when its settings match, a killed build resumes);
3. start the retrieval server on a free local port (:func:`provision.retrievers.open_retriever`) and one
   generation engine server (``emapg engine serve``) that every later stage generates on: each evaluation
   loads its model's weights into it first, training pushes the policy's weights before every rollout
   (``rollout.engine=remote``), so the engine (vLLM: ~45 s) starts once, not once per stage;
4. evaluate the starter on held-out questions of all seven QA sets (the same seeded sample per set in
   both evaluations, a subset of the recorded held-out split ``data/qa/heldout.json``; no training,
   warm-start or selection question is among them), and on a seeded sample of the search slice
   (``data/qa/search_slice.json``: held-out multi-hop questions a second search can answer), greedy then sampled;
5. train it with EMA-PG on the answerable training pool (``qa_pool``: bundled QA questions outside every
   held-out split whose answer the bundled index retrieves; ``data/qa/pool/``) for the preset's steps;
6. evaluate the trained policy on the same questions;
7. write the report: starter vs trained per dataset and pooled over all questions, with the paired
   bootstrap interval of the difference (:mod:`eval.learning`), the reward / format-rate /
   searches-per-question / KL-estimate curves of every step, all metrics side by side, how each policy
   searched per slice (search slice, reader slice, rest), one trajectory that searched twice, example
   trajectories; stop the server; print the report folder as the last line.

The console shows stage banners, progress bars and results; each stage's own output (vLLM,
transformers, torch) goes to ``<run>/logs/<stage>.log``, named in the report. The index is built in
this process; the server and every other stage run in their own process groups, so Ctrl-C stops
every process the demo started. The index builder writes each chunk and finally ``meta.json``
atomically, so an interrupted demo leaves the cache consistent (the next run resumes the build).

This is an application module (the ``emapg`` command's top floor): no library module imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from agent.engines.launch import EngineServer
from emapg.config import add_config_arguments, config_from_args, load_config, option
from emapg.errors import UserError
from emapg.models import STARTER
from emapg.paths import CONFIG_DIR, REPO_ROOT
from emapg.process_group import stop_process_group
from emapg.servers import emapg_command
from eval.search_metrics import demo_lines as search_demo_lines
from tasks.datasets import HELDOUT_PER_DATASET, QA_DATASETS
from trainer.plot import FLAT_BY_CONSTRUCTION

SAMPLING_SEED = 1  # the sampled evaluation's seed: the same for the starter and the trained policy (paired samples)
ENGINE_STARTUP_S = 900  # the generation engine's start-up limit (vLLM on 2 cores: ~40 s; a first run compiles more)


@dataclass(frozen=True)
class DemoPreset:
    """What one demo run does."""

    policy: str
    train_config: Path
    index_limit: int | None  # passages indexed (None: the whole bundled corpus)
    eval_limit: int  # held-out questions per QA dataset
    engine: str
    train_steps: int  # optimizer steps of the training stage (run.total_steps)
    # The training questions: the answerable pool (data/qa/pool/, scripts/build_qa_pool.py) or its subset the
    # starter solves sometimes but not always (qa_pool_informative, scripts/curate_pool.py).
    train_set: str
    train_overrides: tuple[str, ...] = ()
    eval_overrides: tuple[str, ...] = ()
    sampled_n: int = 2  # samples per question of the sampled evaluation (mean@k at the training temperature)
    sampled_overrides: tuple[str, ...] = ()
    # held-out search-slice questions (data/qa/search_slice.json: the first search does not show the gold, a second
    # search can), evaluated beside the eval_limit ones the same two ways (a seeded sample; 0: none)
    search_limit: int = 0


PresetName = Literal["default", "tiny"]

PRESETS: dict[str, DemoPreset] = {
    # 7 x 15 held-out questions (a subset of data/qa/heldout.json), 8 EMA-PG steps on the answerable pool;
    # measured times: README "What the demo shows".
    "default": DemoPreset(
        policy=STARTER,
        train_config=CONFIG_DIR / "demo_search_smollm2.yaml",
        index_limit=None,
        eval_limit=15,
        engine="vllm",
        train_steps=8,
        train_set="qa_pool",
        # greedy, 2 searches, 64 tokens per turn (as in training); all 105 questions in one vLLM batch
        eval_overrides=("--protocol", "qa_quick", "--batch-across-datasets", "--batch-size", "105"),
        # mean@2: a sampled pass over 105 questions costs ~2.8 min per policy on 2 cores (vLLM samples ~1.3
        # trajectories/s: 105 x 4 would add ~5.5 min to the 15-min demo); studies/learning_search.py scores mean@4
        sampled_n=2,
        sampled_overrides=("--batch-size", "53"),  # 53 questions x 2 samples per vLLM batch
        search_limit=15,
    ),
    # CI-sized: a 1.7M-parameter random model, a 2k-passage index; checks the plumbing, not learning.
    "tiny": DemoPreset(
        policy="tiny-qwen2",
        train_config=CONFIG_DIR / "search_tiny_cpu.yaml",
        index_limit=2000,
        eval_limit=2,
        engine="hf",
        train_steps=2,
        train_set="qa_pool",
        train_overrides=("logging.progress=false", "logging.tensorboard=false"),
        eval_overrides=("--max-tokens", "32", "--max-turns", "2"),
        sampled_n=2,
        search_limit=2,
    ),
}

#: What the report's curves show, one panel each, from every training step. Where groups are left out of the update
#: (``rollout.uniform_groups=drop``, ``rollout.filter_groups``) both rewards are drawn: every sampled group's (the
#: policy's) and the kept groups'; ``filter/informative_frac`` is not: it is 1 by construction there.
CURVES = ("reward/mean", "response/answered_frac", "search/per_traj", "kl/mean")
FILTERED_CURVES = ("filter/sampled_reward_mean", "reward/mean", "filter/first_round_informative_frac",
                   "response/answered_frac", "search/per_traj", "kl/mean")
#: Why the curves that often stay flat are drawn anyway (the report says it under the figure).
FLAT_PANELS_NOTE = ("The format rate and the searches per question are often flat (the starter ends every answer in "
                    "`<answer>` and searches once); they stay because a collapse of the format shows there first. "
                    "Not drawn: the share of *trained* groups whose rewards differ, 1 at every step "
                    + FLAT_BY_CONSTRUCTION["filter/informative_frac"][1] + ".")


def _bar(total: int, desc: str, unit: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not sys.stderr.isatty(), leave=True)


def _search_slice_size(limit: int) -> tuple[list[str], int]:
    """The recorded search slice's datasets and how many of its questions ``--slice search --limit limit`` evaluates."""
    from tasks.multihop import search_slice_ids

    ids = search_slice_ids()
    return list(ids), sum(min(limit, len(v)) for v in ids.values())


def _count_lines(paths: list[Path]) -> int:
    n = 0
    for p in paths:
        try:
            with open(p, "rb") as f:
                n += sum(1 for line in f if line.endswith(b"\n"))
        except FileNotFoundError:
            pass
    return n


class _StepLines:
    """The training stage's progress per step, read from its ``metrics.jsonl``: the reward of the step's sampled
    trajectories, its informative groups and the ETA -- as the bar's postfix on a terminal, and as one plain line
    per step when the output is not a terminal (CI logs, ``make demo > log``), so a long stage never sits silent."""

    def __init__(self, metrics: Path, total: int, groups_per_step: int, *, tty: bool | None = None) -> None:
        self.metrics, self.total, self.groups = metrics, total, groups_per_step
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.rows: list[dict[str, float]] = []
        self.postfix = ""

    def __call__(self) -> int:
        """Steps done so far (what drives the bar); prints the plain line of every new step."""
        try:
            lines = self.metrics.read_text().split("\n")[:-1]  # the last piece is empty or a line still being written
        except FileNotFoundError:
            return 0
        for line in lines[len(self.rows):]:
            self.rows.append(json.loads(line))
            self.postfix = self.describe()
            if not self.tty:
                print(f"  train {self.postfix}", flush=True)
        return len(self.rows)

    def describe(self) -> str:
        m = self.rows[-1]
        reward = float(m.get("filter/sampled_reward_mean", m["reward/mean"]))
        informative = float(m.get("filter/informative_groups", (1.0 - m["reward/zero_variance_groups"]) * self.groups))
        first = float(m.get("filter/first_round_informative_frac", 1.0 - m["reward/zero_variance_groups"])) * self.groups
        step_s = sum(float(r.get("time/step", 0.0)) for r in self.rows) / len(self.rows)
        left = max(0, self.total - len(self.rows)) * step_s
        return (f"step {len(self.rows)}/{self.total}: reward {reward:.2f}, informative groups {first:.0f}/{self.groups} "
                f"(trained {informative:.0f}), {step_s:.0f} s/step, ETA {left / 60:.1f} min")


class _Stages:
    """Runs stage subprocesses with their output in a log file; on Ctrl-C/SIGTERM kills the running one's
    whole process group."""

    def __init__(self, env: dict[str, str], log_dir: Path):
        self.env = env
        self.log_dir = log_dir
        self.current: subprocess.Popen | None = None
        self.t0 = time.monotonic()
        self.logs: dict[str, str] = {}
        self.seconds: dict[str, float] = {}
        self.n = 0

    def banner(self, n: int, total: int, text: str) -> None:
        elapsed = time.monotonic() - self.t0
        print(f"\n\033[1m[{n}/{total}] {text}\033[0m  (t+{elapsed / 60:.1f} min)", flush=True)

    def log_path(self, name: str) -> Path:
        self.n += 1
        path = self.log_dir / f"{self.n}-{name}.log"
        self.logs[name] = str(path)
        return path

    def run(self, name: str, args: list[str], *, progress: Callable[[], int] | None = None, total: int = 0,
            unit: str = "it") -> None:
        """``emapg ARGS`` with stdout/stderr in ``logs/<n>-<name>.log``; ``progress()`` (polled) drives a
        bar to ``total`` (a :class:`_StepLines` also sets the bar's postfix)."""
        cmd = [*emapg_command(), *args]
        log = self.log_path(name)
        t = time.monotonic()
        with open(log, "w") as f:
            self.current = subprocess.Popen(cmd, env=self.env, cwd=REPO_ROOT, start_new_session=True, stdout=f,
                                            stderr=subprocess.STDOUT)
        bar = _bar(total, name, unit) if progress else None
        try:
            while (code := self.current.poll()) is None:
                time.sleep(0.5)
                if bar is not None:
                    self._advance(bar, progress, total)
            if bar is not None:
                self._advance(bar, progress, total)
                bar.close()
        finally:
            self.kill()
        self.seconds[name] = time.monotonic() - t
        if code != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
            raise UserError(f"stage `emapg {' '.join(args[:2])}` failed with exit code {code}; its log is {log}:\n{tail}")

    @staticmethod
    def _advance(bar: Any, progress: Callable[[], int], total: int) -> None:
        done = progress()
        bar.n = min(done, total) if total else done
        if getattr(progress, "postfix", ""):
            bar.set_postfix_str(progress.postfix, refresh=False)  # type: ignore[attr-defined]
        bar.refresh()

    def kill(self) -> None:
        proc, self.current = self.current, None
        if proc is not None:
            stop_process_group(proc, signal.SIGINT, grace_s=20)  # SIGINT lets the stage save and clean up first


def _quiet_libraries() -> None:
    import logging

    logging.getLogger().setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()


def _example_trajectories(eval_dir: Path, n: int = 2) -> str:
    """A few full trajectories (prompt excluded) from the trained policy's per-item results."""
    blocks = []
    for items in sorted((eval_dir / "items").glob("*.jsonl"))[:n]:
        line = items.read_text().splitlines()[0] if items.stat().st_size else ""
        if not line:
            continue
        row = json.loads(line)
        text = row.get("response") or row.get("trajectory") or ""
        blocks.append(
            f"**{items.stem}** — question: {row.get('question')!s}  \n"
            f"gold: {row.get('golds') or row.get('answers')} · prediction: {row.get('prediction')!r}\n\n"
            f"{_text_block(str(text)[:3000])}\n"
        )
    return "\n".join(blocks)


def _text_block(text: str) -> str:
    """``text`` as a fenced Markdown block whose fence is longer than any run of backticks in it, so a trajectory
    that writes a fence of its own cannot end the block and have the rest rendered as Markdown."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def _two_search_trajectories(out: Path) -> tuple[dict[str, dict[str, int]], list[str]]:
    """Per policy (``base``, ``trained``), how many of its evaluated trajectories (greedy and sampled, every question)
    searched at least twice, and the report's section showing one of them: the trained policy's before the starter's,
    search-slice questions first, greedy before sampled, a right answer preferred; it says so when none did."""
    from eval.items import items_file, read_items

    counts: dict[str, dict[str, int]] = {}
    found: list[tuple[str, str, int, dict[str, Any], dict[str, Any]]] = []
    for label in ("trained", "base"):
        total = twice = 0
        for suffix in ("_search", "_search_sampled", "", "_sampled"):
            folder = out / f"eval_{label}{suffix}"
            for ds in QA_DATASETS:
                for r in read_items(folder, ds) if items_file(folder, ds).is_file() else ():
                    for k, sample in enumerate(r.get("samples") or ()):
                        total += 1
                        if int(sample.get("searches") or 0) >= 2:
                            twice += 1
                            found.append((label, suffix, k, r, sample))
        counts[label] = {"trajectories": total, "searched_twice": twice}
    lines = ["## A held-out trajectory with two searches", ""]
    if not found:
        return counts, lines + [f"None of the {counts['trained']['trajectories']} trained and {counts['base']['trajectories']} "
                                "starter trajectories evaluated (greedy and sampled) searched twice.", ""]
    label, suffix, k, r, sample = next((f for f in found if (f[4].get("scores") or {}).get("em")), found[0])
    flags = sample.get("search_gold") or []
    queries = " → ".join(f"`{q}`" + (" (its passages show the gold)" if i < len(flags) and flags[i] else "")
                         for i, q in enumerate(sample.get("queries") or []))
    em = (sample.get("scores") or {}).get("em")
    how = f"sample {k + 1}" if suffix.endswith("_sampled") else "greedy"
    return counts, lines + [
        f"Trajectories that searched at least twice: trained {counts['trained']['searched_twice']} of "
        f"{counts['trained']['trajectories']}, starter {counts['base']['searched_twice']} of {counts['base']['trajectories']} "
        "(greedy and sampled, every question evaluated). One of them:", "",
        f"**{r.get('dataset')}** `{r.get('id')}` ({'trained' if label == 'trained' else 'starter'} policy, {how}"
        f"{', a search-slice question' if '_search' in suffix else ''}) — question: {r.get('question')}  ",
        f"gold: {r.get('golds')} · queries: {queries} · prediction: {sample.get('prediction')!r} · EM {em}", "",
        _text_block(str(sample.get("response") or "")[:3000]), ""]


def _sampled_learning(out: Path) -> dict[str, Any]:
    """The sampled evaluations compared (:func:`eval.learning.compare_sampled`): over all the demo's held-out
    questions, and over those of them in the reader slice (:mod:`eval.reader_slice`): ``reader_questions`` counts
    them (:func:`eval.reader_slice.evaluated_in_slice`); ``reader`` is their comparison, None when the count is 0.
    ``search``: the search-slice questions' own evaluations compared, sampled (``sampled``) and greedy (``greedy``,
    :func:`eval.learning.compare_learning`); None when the demo evaluated none."""
    from eval.learning import compare_learning, compare_sampled, evaluated_datasets, samples_per_question
    from eval.reader_slice import evaluated_in_slice, load_reader_slice

    base, trained = out / "eval_base_sampled", out / "eval_trained_sampled"
    datasets = evaluated_datasets(base)  # as emapg view's summary pools them
    in_slice = evaluated_in_slice(base, datasets, load_reader_slice())
    questions = sum(len(ids) for ids in in_slice.values())
    reader = compare_sampled(base, trained, datasets, only=in_slice) if questions else None
    search = None
    if (out / "eval_trained_search_sampled").is_dir():
        search_datasets = evaluated_datasets(out / "eval_base_search_sampled")
        search = {"sampled": compare_sampled(out / "eval_base_search_sampled", out / "eval_trained_search_sampled", search_datasets),
                  "greedy": compare_learning(out / "eval_base_search", out / "eval_trained_search", search_datasets)}
    return {"samples": samples_per_question(base, datasets), "all": compare_sampled(base, trained, datasets),
            "reader": reader, "reader_questions": questions, "search": search}


def _search_slice_results(sampled: dict[str, Any]) -> dict[str, Any]:
    """results.json's ``search_slice``: ``questions`` (search-slice questions evaluated beside the held-out sample);
    when > 0, sampled mean@k EM (``sampled_em_start``, ``sampled_em_end``, ``difference``) and greedy EM
    (``greedy_em_start``, ``greedy_em_end``, ``greedy_difference``) over them, percent."""
    out: dict[str, Any] = {"file": "data/qa/search_slice.json", "questions": 0}
    if sampled["search"] is not None:
        s, g = sampled["search"]["sampled"]["mean_em"]["pooled"], sampled["search"]["greedy"]["pooled"]
        out.update(questions=s["n"], sampled_em_start=s["base"], sampled_em_end=s["trained"], difference=s["difference"],
                   greedy_em_start=g["base"], greedy_em_end=g["trained"], greedy_difference=g["difference"])
    return out


def _reader_slice_results(sampled: dict[str, Any]) -> dict[str, Any]:
    """results.json's ``reader_slice``. Contract: ``questions`` (the demo's held-out questions in the recorded slice);
    when > 0, ``sampled_em_start`` and ``sampled_em_end`` (sampled mean@k EM, percent, over those questions)."""
    out: dict[str, Any] = {"file": "data/qa/reader_slice.json", "questions": sampled["reader_questions"]}
    if sampled["reader"] is not None:
        pooled = sampled["reader"]["mean_em"]["pooled"]
        out.update(compared=pooled["n"], sampled_em_start=pooled["base"], sampled_em_end=pooled["trained"],
                   difference=pooled["difference"])
    return out


def _add_search(results: dict[str, Any], out: Path) -> None:
    """Searches per question (greedy, every question evaluated) of both policies, and the per-slice search metrics
    (:mod:`eval.search_metrics`) under ``search``. Contract: ``base.searches_per_question``, ``trained.searches_per_question``."""
    from eval.search_metrics import demo_section

    results["search"] = demo_section(out, list(QA_DATASETS))
    for label in ("base", "trained"):
        results[label]["searches_per_question"] = results["search"][label]["all"].get("greedy_searches_per_question")


def _results(preset_name: str, preset: DemoPreset, out: Path, train_dir: Path, learning: dict[str, Any],
             pool: dict[str, int], stages: _Stages, sampled: dict[str, Any]) -> dict[str, Any]:
    """results.json of the report. Contract: ``base.pooled_em`` and ``trained.pooled_em`` (greedy EM, percent, over
    all held-out questions), ``base.sampled_em`` and ``trained.sampled_em`` (sampled mean@k EM, percent, pooled over
    the same questions), ``training.steps`` and ``training.trajectories_per_min``."""
    from eval.learning import miss_breakdown
    from trainer.tracking import read_metrics

    runs = {label: json.loads((out / f"eval_{label}" / "results.json").read_text()) for label in ("base", "trained")}
    steps = read_metrics(train_dir)
    pooled = learning["pooled"]
    s_all, s_reader = sampled["all"], sampled["reader"]

    def sampled_side(side: str) -> dict[str, Any]:
        return {"sampled_em": s_all["mean_em"]["pooled"][side], "sampled_f1": s_all["mean_f1"]["pooled"][side],
                f"pass_at_{sampled['samples']}": s_all["pass"]["pooled"][side],
                "reader_sampled_em": s_reader["mean_em"]["pooled"][side] if s_reader else None}

    return {
        "preset": preset_name,
        "primary_metric": "sampled_em",
        "base": {"pooled_em": pooled["base"], "model": runs["base"]["model"], "average": runs["base"]["average"],
                 "format_rate": pooled["format_rate"]["base"], **sampled_side("base")},
        "trained": {"pooled_em": pooled["trained"], "model": runs["trained"]["model"],
                    "average": runs["trained"]["average"], "format_rate": pooled["format_rate"]["trained"], **sampled_side("trained")},
        "difference": {"pooled_em": pooled["difference"], "sampled_em": s_all["mean_em"]["pooled"]["difference"],
                       "sampled_f1": s_all["mean_f1"]["pooled"]["difference"], "pass": s_all["pass"]["pooled"]["difference"],
                       "reader_sampled_em": s_reader["mean_em"]["pooled"]["difference"] if s_reader else None,
                       "datasets": {ds: b["difference"] for ds, b in learning["datasets"].items()}},
        "sampled": {"samples": sampled["samples"], "temperature": _train_config(preset).rollout.temperature, "seed": SAMPLING_SEED,
                    "all": s_all, "reader": s_reader,
                    "reader_questions": sampled["reader_questions"], "search": sampled["search"]},
        "reader_slice": _reader_slice_results(sampled),
        "search_slice": _search_slice_results(sampled),
        "heldout": {"datasets": list(QA_DATASETS), "per_dataset": preset.eval_limit, "data_seed": 0, "questions": pooled["n"],
                    "protocol": runs["base"]["protocol"]},
        "learning": learning,
        "misses": {label: dataclasses.asdict(miss_breakdown(out / f"eval_{label}", list(QA_DATASETS))) for label in runs},
        "datasets": {name: {label: runs[label]["datasets"][name] for label in runs} for name in runs["base"]["datasets"]},
        "average": {label: runs[label]["average"] for label in runs},
        "models": {label: runs[label]["model"] for label in runs},
        "training": {"steps": len(steps), "wall_s": stages.seconds.get("train"), "train_set": preset.train_set,
                     "questions": pool, "metrics": steps, **_training_summary(steps, stages.seconds.get("train"), _groups_per_step(preset),
                                                                              _train_config(preset).rollout.n_samples)},
        "stage_seconds": stages.seconds,
        "logs": stages.logs,
        "plan": _plan_beside(train_dir, steps),
    }


def _plan_beside(train_dir: Path, steps: list[dict[str, float]]) -> dict[str, Any] | None:
    """The training run's plan (``emapg plan``) beside its measured peak memory and step time."""
    from trainer.plan.compare import plan_beside_measured

    return plan_beside_measured(train_dir, steps)


def _plan_section(compared: dict[str, Any] | None) -> list[str]:
    """The report's "Plan against measured" section (none without a plan)."""
    from trainer.plan.compare import plan_lines

    lines = plan_lines(compared)
    return ["## Plan against measured", "", *lines, ""] if lines else []


def _sampling_lines(steps: list[dict[str, float]]) -> list[str]:
    """The dynamic-sampling line of the report (none when ``rollout.filter_groups`` was off)."""
    rows = [m for m in steps if "filter/informative_frac" in m]
    if not rows:
        return []
    informative = sum(m["filter/informative_frac"] for m in rows) / len(rows)
    sampled = sum(m["filter/sampled_per_trained_group"] for m in rows) / len(rows)
    reward = sum(m["filter/sampled_reward_mean"] for m in rows) / len(rows)
    return [f"- dynamic sampling (`rollout.filter_groups`): {sampled:.1f} groups generated per trained group; "
            f"{informative:.0%} of the trained groups had differing rewards (the rest carry no policy gradient); "
            f"mean reward over every sampled trajectory {reward:.3f}"]


def _pool_sources(train_set: str) -> dict[str, int]:
    """Questions of the training set per origin (``nq/test``, ``nq/train``, ...)."""
    from tasks.datasets import load_dataset

    counts: dict[str, int] = {}
    for ex in load_dataset(train_set, split="train"):
        origin = str(ex.meta.get("origin", ex.data_source))
        counts[origin] = counts.get(origin, 0) + 1
    return counts


def _training_summary(steps: list[dict[str, float]], wall_s: float | None, groups_per_step: int, group_size: int) -> dict[str, float]:
    """What moved during training: the sampled reward of the first and last steps (and of the first and second
    halves), the share of informative groups, informative groups trained and trajectories sampled per minute of the
    stage."""
    if not steps:
        return {}

    def reward(m: dict[str, float]) -> float:
        return float(m.get("filter/sampled_reward_mean", m["reward/mean"]))

    def informative_trained(m: dict[str, float]) -> float:
        return float(m.get("filter/informative_frac", 1.0 - m["reward/zero_variance_groups"]))

    half = max(1, len(steps) // 2)
    first, second = steps[:half], steps[half:] or steps[-1:]
    out = {
        "reward_first_step": reward(steps[0]), "reward_last_step": reward(steps[-1]),
        "reward_first_half": sum(map(reward, first)) / len(first), "reward_second_half": sum(map(reward, second)) / len(second),
        "informative_frac_first_step": float(steps[0].get("filter/first_round_informative_frac",
                                                          1.0 - steps[0]["reward/zero_variance_groups"])),
        "informative_frac_trained_mean": sum(map(informative_trained, steps)) / len(steps),
    }
    if wall_s:
        informative = sum(float(m.get("filter/informative_groups", informative_trained(m) * groups_per_step)) for m in steps)
        sampled = sum(float(m.get("filter/sampled_trajectories", groups_per_step * group_size)) for m in steps)
        out["informative_groups_per_min"] = informative / (wall_s / 60)
        out["trajectories_per_min"] = sampled / (wall_s / 60)  # every trajectory generated and graded (dropped groups too)
    return out


def _train_config(preset: DemoPreset) -> Any:
    """The training stage's config (its file and the preset's overrides)."""
    from trainer.config import TrainConfig

    return load_config(TrainConfig, preset.train_config, list(preset.train_overrides))


def _groups_per_step(preset: DemoPreset) -> int:
    return _train_config(preset).data.prompts_per_step


def _engine_max_model_len(preset: DemoPreset) -> int:
    """The shared engine's context: the training run's prompt + response budget (evaluation needs less)."""
    r = _train_config(preset).rollout
    return r.max_prompt_tokens + r.max_response_tokens


def _movement_lines(t: dict[str, Any]) -> list[str]:
    if "reward_first_step" not in t:
        return []
    lines = [f"- training reward (mean EM of every sampled trajectory): step 1 {t['reward_first_step']:.3f}, last step "
             f"{t['reward_last_step']:.3f}; first half of the steps {t['reward_first_half']:.3f}, second half "
             f"{t['reward_second_half']:.3f}",
             f"- groups with differing rewards (a policy gradient) in step 1's first prompt batch: "
             f"{t['informative_frac_first_step']:.0%}; among the groups trained on, over all steps: "
             f"{t['informative_frac_trained_mean']:.0%}"]
    if "informative_groups_per_min" in t:
        lines.append(f"- informative groups trained per minute of the training stage: {t['informative_groups_per_min']:.2f}; "
                     f"trajectories sampled per minute: {t['trajectories_per_min']:.1f}")
    return lines


def _sampled_lines(results: dict[str, Any]) -> list[str]:
    """The report's lead: held-out sampled accuracy (mean@k at the training temperature) next to greedy, and the
    reader slice, each with its paired interval."""
    from eval.learning import difference_text, percent_text, verdict

    smp, diff = results["sampled"], results["difference"]
    k = smp["samples"]

    def row(name: str, n: int, base: float, trained: float, d: dict[str, Any]) -> str:
        return f"| {name} | {n} | {percent_text(base)} | {percent_text(trained)} | {difference_text(d)} |"

    a = smp["all"]
    rows = ["| held-out questions, metric | n | starter (%) | trained (%) | difference (pp, 95% CI) |", "|---|---:|---:|---:|---:|",
            row(f"**all, sampled mean@{k} EM**", a["mean_em"]["pooled"]["n"], results["base"]["sampled_em"],
                results["trained"]["sampled_em"], diff["sampled_em"]),
            row(f"all, sampled mean@{k} token F1", a["mean_f1"]["pooled"]["n"], a["mean_f1"]["pooled"]["base"],
                a["mean_f1"]["pooled"]["trained"], diff["sampled_f1"]),
            row(f"all, pass@{k}", a["pass"]["pooled"]["n"], a["pass"]["pooled"]["base"], a["pass"]["pooled"]["trained"], diff["pass"]),
            row("all, greedy EM", results["learning"]["pooled"]["n"], results["base"]["pooled_em"], results["trained"]["pooled_em"],
                diff["pooled_em"])]
    if smp["reader"]:
        r = smp["reader"]["mean_em"]["pooled"]
        rows.append(row(f"reader slice, sampled mean@{k} EM", r["n"], r["base"], r["trained"], r["difference"]))
    ss = results["search_slice"]
    if ss["questions"]:
        rows += [row(f"search slice, sampled mean@{k} EM", ss["questions"], ss["sampled_em_start"], ss["sampled_em_end"],
                     ss["difference"]),
                 row("search slice, greedy EM", ss["questions"], ss["greedy_em_start"], ss["greedy_em_end"], ss["greedy_difference"])]
    lines = [f"Sampled at the training temperature (T = {smp['temperature']:g}, {k} samples per question, sampling seed "
             f"{smp['seed']} for both policies, so the samples are paired), small-compute RL shows first: it sharpens the "
             "answers the policy already samples before it flips a greedy answer. Greedy exact match is the paper's metric "
             "and is reported beside it.", "", *rows, "",
             f"Sampled mean@{k} EM over all {a['mean_em']['pooled']['n']} questions: {verdict(diff['sampled_em'])}."]
    lines.append(f"The reader slice (`data/qa/reader_slice.json`) holds the held-out questions whose gold answer the "
                 "starter was shown when it answered greedily: better reading, the skill RL can teach here, shows there "
                 f"first. {smp['reader_questions']} of these {a['mean_em']['pooled']['n']} questions are in it"
                 + (" (counted from the questions evaluated)." if smp["reader"] else ", so it has no row here."))
    if ss["questions"]:
        lines.append(f"The search slice (`data/qa/search_slice.json`) holds held-out multi-hop questions whose first search "
                     "(the question text) does not show the gold answer and a second search can: searching again, not "
                     f"reading, answers them. {ss['questions']} of them were evaluated beside the "
                     f"{a['mean_em']['pooled']['n']} (not pooled into \"all\").")
    return lines


def _report_md(results: dict[str, Any], learning: dict[str, Any], compare_md: str, examples: str, curves: str) -> str:
    from eval.learning import MissBreakdown, learning_table, verdict

    t, d = results["training"], learning["pooled"]["difference"]
    lines = [
        "# emapg demo: does EMA-PG training make the search agent better?", "",
        f"- starter policy: `{results['models']['base']}`; trained: `{results['models']['trained']}`",
        f"- training: EMA-PG (EMA anchor + Top-k reverse KL), {t['steps']} steps"
        + (f" in {t['wall_s'] / 60:.1f} min" if t["wall_s"] else "")
        + f", on `{t['train_set']}` ({sum(t['questions'].values())} questions outside every held-out split whose answer "
        "the bundled index retrieves for the question itself"
        + ("; the starter solved each in some but not all of its samples" if t["train_set"] == "qa_pool_informative" else "")
        + ": " + ", ".join(f"{k} {v}" for k, v in t["questions"].items()) + ")",
        *_sampling_lines(t["metrics"]),
        *_movement_lines(t),
        f"- held-out evaluation: {results['heldout']['per_dataset']} questions x {len(QA_DATASETS)} QA test sets "
        f"= {results['heldout']['questions']} questions, the same for both policies, protocol "
        f"`{results['heldout']['protocol']['name']}`, greedy and sampled"
        + (f"; and {results['search_slice']['questions']} search-slice questions (`data/qa/search_slice.json`) the same two "
           "ways" if results["search_slice"]["questions"] else ""), "",
        "## Held-out accuracy, sampled and greedy", "",
        *_sampled_lines(results), "",
        "![held-out EM, greedy and sampled, with paired 95% intervals](em.png)", "",
        "## Starter vs trained per dataset (greedy exact match)", "",
        learning_table(learning), "",
        f"Pooled over all {d['n']} questions: {results['base']['pooled_em']:.1f} -> {results['trained']['pooled_em']:.1f} "
        f"({d['mean']:+.1f} pp, {round(100 * d['confidence'])}% CI [{d['low']:+.1f}, {d['high']:+.1f}], "
        f"{d['method']}, {d['resamples']} resamples): {verdict(d)}.", "",
        "`emapg view` on this folder opens the demo's runs; its Summary page shows these numbers (the same code computes "
        "them) for greedy vs greedy and sampled vs sampled, and Compare goes question by question.", "",
        "## Where the misses are", "",
        "Each question's answer: right; wrong although a gold answer was in the passages the model was shown (what "
        "better reading, the skill RL can teach here, could fix); or wrong without it (another query, or a second "
        "search for a multi-hop question, was needed).", "",
        *[line for label, name in (("base", "starter"), ("trained", "trained")) for line in MissBreakdown(**results["misses"][label]).lines(name)],
        "",
        "## Training curves (every step)", "",
        f"![training curves]({curves})", "",
        "The KL panel is the per-token mean of the KL *estimate* the loss used (Top-k reverse KL: exact head "
        "over the k tokens plus a sampled tail term), not the exact KL; it can be negative."
        + (" " + FLAT_PANELS_NOTE if "filter/sampled_reward_mean" in (t["metrics"] or [{}])[0] else ""), "",
        *_plan_section(results.get("plan")),
        "## Stage logs and times", "",
        *[f"- {name}: `{path}`" + (f" ({results['stage_seconds'][name]:.0f} s)" if name in results["stage_seconds"] else "")
          for name, path in results["logs"].items()],
        "", "## All metrics", "", compare_md.split("\n", 1)[1] if compare_md.startswith("#") else compare_md,
    ]
    if examples:
        lines += ["", "## Example trajectories (trained policy)", "", examples]
    return "\n".join(lines) + "\n"


def run_demo(preset_name: str, out: Path | None) -> Path:
    from eval.learning import compare_learning, evaluated_datasets, learning_table, verdict
    from eval.report import compare_runs, plot_learning
    from provision.indexes import bundled_index, ensure_bundled_index
    from provision.retrievers import open_retriever
    from trainer.checkpoint import latest_checkpoint
    from trainer.plot import plot_runs

    preset = PRESETS[preset_name]
    out = (out or REPO_ROOT / "runs" / f"demo-{preset_name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    log_dir = out / "logs"
    log_dir.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "3")  # GiB: room for the 105 evaluation questions at once (~70k tokens)
    env.setdefault("PYTHONUNBUFFERED", "1")
    stages = _Stages(env, log_dir)
    total = 7

    def on_term(signum, frame):  # SIGTERM behaves like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    # A shell without job control starts background jobs with SIGINT ignored, and Python keeps an
    # ignored SIGINT; Ctrl-C (or kill -INT) must still stop the demo and, through it, its stages.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stages.banner(1, total, f"preparing the offline models ({preset.policy}, minilm)")
        stages.run("models", ["models", preset.policy, "minilm"])

        stages.banner(2, total, f"index of the bundled Wikipedia corpus -> {bundled_index(preset.index_limit).path}")
        t = time.monotonic()
        _quiet_libraries()  # the index is built in this process: transformers' warnings belong in its log, not here
        with open(stages.log_path("index"), "a") as index_log:
            def say(message: str) -> None:
                index_log.write(message + "\n")
                index_log.flush()
                if message.startswith(("reusing", "building", "resuming", "index ready")):
                    print(message, flush=True)

            index_dir = ensure_bundled_index(preset.index_limit, log=say)
        stages.seconds["index"] = time.monotonic() - t

        if preset.eval_limit > HELDOUT_PER_DATASET:
            raise UserError(f"preset {preset_name!r}: eval_limit {preset.eval_limit} exceeds the held-out split "
                            f"({HELDOUT_PER_DATASET} questions per QA set)")
        pool = _pool_sources(preset.train_set)
        stages.banner(3, total, f"starting the retrieval server and the generation engine ({preset.engine})")
        t = time.monotonic()
        with contextlib.ExitStack() as servers:
            retriever = servers.enter_context(open_retriever(index_dir=index_dir, log_path=log_dir / "retriever.log"))
            stages.logs["retriever"] = str(log_dir / "retriever.log")
            url = retriever.urls[0]
            print(f"retriever ready at {url} (log: {log_dir / 'retriever.log'})", flush=True)
            # One engine serves all three stages: both evaluations load their model's weights into it first
            # (`emapg eval --engine remote`), and training pushes the policy's weights before every rollout
            # (rollout.engine=remote), instead of each stage starting its own engine. The starter's evaluation
            # starts while the engine loads (both spend that time in single-threaded Python start-up) and
            # waits for its /health.
            engine = EngineServer(
                preset.policy, engine=preset.engine, max_model_len=_engine_max_model_len(preset),
                omp_num_threads=os.cpu_count() or 1, startup_timeout=ENGINE_STARTUP_S, log_path=log_dir / "engine.log",
                env={k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE", "PYTHONUNBUFFERED")})  # fmt: skip
            servers.callback(engine.stop)
            engine.launch()
            stages.logs["engine"] = str(log_dir / "engine.log")
            stages.seconds["servers"] = time.monotonic() - t
            print(f"generation engine starting at {engine.url} (log: {log_dir / 'engine.log'})", flush=True)
            eval_common = ["--suite", "qa", "--data-seed", "0", "--retriever-url", url,
                           "--engine", "remote", "--engine-urls", engine.url, "--engine-wait", str(ENGINE_STARTUP_S),
                           "--no-progress", *preset.eval_overrides]  # fmt: skip
            # (folder suffix, arguments, datasets, questions): the held-out sample, then the search-slice questions
            question_sets = [("", ["--limit", str(preset.eval_limit)], list(QA_DATASETS), preset.eval_limit * len(QA_DATASETS))]
            search_questions = 0
            if preset.search_limit:
                search_datasets, search_questions = _search_slice_size(preset.search_limit)
                question_sets.append(("_search", ["--slice", "search", "--limit", str(preset.search_limit)], search_datasets,
                                      search_questions))

            train_temperature = _train_config(preset).rollout.temperature
            sampled_args = ["--n", str(preset.sampled_n), "--temperature", str(train_temperature), "--top-p", "1.0",
                            "--seed", str(SAMPLING_SEED), *preset.sampled_overrides]

            def evaluate(label: str, model: str, name: str) -> None:
                """Greedy, then sampled (mean@k at the training temperature), on the held-out sample and then on the
                search-slice questions."""
                for suffix, which, datasets, n_questions in question_sets:
                    for folder, extra in ((f"eval_{label}{suffix}", []), (f"eval_{label}{suffix}_sampled", sampled_args)):
                        items = [out / folder / "items" / f"{ds}.jsonl" for ds in datasets]
                        stages.run(folder, ["eval", "--model", model, "--out", str(out / folder), "--name", name + suffix,
                                            *eval_common, *which, *extra],
                                   progress=lambda items=items: _count_lines(items), total=n_questions, unit="q")

            search_part = f" and {search_questions} search-slice questions" if search_questions else ""
            stages.banner(4, total, f"evaluating the starter policy on {preset.eval_limit} held-out questions x "
                                    f"{len(QA_DATASETS)} QA datasets{search_part} (greedy, then {preset.sampled_n} samples "
                                    f"each at T = {train_temperature:g})")
            try:
                evaluate("base", preset.policy, "starter")
            except UserError:
                engine.wait_healthy()  # an engine that never came up is the cause to report (its log's tail)
                raise
            engine.wait_healthy()  # returns at once: the evaluation ran on it

            stages.banner(5, total, f"training with EMA-PG for {preset.train_steps} steps on {preset.train_set} "
                                    f"({sum(pool.values())} questions, none held out)")
            train_dir = out / "train"
            metrics = train_dir / "metrics.jsonl"
            stages.run("train", ["train", "--config", str(preset.train_config), f"model.policy={preset.policy}",
                                 f"data.train={preset.train_set}", "data.split=train", f"retriever.urls=[{url}]",
                                 "retriever.index_dir=null", "rollout.engine=remote", f"rollout.engine_urls=[{engine.url}]",
                                 f"run.output_dir={train_dir}",
                                 f"run.total_steps={preset.train_steps}", *preset.train_overrides],
                       progress=_StepLines(metrics, preset.train_steps, _groups_per_step(preset)), total=preset.train_steps,
                       unit="step")  # fmt: skip
            checkpoint = latest_checkpoint(train_dir)
            if checkpoint is None:
                raise UserError(f"training finished without a checkpoint in {train_dir} (log: {stages.logs['train']})")
            print(f"trained {_count_lines([metrics])} steps; checkpoint {checkpoint}", flush=True)

            stages.banner(6, total, "evaluating the trained policy on the same questions")
            evaluate("trained", str((checkpoint / "policy").resolve()), "trained")

        stages.banner(7, total, "writing the report")
        report = out / "report"
        compare_runs([out / "eval_base", out / "eval_trained"], report, plots=False)
        compare_md = (report / "report.md").read_text()
        first_step = json.loads(metrics.read_text().splitlines()[0])
        panels = FILTERED_CURVES if "filter/sampled_reward_mean" in first_step else CURVES
        curves = plot_runs([train_dir], report / "training_curves.png", metrics=list(panels), labels=["EMA-PG"],
                           title=f"EMA-PG training on {preset.train_set} ({preset.policy})")
        learning = compare_learning(out / "eval_base", out / "eval_trained", evaluated_datasets(out / "eval_base"))
        sampled = _sampled_learning(out)
        plot_learning({"greedy EM": learning, f"sampled mean@{sampled['samples']} EM": sampled["all"]["mean_em"]}, report / "em.png")
        results = _results(preset_name, preset, out, train_dir, learning, pool, stages, sampled)
        _add_search(results, out)
        results["two_searches"], two_search_md = _two_search_trajectories(out)
        (report / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        md = _report_md(results, learning, compare_md, _example_trajectories(out / "eval_trained"), curves.name)
        md = md.rstrip("\n") + "\n\n" + "\n".join([*search_demo_lines(results["search"]), *two_search_md]) + "\n"
        (report / "report.md").write_text(md)
        shutil.copy2(preset.train_config, report / "train_config.yaml")
        d = learning["pooled"]["difference"]
        print("\n" + learning_table(learning), flush=True)
        ds = sampled["all"]["mean_em"]["pooled"]["difference"]
        print(f"\nheld-out sampled mean@{sampled['samples']} EM {results['base']['sampled_em']:.1f} -> "
              f"{results['trained']['sampled_em']:.1f} ({ds['mean']:+.1f} pp, 95% CI [{ds['low']:+.1f}, {ds['high']:+.1f}]): "
              f"{verdict(ds)}", flush=True)
        print(f"held-out greedy EM {results['base']['pooled_em']:.1f} -> {results['trained']['pooled_em']:.1f} "
              f"({d['mean']:+.1f} pp, 95% CI [{d['low']:+.1f}, {d['high']:+.1f}]): {verdict(d)}", flush=True)
        elapsed = (time.monotonic() - stages.t0) / 60
        print(f"\ndemo finished in {elapsed:.1f} min. Report: {report / 'report.md'}", flush=True)
        return report
    except KeyboardInterrupt:
        stages.kill()
        print("\ndemo interrupted: every process it started was stopped; the index cache is consistent.", file=sys.stderr)
        raise


@dataclass
class DemoConfig:
    """``emapg demo``: which preset, and where its run folder goes."""

    preset: PresetName = option(
        "default", help="default: the starter SmolLM2-135M search policy on the whole bundled corpus, evaluated on "
        "105 held-out questions (15 per QA set, inside data/qa/heldout.json) and 15 search-slice questions "
        "(data/qa/search_slice.json) before and after 8 EMA-PG steps on the answerable training pool (qa_pool); "
        "tiny: a random 1.7M-parameter model on a 2k-passage index (CI smoke run, ~2 min)")
    out: str | None = option(None, help="run folder (default runs/demo-<preset>-<timestamp>)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="emapg demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(p, DemoConfig)
    return p


def main(argv: list[str]) -> int:
    cfg = config_from_args(DemoConfig, parser().parse_args(argv))
    report = run_demo(cfg.preset, Path(cfg.out) if cfg.out else None)
    print(report)  # contract: the last line is the report folder
    return 0
