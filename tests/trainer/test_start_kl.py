"""``kl/to_start`` (trainer.start_kl) equals the exact KL to the starting policy, computed here from both
models' full logits in float64, for each place the start comes from: a frozen copy (EMA-PG, full fine-tuning),
the frozen anchor (GRPO) and the base with LoRA's adapters off."""

from __future__ import annotations

import pytest
import torch

from emapg.config import load_config
from emapg.paths import CONFIG_DIR
from trainer.batch import build_token_batch
from trainer.config import TrainConfig
from trainer.loop import Trainer

TEMPERATURE = 0.8
PROMPTS = [[5, 17, 42], [7, 8], [100, 3, 9, 11]]
RESPONSES = [[12, 13, 14, 15], [16, 17], [18, 19, 20]]
MASKS = [[1, 1, 0, 1], [1, 1], [1, 0, 1]]  # an observation token (0) is not the model's


def make_trainer(tmp_path, model_dir, *overrides: str) -> Trainer:
    cfg = load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [
        f"run.output_dir={tmp_path / 'run'}", f"model.policy={model_dir}", "logging.progress=false",
        "logging.tensorboard=false", "logging.kl_to_start=true", f"rollout.temperature={TEMPERATURE}", *overrides])
    return Trainer(cfg).setup(with_engine=False)


def exact_kl_to_start(model, start) -> float:
    """Σ over the model's response tokens of Σ_v p log(p/q) at the temperature, / their count (float64)."""
    total, count = 0.0, 0
    for prompt, response, mask in zip(PROMPTS, RESPONSES, MASKS):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            z = model(input_ids=ids).logits[0].double() / TEMPERATURE
            zs = start(input_ids=ids).logits[0].double() / TEMPERATURE
        for j, m in enumerate(mask):  # response token j is predicted at position len(prompt) - 1 + j
            if m:
                pos = len(prompt) - 1 + j
                logp, logq = torch.log_softmax(z[pos], -1), torch.log_softmax(zs[pos], -1)
                total += float((logp.exp() * (logp - logq)).sum())
                count += 1
    return total / count


def perturb(params, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def measured(trainer: Trainer) -> float:
    batch = build_token_batch(PROMPTS, RESPONSES, MASKS, pad_id=0)
    sums = trainer.start_policy.kl_sums(batch, trainer.cfg, trainer.dist.device)
    assert sums["health/kl_to_start_tokens"] == sum(map(sum, MASKS))
    return sums["health/kl_to_start_sum"] / sums["health/kl_to_start_tokens"]


@pytest.mark.parametrize("overrides, kind", [
    ((), "copy"),  # EMA-PG, full fine-tuning: the anchor moves, so a frozen copy
    (("algorithm.ema.decay=1.0",), "anchor"),  # GRPO: the frozen reference is the start
])
def test_kl_to_start_is_the_exact_kl_full_fine_tuning(tmp_path, tiny_model_dir, overrides, kind):
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(tmp_path, tiny_model_dir, *overrides)
    try:
        assert trainer.start_policy.kind == kind
        assert measured(trainer) == pytest.approx(0.0, abs=1e-6)  # at the start
        perturb([p for p in trainer.policy.model.parameters() if p.requires_grad])
        start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        expected = exact_kl_to_start(trainer.policy.model.eval(), start)
        assert expected > 1e-3
        assert measured(trainer) == pytest.approx(expected, rel=1e-4)
    finally:
        trainer.close()


def test_kl_to_start_with_lora_is_the_kl_to_the_base(tmp_path, tiny_model_dir):
    trainer = make_trainer(tmp_path, tiny_model_dir, "model.lora.enabled=true")
    try:
        assert trainer.start_policy.kind == "adapters_off" and not trainer.start_policy.tensors  # no copy kept
        assert measured(trainer) == pytest.approx(0.0, abs=1e-6)
        perturb([p for n, p in trainer.policy.model.named_parameters() if "lora_B" in n], scale=0.5)
        model = trainer.policy.model.eval()
        with model.disable_adapter():
            base_logits = {}

            class Base(torch.nn.Module):  # the base's logits, recorded with the adapters off
                def forward(self, input_ids):
                    key = tuple(input_ids[0].tolist())
                    if key not in base_logits:
                        base_logits[key] = model(input_ids=input_ids).logits
                    return type("Out", (), {"logits": base_logits[key]})

            base = Base()
            for prompt, response in zip(PROMPTS, RESPONSES):
                with torch.no_grad():
                    base(torch.tensor([prompt + response]))
        expected = exact_kl_to_start(model, base)
        assert expected > 1e-3
        assert measured(trainer) == pytest.approx(expected, rel=1e-4)
    finally:
        trainer.close()


def test_kl_to_start_is_off_by_default(tmp_path, tiny_model_dir):
    cfg = load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [])
    assert cfg.logging.kl_to_start is False
