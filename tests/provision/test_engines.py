"""provision/engines.py: engines from a spec, and the engine session's weight sync (real tiny engines)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from agent.engines import SamplingParams
from emapg.errors import UserError
from provision.engines import EngineSession, EngineSpec, RemoteOptions, available_kind, build_engine

SEQ, START = [list(range(10, 30))], [12]


def test_hf_engine_from_a_spec_generates(tiny_model_dir):
    engine = build_engine(EngineSpec("hf", str(tiny_model_dir), max_model_len=64, seed=3, dtype="float32", device="cpu"))
    try:
        prompt = engine.tokenizer("what is 2 + 3?").input_ids
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=5))[0]
        assert len(out.token_ids) == 5 and len(out.logprobs) == 5
    finally:
        engine.close()


def test_bad_specs_are_readable_errors(tmp_path):
    with pytest.raises(UserError, match="no such model folder"):
        build_engine(EngineSpec("hf", str(tmp_path / "no-model")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="cannot load model .*empty.* into the hf engine"):
        build_engine(EngineSpec("hf", str(tmp_path / "empty")))
    with pytest.raises(UserError, match="engine serve"):
        build_engine(EngineSpec("remote", str(tmp_path), remote=RemoteOptions(urls=())))
    with pytest.raises(ValueError, match="unknown engine kind"):
        build_engine(EngineSpec("tgi", str(tmp_path)))  # type: ignore[arg-type]


def test_available_kind_falls_back_without_vllm():
    told: list[str] = []
    assert available_kind("hf", warn=told.append) == "hf" and available_kind("remote") == "remote"
    have_vllm = importlib.util.find_spec("vllm") is not None
    assert available_kind("vllm", warn=told.append) == ("vllm" if have_vllm else "hf")
    assert bool(told) == (not have_vllm)


def test_session_pushes_changed_weights_before_the_next_rollout(tiny_model_dir):
    """A colocated engine starts on the policy's folder (no sync); after ``weights_changed`` the next
    ``generating`` loads what ``export_weights`` returns, once."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    exports: list[bool] = []

    def export_weights(*, all_ranks: bool) -> dict:
        exports.append(all_ranks)
        return {k: v.detach().clone() for k, v in policy.state_dict().items()}

    engine = build_engine(EngineSpec("hf", str(tiny_model_dir)))
    session = EngineSession(engine, "hf", export_weights=export_weights)
    try:
        before = engine.score(SEQ, START)[0]
        with session.generating("step-0") as e:
            assert e is engine
        assert exports == []  # the engine loaded the same folder
        with torch.no_grad():
            policy.model.norm.weight.mul_(1.5)
        session.weights_changed()
        with session.generating("step-1"):
            after = engine.score(SEQ, START)[0]
        with session.generating("step-1"):
            pass
        assert exports == [True]  # every rank of a colocated engine loads its full copy, once per change
        assert max(abs(a - b) for a, b in zip(before, after)) > 1e-3
        with torch.no_grad():
            ids = torch.tensor(SEQ)
            want = torch.log_softmax(policy(ids).logits[0, START[0] - 1 : -1], -1).gather(-1, ids[0, START[0]:, None])[:, 0]
        assert after == pytest.approx(want.tolist(), abs=1e-5)
    finally:
        session.close()
