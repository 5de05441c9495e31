"""Checkpoints: HF-loadable policy, anchor, weights_only optimizer/RNG, atomicity, keep-last-N, and
self-verification (manifest of sha256 digests; a damaged checkpoint is skipped, naming the file)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from pathlib import Path

import trainer.checkpoint as checkpoint_module
from trainer.checkpoint import (
    LATEST,
    MANIFEST,
    CHECKPOINT_FORMAT,
    CheckpointError,
    hash_files,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_optimizer_state,
    load_scheduler_state,
    resolve_resume,
    rng_state,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
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


def test_samples_write_a_nan_reward_as_json(tmp_path):
    """A NaN reward or advantage in samples.jsonl is a string, as in metrics.jsonl: every line is strict JSON."""
    t = Tracker(tmp_path, total_steps=2, tensorboard=False, progress=False)
    t.log_samples(1, [{"reward": float("nan"), "advantage": float("-inf"), "question": "q", "segments": [{"tokens": 3}]},
                      {"reward": 1.0, "advantage": 0.5, "question": "r", "segments": []}])
    t.close()
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()

    def strict(token: str) -> None:
        raise ValueError(token)

    rows = [json.loads(line, parse_constant=strict) for line in lines]  # bare NaN/Infinity would raise
    assert [(r["step"], r["reward"], r["advantage"]) for r in rows] == [(1, "nan", "-inf"), (1, 1.0, 0.5)]
    assert rows[0]["segments"] == [{"tokens": 3}]


# ------------------------------------------------------------------------------------------ verification

# Every file kind a checkpoint holds (the policy folder is what `save_pretrained` writes for tiny-qwen2).
FILE_KINDS = [
    "policy/model.safetensors", "policy/config.json", "policy/generation_config.json", "policy/tokenizer.json",
    "policy/tokenizer_config.json", "policy/chat_template.jinja", "anchor.safetensors", "optimizer.pt",
    "scheduler.pt", "rng_rank0.pt", "trainer_state.json", "config.yaml", MANIFEST,
]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, tiny_model_dir):
    """A run folder with two intact checkpoints (step_1, step_2), copied by each test that damages it."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ids = torch.randint(0, 2000, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    run = tmp_path_factory.mktemp("saved") / "run"
    anchor = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for step in (1, 2):
        _save(run, step, model, tok, opt, sched, anchor=anchor)
    return run


