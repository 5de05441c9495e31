"""On-policy distillation end to end (algorithm.distill): tiny Qwen2 students learn from a sharpened copy (same tokenizer),
the teacher in process or behind a real ``emapg engine serve``; the student's exact reverse KL to the teacher on fixed
sequences falls; a teacher with another tokenizer stops the run before any rollout."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent.engines.launch import EngineServer
from emapg.config import ConfigError, load_config
from emapg.paths import CONFIG_DIR
from trainer.config import TrainConfig
from trainer.loop import Trainer

FAST = ["logging.progress=false", "data.prompts_per_step=2", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2",
        "rollout.max_tokens_per_turn=16", "rollout.max_response_tokens=16", "run.save_every=0", "logging.tensorboard=false"]
KEY = "distill-key"


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("distill") / "teacher"
    shutil.copytree(tiny_model_dir, d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.no_grad():  # a sharper teacher (its final norm x4): a large KL with a clear direction
        model.model.norm.weight.mul_(4.0)
    model.save_pretrained(d)
    return d


def _cfg(tmp_path, tiny_model_dir, *extra):
    return load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [
        f"run.output_dir={tmp_path}", f"model.policy={tiny_model_dir}", *FAST, "algorithm.distill.enabled=true", *extra])


def _reverse_kl(model, teacher, ids):
    """Exact KL(student || teacher) per position, averaged, on fixed sequences."""
    with torch.no_grad():
        a = model(input_ids=ids).logits.float().log_softmax(-1)
        b = teacher(input_ids=ids).logits.float().log_softmax(-1)
    return float((a.exp() * (a - b)).sum(-1).mean())


def _run(cfg, teacher_dir, steps):
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, 300, (4, 24), generator=torch.Generator().manual_seed(0))
    t = Trainer(cfg).setup()
    kls, history = [], []
    try:
        kls.append(_reverse_kl(t.policy.model, teacher, ids))
        for _ in range(steps):
            history.append(t.train_step())
            kls.append(_reverse_kl(t.policy.model, teacher, ids))
    finally:
        t.close()
    return kls, history


def test_distillation_moves_the_student_towards_the_teacher(tmp_path, tiny_model_dir, teacher_dir):
    """k = the vocabulary (2048): the Top-k estimator is the exact reverse KL at every visited prefix, so small steps
    (Adam, lr 1e-4: the tiny model's KL is sharply curved) lower the student's KL to the teacher at every step,
    also on sequences it never sampled."""
    cfg = _cfg(tmp_path, tiny_model_dir, f"algorithm.distill.teacher={teacher_dir}", "algorithm.distill.estimator=topk_reverse_kl",
               "algorithm.distill.mode=alone", "algorithm.distill.topk=2048", "optim.lr=1e-4", "algorithm.kl.type=topk_reverse",
               "algorithm.kl.topk=4")
    kls, history = _run(cfg, teacher_dir, 3)
    assert all(b < a for a, b in zip(kls, kls[1:])), kls
    for m in history:
        assert m["distill/tokens"] > 0 and m["distill/token_frac"] == 1.0 and m["time/teacher"] >= 0
        assert math.isfinite(m["distill/reverse_kl"]) and m["distill/value_mean"] > 0  # the exact KL is positive


@pytest.mark.parametrize("mode", ["added", "below_best"])
def test_sampled_estimator_modes(tmp_path, tiny_model_dir, teacher_dir, mode):
    cfg = _cfg(tmp_path, tiny_model_dir, f"algorithm.distill.teacher={teacher_dir}", "algorithm.distill.estimator=sampled_reverse_kl",
               f"algorithm.distill.mode={mode}", "optim.lr=1e-4")
    _, history = _run(cfg, teacher_dir, 2)
    for m in history:
        assert math.isfinite(m["distill/loss"]) and math.isfinite(m["loss/pg"])
        if mode == "added":
            assert m["distill/token_frac"] == 1.0
        elif m["reward/mean"] in (0.0, 1.0):  # below_best: every group's rewards are equal, no row is below its best
            assert m["distill/tokens"] == 0.0


def test_remote_teacher_trains_like_the_in_process_teacher(tmp_path, tiny_model_dir, teacher_dir, monkeypatch):
    """The same run (seeds, samples) with the teacher in process and behind `emapg engine serve`: the same distillation
    metrics at every step (the scores agree to float noise, tests/trainer/test_teacher.py)."""
    common = ["algorithm.distill.estimator=topk_reverse_kl", "algorithm.distill.mode=added", "algorithm.distill.topk=16",
              "algorithm.distill.coef=2.0", "optim.lr=1e-4", "algorithm.kl.enabled=false"]
    _, local = _run(_cfg(tmp_path / "local", tiny_model_dir, f"algorithm.distill.teacher={teacher_dir}", *common), teacher_dir, 2)
    monkeypatch.setenv("EMAPG_ENGINE_API_KEY", KEY)
    with EngineServer(teacher_dir, engine="hf", api_key=KEY, max_model_len=256, log_path=tmp_path / "teacher.log") as server:
        _, remote = _run(_cfg(tmp_path / "remote", tiny_model_dir, f"algorithm.distill.teacher_urls=[{server.url}]", *common),
                         teacher_dir, 2)
    for a, b in zip(local, remote):
        assert a["distill/tokens"] == b["distill/tokens"] > 0
        for key in ("distill/reverse_kl", "distill/value_mean", "distill/loss", "loss/pg"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), key


def test_a_teacher_with_another_tokenizer_stops_the_run(tmp_path, tiny_model_dir, teacher_dir):
    other = tmp_path / "other"
    shutil.copytree(teacher_dir, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<zz_new_token>"])
    tok.save_pretrained(other)
    cfg = _cfg(tmp_path / "run", tiny_model_dir, f"algorithm.distill.teacher={other}")
    with pytest.raises(ConfigError, match="differs from the policy's tokenizer"):
        Trainer(cfg).setup(with_engine=False)
