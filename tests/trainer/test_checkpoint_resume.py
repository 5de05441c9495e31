"""SIGTERM saves before exiting; resume after SIGTERM or SIGKILL reproduces the uninterrupted run bit-for-bit.

Real ``emapg train`` subprocesses on the tiny math preset (no retriever needed).
"""

from __future__ import annotations

import json
import shutil
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

ENTRY = "import sys; from app.cli import main; sys.exit(main(sys.argv[1:]))"


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
    assert _tensors_equal(full / "step_4" / "policy/model.safetensors", run / "step_4" / "policy/model.safetensors")
    state = assert_states_equal(full / "step_4", run / "step_4")  # optimizer and anchor, bit for bit
    assert any(k.startswith("anchor/") for k in state) and any(k.endswith("exp_avg_sq") for k in state)


# ------------------------------------------------------------------------------------------ damaged checkpoints

from tests.fixtures.training_state import STATE_FILES, assert_states_equal  # noqa: E402
from tests.trainer.test_checkpoint import FILE_KINDS, damage  # noqa: E402

# What a trainer checkpoint holds: the optimizer and anchor in the DCP state/ folder (no optimizer.pt, anchor.safetensors).
TRAINER_FILE_KINDS = [f for f in FILE_KINDS if f not in ("anchor.safetensors", "optimizer.pt")] + STATE_FILES

SHORT = ["run.total_steps=2", "run.save_every=1", "run.keep_last=0", "logging.progress=false", "logging.tensorboard=false",
         "data.prompts_per_step=2", "rollout.n_samples=2", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2",
         "rollout.max_tokens_per_turn=8", "rollout.max_response_tokens=8", "algorithm.ema.period=1"]


def _short_cfg(out: Path):
    from emapg.config import load_config
    from trainer.config import TrainConfig

    return load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [f"run.output_dir={out}", *SHORT])


def _tensors_equal(a: Path, b: Path) -> bool:
    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory) -> Path:
    """An uninterrupted 2-step run with a checkpoint after each step (the reference every resume must reproduce)."""
    from trainer.loop import train

    run = tmp_path_factory.mktemp("reference") / "run"
    train(_short_cfg(run))
    return run


@pytest.mark.parametrize("mode", ["truncate", "flip"])
@pytest.mark.parametrize("rel", TRAINER_FILE_KINDS)
def test_resume_skips_a_damaged_latest_checkpoint_and_reproduces_the_run(two_step_run, tmp_path, caplog, rel, mode):
    """Damage one file of step_2: `--resume` warns naming it, resumes from step_1 and re-trains step 2 exactly."""
    import logging

    from trainer.checkpoint import verify_checkpoint
    from trainer.loop import train

    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    damage(run / "step_2" / rel, mode)
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        history = train(_short_cfg(run), resume="")
    assert f"checkpoint {run / 'step_2'} is damaged ({rel}: " in caplog.text
    assert f"falling back to {run / 'step_1'}" in caplog.text
    assert len(history) == 1  # only step 2 was trained again
    assert _metrics(run) == _metrics(two_step_run)
    ref, new = two_step_run / "step_2", run / "step_2"
    assert verify_checkpoint(new).intact
    assert _tensors_equal(ref / "policy" / "model.safetensors", new / "policy" / "model.safetensors")
    # the trained-questions record (eval's contamination guard) of a resumed run is the uninterrupted run's
    assert (new / "policy" / "trained_questions.json").read_text() == (ref / "policy" / "trained_questions.json").read_text()
    assert_states_equal(ref, new)  # optimizer moments and anchor, bit for bit


