"""Offline model resolution: packaged models and the tiny local Qwen2."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from emapg.errors import UserError
from emapg.models import UnknownModelError, resolve_model, tiny_qwen2_folder
from emapg.paths import CONFIG_DIR, REPO_ROOT


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


def test_paths_and_hub_names_pass_through(tmp_path, monkeypatch):
    from huggingface_hub import constants

    assert resolve_model(str(tmp_path)) == str(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # with a hub, the hub decides
    assert resolve_model("Qwen/Qwen2.5-3B") == "Qwen/Qwen2.5-3B"
    (tmp_path / "file").write_text("x")
    with pytest.raises(UnknownModelError, match="not a folder"):
        resolve_model(str(tmp_path / "file"))


def test_offline_hub_names_must_be_in_the_hub_cache(tmp_path, monkeypatch):
    """Offline, a hub name resolves only if the local hub cache has it (the real cache layout)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UnknownModelError, match=r"--model: model 'org/cached' is not a local folder.*HF_HUB_OFFLINE=1"):
        resolve_model("org/cached", option="--model")
    repo = tmp_path / "hub" / "models--org--cached"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text("{}")
    assert resolve_model("org/cached") == "org/cached"


@pytest.mark.parametrize("name, message", [
    ("/no/such/model", "model.policy: no such model folder: /no/such/model"),
    ("./relative/missing", "model.policy: no such model folder: ./relative/missing"),
    ("runs/a/b", "model.policy: no such model folder: runs/a/b"),
    ("tiny-qwen", "model.policy: model 'tiny-qwen' is not a local folder, an alias"),
    ("not a name", "model.policy: model 'not a name' is not a folder, an alias"),
    ("", "model.policy: empty model name"),
])
def test_names_that_resolve_to_nothing_are_one_clear_error(name, message):
    with pytest.raises(UnknownModelError) as e:
        resolve_model(name, option="model.policy")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)
    if name == "tiny-qwen":
        assert str(e.value).endswith("did you mean 'tiny-qwen2'?")


def _emapg(*argv: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    code = "import sys; from app.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_train_and_eval_clis_name_the_option_and_the_missing_model(tmp_path):
    missing = tmp_path / "no-such-model"
    p = _emapg("train", "--config", str(CONFIG_DIR / "math_tiny_cpu.yaml"), f"model.policy={missing}",
               f"run.output_dir={tmp_path / 'run'}", cwd=REPO_ROOT)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines() == [f"emapg train: error: model.policy: no such model folder: {missing}"]
    p = _emapg("eval", "--model", str(missing), "--suite", "math", "--limit", "1", "--out", str(tmp_path / "ev"), cwd=REPO_ROOT)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith(f"emapg eval: error: --model '{missing}': no such model folder: {missing}")
    p = _emapg("eval", "--model", "Org/not-cached-model", "--suite", "math", "--limit", "1", "--out", str(tmp_path / "ev"),
               cwd=REPO_ROOT)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "'Org/not-cached-model' is not a local folder" in p.stderr and len(p.stderr.strip().splitlines()) == 1


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
