"""``emapg demo``: the whole product on bundled data, on a laptop-class CPU.

1. prepare the offline policy (SmolLM2-135M-Instruct, converted once) and the encoder (MiniLM);
2. build a FAISS index of the bundled Wikipedia corpus (:func:`provision.indexes.ensure_bundled_index`:
   cached, reused only when its settings match, a killed build resumes);
3. start the retrieval server on a free local port (:func:`provision.retrievers.open_retriever`);
4. evaluate the base policy on a small sample of all seven QA benchmarks through the real retriever;
5. train it briefly with EMA-PG on the bundled NQ train sample (same retriever);
6. evaluate the trained policy on the same questions;
7. write a report (markdown table, results.json, plots, example trajectories), stop the server,
   and print the report folder as the last line.

The index is built in this process and the server runs in its own process group; every other stage
runs as its own ``emapg`` subprocess in its own process group, so Ctrl-C stops every process the demo
started. The index builder writes each chunk and finally ``meta.json`` atomically, so an interrupted
demo leaves the cache consistent (the next run resumes the build).

This is an application module (the ``emapg`` command's top floor): no library module imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from emapg.config import add_config_arguments, config_from_args, option
from emapg.errors import UserError
from emapg.paths import CONFIG_DIR, REPO_ROOT


@dataclass(frozen=True)
class DemoPreset:
    """What one demo run does; `default` fits in about 16 minutes on a fresh 2-core machine (measured 16.4)."""

    policy: str
    train_config: Path
    index_limit: int | None  # passages indexed (None: the whole bundled corpus)
    eval_limit: int  # questions per QA dataset
    engine: str
    train_overrides: tuple[str, ...] = ()
    eval_overrides: tuple[str, ...] = ()


PresetName = Literal["default", "tiny"]

PRESETS: dict[str, DemoPreset] = {
    "default": DemoPreset(
        policy="smollm2-135m-instruct",
        train_config=CONFIG_DIR / "search_smollm2_cpu.yaml",
        index_limit=None,
        eval_limit=3,
        engine="vllm",
        # Two CPU steps of 2 prompts x 4 samples (~75 s each): shows the whole loop, not a trained agent.
        # Budget on a fresh 2-core machine: index ~8 min (cached afterwards), each eval ~3.5 min.
        train_overrides=("run.total_steps=2", "run.save_every=0", "data.prompts_per_step=2",
                         "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=4", "rollout.max_tokens_per_turn=64"),
        eval_overrides=("--max-tokens", "128"),
    ),
    # CI-sized: a 1.7M-parameter random model, a 2k-passage index; checks the plumbing, not learning.
    "tiny": DemoPreset(
        policy="tiny-qwen2",
        train_config=CONFIG_DIR / "search_tiny_cpu.yaml",
        index_limit=2000,
        eval_limit=2,
        engine="hf",
        train_overrides=("run.total_steps=2",),
        eval_overrides=("--max-tokens", "32", "--max-turns", "2"),
    ),
}


class _Stages:
    """Runs stage subprocesses; on Ctrl-C/SIGTERM kills the running one's whole process group."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.current: subprocess.Popen | None = None
        self.t0 = time.monotonic()

    def banner(self, n: int, total: int, text: str) -> None:
        elapsed = time.monotonic() - self.t0
        print(f"\n\033[1m[{n}/{total}] {text}\033[0m  (t+{elapsed / 60:.1f} min)", flush=True)

    def run(self, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "emapg.cli", *args]
        self.current = subprocess.Popen(cmd, env=self.env, cwd=REPO_ROOT, start_new_session=True)
        try:
            code = self.current.wait()
        finally:
            self.kill()
        if code != 0:
            raise UserError(f"stage `emapg {' '.join(args[:2])}` failed with exit code {code} (its output is above)")

    def kill(self) -> None:
        proc, self.current = self.current, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGINT)  # let it save/clean up first
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


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
            f"```text\n{str(text)[:3000]}\n```\n"
        )
    return "\n".join(blocks)


