"""Resume after SIGKILL reproduces the uninterrupted run bit-for-bit; SIGTERM saves before exiting.

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


def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
    full = tmp_path / "full"
    p = subprocess.run(_cmd(full), cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(killed), cwd=REPO_ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for(killed / "step_2" / "trainer_state.json", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    done = sorted(int(d.name.split("_")[1]) for d in killed.glob("step_*"))
    assert 2 <= done[-1] < 4  # killed mid-run: at most the step in progress is lost

    p = subprocess.run(_cmd(killed, "--resume"), cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]

    assert _metrics(killed) == _metrics(full)
    assert [r["step"] for r in _metrics(killed)] == [1, 2, 3, 4]
    for name in ("policy/model.safetensors", "anchor.safetensors"):
        a, b = load_file(str(full / "step_4" / name)), load_file(str(killed / "step_4" / name))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    a = torch.load(full / "step_4" / "optimizer.pt", weights_only=True)
    b = torch.load(killed / "step_4" / "optimizer.pt", weights_only=True)
    assert all(torch.equal(a["state"][i]["exp_avg_sq"], b["state"][i]["exp_avg_sq"]) for i in a["state"])


def test_sigterm_saves_a_checkpoint_before_exiting(tmp_path):
    out = tmp_path / "run"
    cmd = _cmd(out, "run.total_steps=200", "run.save_every=0")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(out / "metrics.jsonl", proc)
    while not (out / "metrics.jsonl").read_text().strip():
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "stopped by signal" in stderr
    ckpts = sorted(out.glob("step_*"))
    assert len(ckpts) == 1
    step = int(ckpts[0].name.split("_")[1])
    assert 1 <= step < 200
    assert [r["step"] for r in _metrics(out)] == list(range(1, step + 1))
