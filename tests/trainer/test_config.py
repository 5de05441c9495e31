"""TrainConfig: presets load and carry the paper's numbers; bad configs fail early and readably."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from emapg.config import ConfigError, load_config
from emapg.paths import CONFIG_DIR, REPO_ROOT
from trainer.config import TrainConfig
from trainer.policy import linear_warmup_constant

ENTRY = "import sys; from app.cli import main; sys.exit(main(sys.argv[1:]))"
PRESETS = sorted(p for p in CONFIG_DIR.glob("*.yaml") if not p.name.startswith("sft_"))  # sft_*: SFTConfig (test_sft.py)


def load(name: str, *overrides: str) -> TrainConfig:
    return load_config(TrainConfig, CONFIG_DIR / name, list(overrides))


def test_all_presets_exist_and_validate():
    names = {p.name for p in PRESETS}
    for required in (
        "search_qwen2.5-3b_emapg.yaml", "search_qwen2.5-3b_grpo.yaml", "math_r1distill-1.5b_emapg.yaml",
        "math_r1distill-1.5b_grpo.yaml", "search_smollm2_cpu.yaml", "search_tiny_cpu.yaml", "math_tiny_cpu.yaml",
    ):
        assert required in names
    for p in PRESETS:
        cfg = load_config(TrainConfig, p)
        assert (cfg.data.prompts_per_step * cfg.rollout.n_samples) % cfg.algorithm.mini_batch_size == 0


def test_paper_search_preset_numbers():
    c = load("search_qwen2.5-3b_emapg.yaml")
    assert (c.data.prompts_per_step, c.rollout.n_samples) == (512, 5)
    assert c.data.prompts_per_step * c.rollout.n_samples // c.algorithm.mini_batch_size == 10  # 10 optimizer steps per rollout batch
    assert (c.algorithm.clip_low, c.algorithm.clip_high, c.algorithm.dual_clip) == (0.2, 0.28, None)
    kl = c.algorithm.kl
    assert (kl.type, kl.topk, kl.coef, kl.tail_sampling, kl.importance_weight, kl.iw_clip) == ("topk_reverse", 32, 0.001, True, True, None)
    assert (c.algorithm.ema.decay, c.algorithm.ema.period) == (0.9, 10)
    assert (c.optim.lr, c.optim.betas, c.optim.weight_decay, c.optim.grad_clip) == (1e-6, [0.9, 0.95], 0.01, 1.0)
    assert c.run.total_steps == 1005 and c.warmup_steps == 286  # int(0.285 * 1005)
    r = c.rollout
    assert (r.max_turns, r.max_tokens_per_turn, r.max_obs_tokens, r.topk, r.temperature, r.top_p) == (4, 500, 500, 3, 1.0, 0.95)
    assert c.algorithm.entropy_coef == 0.0


def test_paper_search_grpo_baseline_differs_only_where_section_3_2_says():
    e, g = load("search_qwen2.5-3b_emapg.yaml"), load("search_qwen2.5-3b_grpo.yaml")
    assert g.algorithm.kl.type == "k3" and g.algorithm.kl.coef == 0.001 and not g.algorithm.kl.importance_weight
    assert g.algorithm.clip_high == 0.2 and g.optim.betas == [0.9, 0.999] and g.algorithm.entropy_coef == 0.001
    assert g.algorithm.ema.decay == 1.0
    assert (g.data, g.rollout, g.optim.lr, g.run.total_steps) == (e.data, e.rollout, e.optim.lr, e.run.total_steps)


def test_paper_math_preset_numbers():
    c = load("math_r1distill-1.5b_emapg.yaml")
    assert (c.data.prompts_per_step, c.rollout.n_samples) == (128, 8)
    assert c.data.prompts_per_step * c.rollout.n_samples // c.algorithm.mini_batch_size == 2
    assert (c.algorithm.kl.type, c.algorithm.kl.importance_weight, c.algorithm.loss_agg, c.algorithm.dual_clip) == (
        "k3", False, "seq-mean-token-mean", 3.0)
    assert (c.algorithm.ema.decay, c.algorithm.ema.period) == (0.95, 10)
    assert (c.optim.betas, c.warmup_steps) == ([0.9, 0.999], 0)
    assert (c.rollout.temperature, c.rollout.top_p, c.rollout.max_response_tokens) == (1.0, 1.0, 8192)
    g = load("math_r1distill-1.5b_grpo.yaml")
    assert g.algorithm.ema.decay == 1.0 and g.algorithm.kl == c.algorithm.kl


def test_paper_presets_cite_algorithm_md_next_to_numbers():
    for name in ("search_qwen2.5-3b_emapg.yaml", "math_r1distill-1.5b_emapg.yaml"):
        for line in (CONFIG_DIR / name).read_text().splitlines():
            key, _, value = line.partition(":")
            value = value.split("#")[0].strip()
            if value and any(ch.isdigit() for ch in value) and key.strip() in {
                "total_steps", "prompts_per_step", "n_samples", "max_turns", "topk", "coef", "decay", "period", "lr",
                "betas", "clip_low", "clip_high", "mini_batch_size", "warmup_ratio", "max_tokens_per_turn",
            }:
                assert "§" in line, f"{name}: {line.strip()!r} has no § reference"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.klx.coef=1"], "unknown key 'algorithm.klx'"),
        (["algorithm.kl.type=topk_reverz"], "did you mean 'topk_reverse'"),
        (["algorithm.micro_batch_size=4", "algorithm.mini_batch_size=12"], "must divide the rollout batch"),
        (["optim.lr=abc"], "optim.lr: expected a number"),
        (["rollout.temperature=0"], "temperature must be > 0"),
        (["retriever.urls=[]", "retriever.index_dir=null"], "needs retriever.urls or retriever.index_dir"),
        (["retriever.urls=[localhost:8000]"], "not an http(s) URL"),
        (["retriever.index_dir=/nonexistent/index"], "does not exist"),
        (["algorithm.ema.decay=1.5"], "algorithm.ema.decay: expected a finite number in [0, 1], got 1.5"),
        (["algorithm.micro_batch_size=16", "algorithm.mini_batch_size=8"], "micro_batch_size must be <="),
        (["optim.betas=[0.9]"], "optim.betas"),
        (["algorithm.micro_batch_tokens=-1"], "micro_batch_tokens must be >= 0"),
        (["algorithm.micro_batch_tokens=4096", "algorithm.loss_agg=microbatch-token-mean"], "depends on which rows share a micro-batch"),
        (["retriever.wait=-1"], "retriever.wait: expected a finite number >= 0, got -1"),
        (["retriever.max_failure_rate=1.5"], "retriever.max_failure_rate: expected a finite number in [0, 1], got 1.5"),
        (["retriever.failure_patience=0"], "retriever.failure_patience must be >= 1"),
    ],
)
def test_bad_configs_fail_with_readable_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        load("search_tiny_cpu.yaml", *overrides)
    assert message in str(e.value)


def test_cli_rejects_bad_config_before_loading_a_model(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIG_DIR / "math_tiny_cpu.yaml").read_text().replace("prompts_per_step: 4", "prompts_per_step: four"))
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "HOME": str(Path.home())}
    cases = [
        ["--config", str(bad)],
        ["--config", str(CONFIG_DIR / "math_tiny_cpu.yaml"), "data.train=no_such_dataset"],
        ["--config", str(tmp_path / "missing.yaml")],
        ["--config", str(CONFIG_DIR / "math_tiny_cpu.yaml"), "run.total_steps"],
    ]
    for args in cases:
        p = subprocess.run([sys.executable, "-c", ENTRY, "train", *args], cwd=REPO_ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, (args, p.stderr)
        assert "Traceback" not in p.stderr and "Loading weights" not in p.stderr
        assert p.stderr.strip().startswith("emapg train: error:"), p.stderr


def test_topk_zero_is_a_valid_config_on_the_command_line():
    """``algorithm.kl.topk=0`` is Top-k KL with an empty head: the sampled K4/K5 estimator (it trains:
    tests/trainer/test_loop.py); with the tail switched off too there is no KL term left, named as such."""
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "HOME": str(Path.home())}
    base = [sys.executable, "-c", ENTRY, "config", "show", str(CONFIG_DIR / "search_tiny_cpu.yaml"), "algorithm.kl.topk=0"]
    ok = subprocess.run(base, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "topk: 0" in ok.stdout
    bad = subprocess.run([*base, "algorithm.kl.tail_sampling=false"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "algorithm.kl.topk" in bad.stderr and "Traceback" not in bad.stderr


def test_linear_warmup_then_constant():
    f = linear_warmup_constant(4)
    assert [f(s) for s in range(7)] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0]
    assert linear_warmup_constant(0)(0) == 1.0