def test_a_run_continued_to_more_steps_is_the_longer_run(two_step_run, tmp_path):
    """studies/distill.py --extend-from: a 1-step run's checkpoint, copied into a new folder and resumed with
    run.total_steps=2, trains the uninterrupted 2-step run bit for bit (constant rate); a run of another seed is not
    continued, one of other settings or with as many steps done is refused naming why."""
    from studies.distill import continuable, extend_arm
    from emapg.config import load_config
    from trainer.config import TrainConfig
    from trainer.loop import train

    def cfg(out: Path, *extra: str) -> TrainConfig:
        return load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [f"run.output_dir={out}", *SHORT, *extra])

    short, long = tmp_path / "short", tmp_path / "long"
    train(cfg(short, "run.total_steps=1"))
    longer = cfg(long)
    assert extend_arm(short, long, longer) == 1
    assert len(train(longer, resume="")) == 1  # only step 2 was trained
    assert _metrics(long) == _metrics(two_step_run)
    ref, new = two_step_run / "step_2", long / "step_2"
    assert _tensors_equal(ref / "policy" / "model.safetensors", new / "policy" / "model.safetensors")
    assert_states_equal(ref, new)
    assert continuable(short, cfg(tmp_path / "x", "run.seed=1")) is None
    with pytest.raises(SystemExit, match="optim.lr"):
        continuable(short, cfg(tmp_path / "x", "optim.lr=2e-4"))
    with pytest.raises(SystemExit, match="1 steps done"):
        continuable(short, cfg(tmp_path / "x", "run.total_steps=1"))


def test_cli_resume_with_no_intact_checkpoint_is_one_line_naming_the_files(two_step_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(two_step_run, run)
    damage(run / "step_2" / "state" / "__0_0.distcp", "flip")
    damage(run / "step_1" / "policy" / "model.safetensors", "truncate")
    p = subprocess.run(_cmd(run, "--resume"), cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    (line,) = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert line.startswith(f"emapg train: error: cannot resume: no intact checkpoint in {run}: ")
    assert f"{run / 'step_2' / 'state' / '__0_0.distcp'}: sha256 mismatch" in line
    assert f"{run / 'step_1' / 'policy' / 'model.safetensors'}: truncated (" in line
    assert not (run / "step_3").exists()  # nothing was trained from scratch over the damaged run


def _fsdp_worker(rank: int, world: int, port: int, run: str, model_dir: str, resume: bool) -> None:
    from tests.fixtures.spawn import rank_env

    rank_env(rank, world, port)
    from emapg.config import load_config
    from trainer import distributed as D
    from trainer.config import TrainConfig
    from trainer.loop import Trainer

    cfg = load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [f"run.output_dir={run}", f"model.policy={model_dir}", *SHORT])
    trainer = Trainer(cfg, resume="" if resume else None).setup()
    try:
        assert trainer.fsdp
        assert trainer.step == (1 if resume else 0)  # every rank fell back past the damaged step_2
        trainer.train()
    finally:
        trainer.close()
    D.destroy()


def test_fsdp_ranks_agree_on_skipping_a_checkpoint_with_a_damaged_rank_file(tmp_path, tiny_model_dir):
    """2 gloo ranks: each rank's RNG file is in the manifest; damage rank 1's and both ranks resume from step_1."""
    import torch.multiprocessing as mp

    from tests.fixtures.spawn import free_port
    from trainer.checkpoint import MANIFEST, verify_checkpoint

    run = tmp_path / "run"
    mp.spawn(_fsdp_worker, args=(2, free_port(), str(run), str(tiny_model_dir), False), nprocs=2, join=True)
    listed = json.loads((run / "step_2" / MANIFEST).read_text())["files"]
    assert {"rng_rank0.pt", "rng_rank1.pt"} <= set(listed)
    reference = _metrics(run)
    original = load_file(str(run / "step_2" / "policy" / "model.safetensors"))

    damage(run / "step_2" / "rng_rank1.pt", "flip")
    (problem,) = verify_checkpoint(run / "step_2").problems
    assert problem.file.name == "rng_rank1.pt" and problem.kind == "checksum"
    mp.spawn(_fsdp_worker, args=(2, free_port(), str(run), str(tiny_model_dir), True), nprocs=2, join=True)
    assert verify_checkpoint(run / "step_2").intact
    assert [r["step"] for r in _metrics(run)] == [1, 2]
    assert _metrics(run) == reference
    resumed = load_file(str(run / "step_2" / "policy" / "model.safetensors"))
    assert all(torch.equal(original[k], resumed[k]) for k in original)