def _write_results(path: Path, preset_name: str, out: Path, train_dir: Path) -> None:
    """results.json of the report: per dataset, every metric of the base and the trained policy."""
    runs = {label: json.loads((out / f"eval_{label}" / "results.json").read_text()) for label in ("base", "trained")}
    datasets = {
        name: {label: runs[label]["datasets"][name] for label in runs}
        for name in runs["base"]["datasets"]
    }
    steps = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = {
        "preset": preset_name,
        "primary_metric": runs["base"].get("primary_metric", "em"),
        "datasets": datasets,
        "average": {label: runs[label]["average"] for label in runs},
        "models": {label: runs[label]["model"] for label in runs},
        "training": {"steps": len(steps), "metrics": steps},
    }
    path.write_text(json.dumps(summary, indent=2))


def run_demo(preset_name: str, out: Path | None) -> Path:
    from provision.indexes import bundled_index, ensure_bundled_index
    from provision.retrievers import open_retriever
    from trainer.checkpoint import latest_checkpoint

    preset = PRESETS[preset_name]
    out = (out or REPO_ROOT / "runs" / f"demo-{preset_name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    stages = _Stages(env)
    total = 7

    def on_term(signum, frame):  # SIGTERM behaves like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    # A shell without job control starts background jobs with SIGINT ignored, and Python keeps an
    # ignored SIGINT; Ctrl-C (or kill -INT) must still stop the demo and, through it, its stages.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stages.banner(1, total, f"preparing the offline models ({preset.policy}, minilm)")
        stages.run(["models", preset.policy, "minilm"])

        stages.banner(2, total, f"index of the bundled Wikipedia corpus -> {bundled_index(preset.index_limit).path}")
        index_dir = ensure_bundled_index(preset.index_limit, log=lambda m: print(m, flush=True))

        stages.banner(3, total, "starting the retrieval server")
        with open_retriever(index_dir=index_dir, log_path=out / "retriever.log") as retriever:
            url = retriever.urls[0]
            print(f"retriever ready at {url} (log: {out / 'retriever.log'})", flush=True)
            eval_common = ["--suite", "qa", "--limit", str(preset.eval_limit), "--retriever-url", url,
                           "--engine", preset.engine, *preset.eval_overrides]  # fmt: skip

            stages.banner(4, total, f"evaluating the base policy on {preset.eval_limit} questions x 7 QA datasets")
            stages.run(["eval", "--model", preset.policy, "--out", str(out / "eval_base"), "--name", "base", *eval_common])

            stages.banner(5, total, "training with EMA-PG on the bundled NQ train sample")
            train_dir = out / "train"
            stages.run(["train", "--config", str(preset.train_config), f"model.policy={preset.policy}",
                        f"retriever.urls=[{url}]", "retriever.index_dir=null", f"run.output_dir={train_dir}",
                        "logging.progress=true", *preset.train_overrides])  # fmt: skip
            checkpoint = latest_checkpoint(train_dir)
            if checkpoint is None:
                raise UserError(f"training finished without a checkpoint in {train_dir}")
            policy = checkpoint / "policy"

            stages.banner(6, total, "evaluating the trained policy on the same questions")
            stages.run(["eval", "--model", str(policy.resolve()), "--out", str(out / "eval_trained"), "--name", "ema-pg",
                        *eval_common])  # fmt: skip

        stages.banner(7, total, "writing the report")
        report = out / "report"
        stages.run(["eval", "compare", str(out / "eval_base"), str(out / "eval_trained"), "--out", str(report)])
        stages.run(["plot", str(train_dir), "--out", str(report / "training_curves.png")])
        _write_results(report / "results.json", preset_name, out, train_dir)
        examples = _example_trajectories(out / "eval_trained")
        if examples:
            with open(report / "report.md", "a") as f:
                f.write("\n## Example trajectories (trained policy)\n\n" + examples)
        shutil.copy2(preset.train_config, report / "train_config.yaml")
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
        "default", help="default: SmolLM2-135M on the whole bundled corpus (~16 min on a fresh 2-core machine, ~9 min "
        "once the index is cached); tiny: a random 1.7M-parameter model on a 2k-passage index (CI smoke run, ~2 min)")
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
