"""Offline model resolution: packaged models and the tiny local Qwen2."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from emapg.models import resolve_model, tiny_qwen2_folder


def test_tiny_qwen2_is_deterministic_and_loads(tmp_path, tiny_model_dir):
    other = tiny_qwen2_folder(tmp_path / "again")
    a = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    b = AutoModelForCausalLM.from_pretrained(other)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "<think> x </think> <search> Paris </search>"
    assert tok.decode(tok(text).input_ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((tiny_model_dir / "config.json").read_text())["head_dim"] == 64  # vLLM CPU needs >= 64


def test_paths_and_hub_names_pass_through(tmp_path):
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("Qwen/Qwen2.5-3B") == "Qwen/Qwen2.5-3B"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        resolve_model(str(tmp_path / "file"))


def test_minilm_is_packaged():
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(resolve_model("minilm"), device="cpu")
    emb = model.encode(["Paris is the capital of France."], normalize_embeddings=True)
    assert emb.shape == (1, 384)


def test_smollm2_converts_to_a_plain_folder(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert model.config.model_type == "llama" and not hasattr(model.config, "quantization_config")
    assert sum(p.numel() for p in model.parameters()) > 100_000_000
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])


def test_run_and_checkpoint_folders_resolve_to_the_policy(tmp_path):
    run = tmp_path / "run"
    policy = run / "step_4" / "policy"
    policy.mkdir(parents=True)
    (policy / "config.json").write_text("{}")
    (run / "step_2" / "policy").mkdir(parents=True)
    (run / "latest").write_text("step_4\n")
    assert resolve_model(str(run)) == str(policy)
    assert resolve_model(str(run / "step_4")) == str(policy)
    assert resolve_model(str(policy)) == str(policy)