def _copy(saved_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    return run


def damage(f, mode: str) -> None:
    """``truncate``: keep the first half. ``flip``: flip one bit in the middle (inside a digest for the manifest,
    since a flip in a key the verifier never reads is harmless)."""
    data = bytearray(f.read_bytes())
    if mode == "truncate":
        f.write_bytes(bytes(data[: len(data) // 2]))
        return
    at = data.index(b'"sha256": [') + 14 if f.name == MANIFEST else len(data) // 2
    data[at] ^= 0x01
    f.write_bytes(bytes(data))


def test_manifest_records_size_and_sha256_of_every_file(saved_run):
    ckpt = saved_run / "step_2"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} - {MANIFEST}
    assert set(manifest["files"]) == on_disk and set(FILE_KINDS) - {MANIFEST} <= on_disk
    for rel, entry in manifest["files"].items():
        data = (ckpt / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": [hashlib.sha256(data).hexdigest()]}, rel  # = sha256sum
    assert json.loads((ckpt / "trainer_state.json").read_text())["checkpoint_format"] == CHECKPOINT_FORMAT == 3
    v = verify_checkpoint(ckpt)
    assert v.intact and v.level == "sha256"


def test_piece_digests_are_the_sha256_of_each_slice(tmp_path):
    data = os.urandom(10_000)
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "exact").write_bytes(data[:8192])
    got = hash_files([tmp_path / "a", tmp_path / "empty", tmp_path / "exact"], piece_bytes=4096, workers=3)
    assert got[tmp_path / "a"] == [hashlib.sha256(data[i : i + 4096]).hexdigest() for i in (0, 4096, 8192)]
    assert got[tmp_path / "empty"] == [hashlib.sha256(b"").hexdigest()]
    assert got[tmp_path / "exact"] == [hashlib.sha256(data[i : i + 4096]).hexdigest() for i in (0, 4096)]
    assert hash_files([tmp_path / "a"])[tmp_path / "a"] == [hashlib.sha256(data).hexdigest()]


@pytest.mark.parametrize("mode", ["truncate", "flip"])
@pytest.mark.parametrize("rel", FILE_KINDS)
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(saved_run, tmp_path, caplog, rel, mode):
    run = _copy(saved_run, tmp_path)
    damage(run / "step_2" / rel, mode)
    v = verify_checkpoint(run / "step_2")
    assert not v.intact
    wanted = {"truncate": {"truncated", "unparsable"}, "flip": {"checksum", "unparsable"}}[mode]
    assert v.problems[0].kind in wanted, v.problems
    if rel != MANIFEST:
        assert v.problems[0].file == run / "step_2" / rel
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        assert resolve_resume(run) == run / "step_1"
    assert f"checkpoint {run / 'step_2'} is damaged ({rel}: " in caplog.text
    assert f"falling back to {run / 'step_1'}" in caplog.text
    if mode == "truncate":  # sizes alone find it (latest_checkpoint's cheap check)
        assert latest_checkpoint(run) == run / "step_1"
    elif rel not in ("trainer_state.json", MANIFEST):  # a same-size flip needs the hashes
        assert verify_checkpoint(run / "step_2", verify="size").intact


def test_checksum_mismatch_names_the_damaged_piece(tmp_path, tiny, monkeypatch):
    model, tok, opt, sched = tiny
    monkeypatch.setattr(checkpoint_module, "PIECE_BYTES", 4096)
    path = _save(tmp_path, 1, model, tok, opt, sched)
    f = path / "optimizer.pt"
    data = bytearray(f.read_bytes())
    data[10_000] ^= 0x80
    f.write_bytes(bytes(data))
    (problem,) = verify_checkpoint(path).problems
    assert problem.kind == "checksum" and "bytes 8192-12288" in problem.detail


def test_missing_and_extra_size(saved_run, tmp_path):
    run = _copy(saved_run, tmp_path)
    (run / "step_2" / "scheduler.pt").unlink()
    with open(run / "step_2" / "optimizer.pt", "ab") as f:
        f.write(b"x")
    kinds = {p.file.name: p.kind for p in verify_checkpoint(run / "step_2", verify="size").problems}
    assert kinds == {"scheduler.pt": "missing", "optimizer.pt": "size"}


def test_none_intact_names_every_damaged_file(saved_run, tmp_path):
    run = _copy(saved_run, tmp_path)
    damage(run / "step_2" / "policy" / "model.safetensors", "flip")
    damage(run / "step_1" / "trainer_state.json", "truncate")
    with pytest.raises(CheckpointError) as e:
        resolve_resume(run)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"cannot resume: no intact checkpoint in {run}")
    assert f"{run / 'step_2' / 'policy' / 'model.safetensors'}: sha256 mismatch" in msg
    assert f"{run / 'step_1' / 'trainer_state.json'}: truncated (" in msg
    # The cheap size check (latest_checkpoint) cannot see step_2's same-size flip: that is why resuming hashes.
    assert latest_checkpoint(run) == run / "step_2"
    (run / "step_2" / "trainer_state.json").write_text("{not json")
    assert latest_checkpoint(run) is None


def test_a_named_damaged_step_is_an_error_not_a_silent_substitute(saved_run, tmp_path):
    run = _copy(saved_run, tmp_path)
    damage(run / "step_2" / "rng_rank0.pt", "truncate")
    with pytest.raises(CheckpointError, match=r"cannot resume from .*step_2: .*rng_rank0.pt: truncated .*resume from the run folder"):
        resolve_resume(run / "step_2")
    assert resolve_resume(run / "step_1") == run / "step_1"


def test_a_lost_manifest_is_damage_not_an_old_checkpoint(saved_run, tmp_path):
    run = _copy(saved_run, tmp_path)
    (run / "step_2" / MANIFEST).unlink()
    (problem,) = verify_checkpoint(run / "step_2").problems
    assert problem.kind == "missing" and problem.file.name == MANIFEST
    assert resolve_resume(run) == run / "step_1"


def _make_old(ckpt) -> None:
    """Turn a checkpoint into what the code before manifests wrote."""
    (ckpt / MANIFEST).unlink()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["checkpoint_format"]
    (ckpt / "trainer_state.json").write_text(json.dumps(state))


def test_old_checkpoints_without_manifest_resume_unverified(saved_run, tmp_path, caplog):
    run = _copy(saved_run, tmp_path)
    for step in (1, 2):
        _make_old(run / f"step_{step}")
    v = verify_checkpoint(run / "step_2")
    assert v.intact and v.level == "unverified"
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        assert resolve_resume(run) == run / "step_2"
    assert "written before checkpoints carried checksums" in caplog.text
    # Structural checks still catch truncation (safetensors header vs size, torch zip directory) ...
    for rel in ("policy/model.safetensors", "anchor.safetensors", "optimizer.pt", "policy/tokenizer.json"):
        damage(run / "step_2" / rel, "truncate")
        assert {p.file.name for p in verify_checkpoint(run / "step_2", verify="size").problems} == {Path(rel).name}, rel
        shutil.copy2(saved_run / "step_2" / rel, run / "step_2" / rel)
    # ... and a flipped bit in a torch archive (its records' CRC-32, checked at the sha256 level).
    damage(run / "step_2" / "optimizer.pt", "flip")
    assert verify_checkpoint(run / "step_2", verify="size").intact
    assert [p.kind for p in verify_checkpoint(run / "step_2").problems] == ["checksum"]
    assert resolve_resume(run) == run / "step_1"


def test_loaders_name_a_damaged_file(saved_run, tmp_path):
    """Past verification (e.g. a file damaged after it), loading still fails with one line naming the file."""
    run = _copy(saved_run, tmp_path)
    ckpt = run / "step_2"
    for rel, load in (("optimizer.pt", load_optimizer_state), ("scheduler.pt", load_scheduler_state),
                      ("anchor.safetensors", load_checkpoint), ("rng_rank0.pt", load_checkpoint),
                      ("trainer_state.json", load_checkpoint)):
        damage(ckpt / rel, "truncate")
        with pytest.raises(CheckpointError, match=rf"{rel}: cannot be read"):
            load(ckpt)
        shutil.copy2(saved_run / "step_2" / rel, ckpt / rel)
