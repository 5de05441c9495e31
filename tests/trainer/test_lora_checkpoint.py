"""LoRA runs' checkpoints: resume after SIGKILL is bit-exact, ``emapg export`` merges, ``emapg eval --model RUN_DIR`` works.

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
from transformers import AutoModelForCausalLM

from app.cli import main as emapg_main
from emapg.config import load_config
from emapg.paths import CONFIG_DIR, REPO_ROOT
from trainer import lora as L
from trainer.config import TrainConfig
from tests.fixtures.training_state import assert_states_equal
from trainer.loop import train

pytestmark = pytest.mark.slow

ENTRY = "import sys; from app.cli import main; sys.exit(main(sys.argv[1:]))"
OVERRIDES = ["run.total_steps=3", "run.save_every=1", "run.keep_last=0", "logging.progress=false", "logging.tensorboard=false",
             "data.prompts_per_step=2", "algorithm.mini_batch_size=4", "rollout.max_tokens_per_turn=16",
             "rollout.max_response_tokens=16", "algorithm.ema.period=1", "algorithm.ema.decay=0.5", "optim.lr=3e-2",
             "model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=16",
             # the tiny model scores 0 on math (no advantage): the entropy bonus gives the adapters a real gradient
             "algorithm.entropy_coef=0.01"]


def _overrides(out: Path, model: Path, *extra: str) -> list[str]:
    return [f"run.output_dir={out}", f"model.policy={model}", *OVERRIDES, *extra]


def _cmd(out: Path, model: Path, *extra: str) -> list[str]:
    return [sys.executable, "-c", ENTRY, "train", "--config", str(CONFIG_DIR / "math_tiny_cpu.yaml"), *_overrides(out, model), *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir) -> Path:
    """An uninterrupted 3-step LoRA run with a checkpoint after every step."""
    run = tmp_path_factory.mktemp("lora") / "full"
    train(load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", _overrides(run, tiny_model_dir)))
    return run


def test_resume_after_sigkill_is_bit_exact(lora_run, tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    proc = subprocess.Popen(_cmd(run, tiny_model_dir), cwd=REPO_ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (run / "step_1" / "manifest.json").exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    done = max(int(d.name.split("_")[1]) for d in run.glob("step_*"))
    assert 1 <= done < 3
    p = subprocess.run(_cmd(run, tiny_model_dir, "--resume"), cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3]
    assert _metrics(run) == _metrics(lora_run)
    name = f"policy/{L.ADAPTER_WEIGHTS}"
    a, b = load_file(str(lora_run / "step_3" / name)), load_file(str(run / "step_3" / name))
    assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a), name
    state = assert_states_equal(lora_run / "step_3", run / "step_3")  # Adam moments and EMA adapters, bit for bit
    assert any(k.startswith("anchor/") for k in state) and any(k.endswith("exp_avg_sq") for k in state)
    # the adapters really trained (else bit-exactness would be trivial)
    adapters = load_file(str(run / "step_3" / "policy" / L.ADAPTER_WEIGHTS))
    assert any(".lora_B." in k and v.abs().max() > 0 for k, v in adapters.items())


def test_export_writes_the_merged_model_and_eval_reads_the_run(lora_run, tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "merged"
    assert emapg_main(["export", str(lora_run), "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    # the merged export carries the run's trained-questions record (emapg eval's contamination guard)
    assert (out / "trained_questions.json").read_text() == (lora_run / "step_3" / "policy" / "trained_questions.json").read_text()
    assert emapg_main(["export", str(lora_run), "--out", str(out)]) == 2  # never overwrites
    assert "exists" in capsys.readouterr().err
    x = torch.tensor([[3, 17, 40, 41, 9, 11, 12]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)(x).logits
        adapted = L.load_adapter_model(lora_run / "step_3" / "policy", trainable=False)(x).logits
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)(x).logits
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)
    assert (merged - base).abs().max() > 1e-3

    def evaluate(model: Path, name: str) -> list:
        d = tmp_path / name
        rc = emapg_main(["eval", "--model", str(model), "--suite", "math", "--protocol", "math_quick", "--n", "1",
                         "--max-tokens", "12", "--datasets", "aime2024", "--limit", "2", "--engine", "hf",
                         "--grader-workers", "1", "--no-progress", "--out", str(d)])
        assert rc == 0
        return [json.loads(line)["response"] for line in (d / "items" / "aime2024.jsonl").read_text().splitlines()]

    # `--model RUN_DIR` of a LoRA run serves base + adapters; it answers as the merged export does.
    assert evaluate(lora_run, "eval_run") == evaluate(out, "eval_merged")
