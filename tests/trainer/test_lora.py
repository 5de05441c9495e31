"""LoRA helpers (trainer/lora.py) and ``model.lora``: apply, B = 0, merge, peft folders, bad input."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from emapg.config import ConfigError, load_config
from emapg.errors import UserError
from emapg.models import resolve_model
from trainer import lora as L
from trainer.config import LoraConfig, TrainConfig


def _base(path):
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def _randomise(model, seed=0, scale=0.05):
    """Non-zero adapters (fresh ones have B = 0, a no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in L.adapter_parameters(model):
            p.copy_(scale * torch.randn(p.shape, generator=g))


def _ids(seed=0, shape=(2, 9)):
    return torch.randint(0, 500, shape, generator=torch.Generator().manual_seed(seed))


def test_config_defaults_off_and_validation_names_the_key():
    assert TrainConfig().model.lora.enabled is False
    for bad, key in (("model.lora.rank=0", "model.lora.rank"), ("model.lora.rank=-2", "model.lora.rank"),
                     ("model.lora.alpha=0", "model.lora.alpha"), ("model.lora.dropout=1.0", "model.lora.dropout"),
                     ("model.lora.target_modules=[]", "model.lora.target_modules")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(TrainConfig, None, ["model.lora.enabled=true", bad, "algorithm.mini_batch_size=8"])
    assert LoraConfig(rank=8, alpha=32).scaling == 4.0


def test_only_adapters_train_and_b_zero_is_the_base(tiny_model_dir):
    base = _base(tiny_model_dir)
    x = _ids()
    with torch.no_grad():
        want = base(x).logits.clone()
    model = L.apply_lora(base, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    adapters = dict(L.adapter_parameters(model))
    assert adapters and {n for n, p in model.named_parameters() if p.requires_grad} == set(adapters)
    # 2 layers x 2 targets x (A, B)
    assert len(adapters) == 8 and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert all(torch.count_nonzero(p) == 0 for n, p in adapters.items() if ".lora_B." in n)
    with torch.no_grad():
        assert torch.equal(model(x).logits, want)


def test_no_matching_target_is_a_config_error(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules \['qkv'\] match no linear layer.*q_proj"):
        L.apply_lora(_base(tiny_model_dir), LoraConfig(target_modules=["qkv"]))


def test_matching_modules_follows_peft_suffix_rule(tiny_model_dir):
    base = _base(tiny_model_dir)
    assert L.matching_modules(base, ["q_proj"]) == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert "lm_head" not in L.matching_modules(base, ["all-linear"])
    assert len(L.matching_modules(base, ["all-linear"])) == 14


def test_merged_state_dict_is_w_plus_scaled_ba(tiny_model_dir):
    """Every adapted weight is W + (alpha/r)·B·A (checked in float64), the rest unchanged, HF-named; and a
    plain model with those weights computes what the adapted model does."""
    cfg = LoraConfig(rank=4, alpha=12.0, target_modules=["q_proj", "down_proj"])
    model = L.apply_lora(_base(tiny_model_dir), cfg)
    _randomise(model)
    state = model.state_dict()
    merged = L.merged_state_dict(state, cfg.scaling)
    plain = _base(tiny_model_dir)
    assert set(merged) == set(plain.state_dict())
    q = "base_model.model.model.layers.1.self_attn.q_proj"
    w, a, b = (state[f"{q}.{k}"].double() for k in ("base_layer.weight", "lora_A.default.weight", "lora_B.default.weight"))
    torch.testing.assert_close(merged["model.layers.1.self_attn.q_proj.weight"].double(), w + 3.0 * b @ a, rtol=0, atol=1e-6)
    assert torch.equal(merged["model.layers.1.self_attn.k_proj.weight"], plain.state_dict()["model.layers.1.self_attn.k_proj.weight"])
    plain.load_state_dict(merged)
    x = _ids(1)
    with torch.no_grad():
        torch.testing.assert_close(plain(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)


def test_adapter_folder_round_trip_in_peft_format(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    model = L.apply_lora(_base(tiny_model_dir), cfg, base_model_name_or_path=str(tiny_model_dir))
    _randomise(model, seed=3)
    folder = L.save_adapter(tmp_path / "adapter", model)
    assert L.is_adapter_folder(folder) and not L.is_adapter_folder(tiny_model_dir)
    meta = json.loads((folder / L.ADAPTER_CONFIG).read_text())
    assert meta["r"] == 4 and meta["lora_alpha"] == 8.0 and set(meta["target_modules"]) == {"q_proj", "v_proj"}
    saved = load_file(str(folder / L.ADAPTER_WEIGHTS))
    assert set(saved) == set(L.adapter_state_dict(model))
    assert all(k.startswith(L.PEFT_PREFIX) and ".default." not in k for k in saved)
    assert L.adapter_base_model(folder) == str(tiny_model_dir) and L.adapter_scaling(folder) == 2.0
    x = _ids(2)
    with torch.no_grad():
        want = model(x).logits
        # peft itself loads it ...
        again = PeftModel.from_pretrained(_base(tiny_model_dir), str(folder))
        torch.testing.assert_close(again(x).logits, want, rtol=0, atol=0)
        # ... and so do our loaders: trainable adapters, or merged into a plain model
        trainable = L.load_adapter_model(folder, trainable=True)
        assert {n for n, p in trainable.named_parameters() if p.requires_grad} == {n for n, _ in L.adapter_parameters(trainable)}
        merged = L.load_merged_model(folder)
        assert not any(".lora_" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(x).logits, want, rtol=1e-5, atol=1e-5)


def test_base_named_by_alias_resolves(tiny_model_dir, tmp_path, monkeypatch):
    """``base_model_name_or_path: tiny-qwen2`` (an alias of emapg.models) loads where the alias resolves."""
    monkeypatch.setenv("EMAPG_CACHE", str(tmp_path / "cache"))
    model = L.apply_lora(_base(tiny_model_dir), LoraConfig(rank=2, target_modules=["q_proj"]), base_model_name_or_path="tiny-qwen2")
    folder = L.save_adapter(tmp_path / "a", model)
    assert json.loads((folder / L.ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == "tiny-qwen2"
    assert L.adapter_base_model(folder) == resolve_model("tiny-qwen2")


def test_bad_adapter_folders_are_user_errors(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / L.ADAPTER_CONFIG).write_text("{not json")
    with pytest.raises(UserError, match="not a readable adapter config"):
        L.adapter_base_model(tmp_path / "a")
    (tmp_path / "a" / L.ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    with pytest.raises(UserError, match="names no base_model_name_or_path"):
        L.adapter_base_model(tmp_path / "a")
    (tmp_path / "a" / L.ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "PROMPT_TUNING"}))
    with pytest.raises(UserError, match="not a LoRA adapter"):
        L.adapter_base_model(tmp_path / "a")


def test_resolve_model_finds_a_lora_run_policy(tiny_model_dir, tmp_path):
    model = L.apply_lora(_base(tiny_model_dir), LoraConfig(rank=2, target_modules=["q_proj"]))
    L.save_adapter(tmp_path / "run" / "step_3" / "policy", model)
    (tmp_path / "run" / "latest").write_text("step_3\n")
    assert resolve_model(str(tmp_path / "run")) == str(tmp_path / "run" / "step_3" / "policy")
    assert resolve_model(str(tmp_path / "run" / "step_3")) == str(tmp_path / "run" / "step_3" / "policy")


def test_benchmark_shape_formula_counts_real_models(tiny_model_dir, monkeypatch):
    """benchmarks/lora.py computes Qwen2.5-3B's costs from shapes; the same formula counts a real model's
    parameters (full and LoRA) exactly, and the 3B figures meet the issue's >= 50x target."""
    import importlib.util
    import sys

    from emapg.paths import REPO_ROOT

    spec = importlib.util.spec_from_file_location("bench_lora", REPO_ROOT / "benchmarks" / "lora.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_lora", bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    base = _base(tiny_model_dir)
    shape = bench.DecoderShape.from_hf_config(base.config)
    assert shape.qkv_bias and shape.tied
    assert shape.full_params() == sum(p.numel() for p in base.parameters())
    model = L.apply_lora(base, LoraConfig(rank=16))
    assert shape.lora_params(16) == sum(p.numel() for _, p in L.adapter_parameters(model))
    costs = bench.exact_costs(bench.QWEN25_3B, 16)
    assert 3.0e9 < costs["params_total"] < 3.2e9
    assert costs["anchor_plus_optimizer_memory_ratio"] >= 50 and costs["sync_bytes_ratio"] >= 50
