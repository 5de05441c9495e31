"""SIGTERM saves before exiting; resume after SIGTERM or SIGKILL reproduces the uninterrupted run bit-for-bit.

Real ``emapg train`` subprocesses on the tiny math preset (no retriever needed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from emapg.paths import CONFIG_DIR, REPO_ROOT

pytestmark = pytest.mark.slow

ENTRY = "import sys; from emapg.cli import main; sys.exit(main(sys.argv[1:]))"


def _cmd(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-c", ENTRY, "train", "--config", str(CONFIG_DIR / "math_tiny_cpu.yaml"),
        f"run.output_dir={out}", "run.total_steps=4", "run.save_every=1", "run.keep_last=0", "logging.progress=false",
        "data.prompts_per_step=2", "algorithm.mini_batch_size=4", "rollout.max_tokens_per_turn=24",
        "rollout.max_response_tokens=24", "algorithm.ema.period=1", *extra,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"training exited early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{path} did not appear")
        time.sleep(0.05)


def test_sigterm_then_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    """SIGTERM: finish the step, save, exit 0. SIGKILL: lose at most the step in progress.
    Resuming after each reproduces the uninterrupted run's metrics, weights, anchor and optimizer."""
    from emapg.config import load_config
    from trainer.config import TrainConfig
    from trainer.loop import train

    full = tmp_path / "full"
    train(load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", _cmd(full)[6:]))  # same overrides, in-process

    run = tmp_path / "run"
    proc = subprocess.Popen(_cmd(run), cwd=REPO_ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for(run / "metrics.jsonl", proc)
    while not (run / "metrics.jsonl").read_text().strip():
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "stopped by signal" in stderr
    stopped = max(int(d.name.split("_")[1]) for d in run.glob("step_*"))
    assert 1 <= stopped < 4 and (run / "latest").read_text().strip() == f"step_{stopped}"

    if stopped < 3:
        proc = subprocess.Popen(_cmd(run, "--resume"), cwd=REPO_ROOT, env=_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        _wait_for(run / f"step_{stopped + 1}" / "trainer_state.json", proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        done = max(int(d.name.split("_")[1]) for d in run.glob("step_*"))
        assert stopped + 1 <= done < 4  # killed mid-run: at most the step in progress is lost

    p = subprocess.run(_cmd(run, "--resume"), cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]

    assert [r["step"] for r in _metrics(run)] == [1, 2, 3, 4]
    assert _metrics(run) == _metrics(full)
    for name in ("policy/model.safetensors", "anchor.safetensors"):
        a, b = load_file(str(full / "step_4" / name)), load_file(str(run / "step_4" / name))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    a = torch.load(full / "step_4" / "optimizer.pt", weights_only=True)
    b = torch.load(run / "step_4" / "optimizer.pt", weights_only=True)
    assert all(torch.equal(a["state"][i]["exp_avg_sq"], b["state"][i]["exp_avg_sq"]) for i in a["state"])
