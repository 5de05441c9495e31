"""Checkpoints: HF-loadable policy, anchor, weights_only optimizer/RNG, atomicity, keep-last-N."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.checkpoint import (
    LATEST,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_optimizer_state,
    load_scheduler_state,
    resolve_resume,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from trainer.config import TrainConfig
from trainer.data import PromptSampler
from trainer.tracking import Tracker, read_metrics


@pytest.fixture()
def tiny(tiny_model_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    ids = torch.randint(0, 2000, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    return model, tok, opt, sched


def _save(run_dir, step, model, tok, opt, sched, keep_last=0, anchor=None):
    return save_checkpoint(
        run_dir, step, policy_state=None, model=model, tokenizer=tok, anchor_state=anchor,
        optimizer_state=opt.state_dict(), scheduler_state=sched.state_dict(),
        trainer_state={"data": {"epoch": 1, "position": 5, "seed": 0, "size": 10}}, config=TrainConfig(), keep_last=keep_last,
    )


def test_round_trip_policy_anchor_optimizer_rng(tmp_path, tiny):
    model, tok, opt, sched = tiny
    anchor = {k: v.detach().clone() * 0.5 for k, v in model.state_dict().items()}
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = _save(tmp_path, 7, model, tok, opt, sched, anchor=anchor)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)

    ckpt = load_checkpoint(path)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected  # RNG restored
    assert ckpt.step == 7 and ckpt.trainer_state["data"]["position"] == 5
    assert set(ckpt.anchor_state) >= {k for k in anchor if k != "lm_head.weight"}
    assert all(torch.equal(ckpt.anchor_state[k], anchor[k]) for k in ckpt.anchor_state)

    # The policy folder is a plain HF model folder with its tokenizer.
    loaded = AutoModelForCausalLM.from_pretrained(path / "policy", dtype=torch.float32)
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    assert AutoTokenizer.from_pretrained(path / "policy")("hello")["input_ids"] == tok("hello")["input_ids"]

    opt2 = torch.optim.AdamW(loaded.parameters(), lr=1e-3)
    opt2.load_state_dict(load_optimizer_state(path))  # torch.load(weights_only=True) inside
    for s1, s2 in zip(opt.state.values(), opt2.state.values()):
        assert torch.equal(s1["exp_avg"], s2["exp_avg"]) and torch.equal(s1["exp_avg_sq"], s2["exp_avg_sq"])
    assert load_scheduler_state(path)["last_epoch"] == sched.state_dict()["last_epoch"]
    assert yaml_has_run(path / "config.yaml")


def yaml_has_run(p) -> bool:
    import yaml

    return "run" in yaml.safe_load(p.read_text())


def test_keep_last_and_latest_pointer(tmp_path, tiny):
    model, tok, opt, sched = tiny
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, model, tok, opt, sched, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_3", "step_4"]
    assert (tmp_path / LATEST).read_text().strip() == "step_4"
    assert resolve_resume(tmp_path).name == "step_4"
    assert resolve_resume(tmp_path / "step_3").name == "step_3"
    # Re-saving an existing step replaces it atomically.
    _save(tmp_path, 4, model, tok, opt, sched, keep_last=2)
    assert latest_checkpoint(tmp_path).name == "step_4"
    assert not any(p.name.startswith((".tmp-", ".old-")) for p in tmp_path.iterdir())


def test_half_written_checkpoint_is_ignored(tmp_path, tiny):
    """A crash while writing leaves only a hidden temp folder; resume uses the last complete one."""
    model, tok, opt, sched = tiny
    _save(tmp_path, 1, model, tok, opt, sched)
    partial = tmp_path / ".tmp-step_2"
    (partial / "policy").mkdir(parents=True)
    (partial / "optimizer.pt").write_bytes(b"truncated")
    (tmp_path / "step_3").mkdir()  # a step folder without trainer_state.json is not a checkpoint
    assert latest_checkpoint(tmp_path).name == "step_1"
    (tmp_path / LATEST).write_text("step_3\n")  # a pointer to an incomplete folder falls back too
    assert latest_checkpoint(tmp_path).name == "step_1"
    with pytest.raises(FileNotFoundError):
        resolve_resume(tmp_path / "nothing-here")


def test_rng_state_is_weights_only_loadable(tmp_path):
    torch.save(rng_state(), tmp_path / "rng.pt")
    state = torch.load(tmp_path / "rng.pt", weights_only=True)
    set_rng_state(state)


def test_sampler_resumes_exact_order():
    a = PromptSampler(list(range(7)), seed=3)
    first = [p.example for p in a.next(5, 1)]
    state = a.state_dict()
    rest = [p.example for p in a.next(12, 2)]
    b = PromptSampler(list(range(7)), seed=3)
    b.load_state_dict(json.loads(json.dumps(state)))
    assert [p.example for p in b.next(12, 2)] == rest
    assert sorted(first + rest[:2]) == list(range(7))  # an epoch is a permutation
    ids = [p.group_id for p in b.next(3, 9)]
    assert len(set(ids)) == 3
    with pytest.raises(ValueError, match="examples"):
        PromptSampler(list(range(8)), seed=3).load_state_dict(state)


def test_metrics_are_truncated_on_resume(tmp_path):
    t = Tracker(tmp_path, total_steps=5, tensorboard=False, progress=False)
    for s in (1, 2, 3):
        t.log(s, {"reward/mean": s / 10, "kl/mean": float("nan")})
    t.close()
    t = Tracker(tmp_path, total_steps=5, start_step=2, tensorboard=True, progress=False)
    t.log(3, {"reward/mean": 0.9})
    t.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["reward/mean"] == 0.9
    assert records[0]["kl/mean"] == "nan"
    assert any((tmp_path / "tensorboard").iterdir())
