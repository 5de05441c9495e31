"""Engines serving LoRA adapters over a base: the transformers engine (peft), and ``emapg engine serve`` through
``RemoteEngine`` (an http or a collective sync of the adapter tensors only). The reference is the base with the
adapters merged in."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from agent.engines import SamplingParams, make_engine
from agent.engines.base import lora_adapter_config
from agent.engines.launch import EngineServer
from agent.engines.remote import RemoteEngine
from emapg.config import ConfigError, load_config
from emapg.paths import CONFIG_DIR
from trainer import lora as L
from trainer.config import LoraConfig, TrainConfig
from trainer.loop import Trainer

PROMPTS = [[3, 17, 40, 41, 9], [5, 6, 7], [100, 200, 300, 400, 500, 600]]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=12, seed=7)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir):
    """(adapters in peft saved names, the engine LoRA config, a plain model with them merged): rank 4, random B."""
    model = L.apply_lora(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32),
                         LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in L.adapter_parameters(model):
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    config = L.engine_lora_config(model)
    state = L.adapter_state_dict(model)
    merged = {k: v.clone() for k, v in L.merged_state_dict(model.state_dict(), 2.0).items()}
    return state, config, merged


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapters):
    """The transformers engine on the base with the adapters merged into its weights."""
    engine = make_engine("hf", tiny_model_dir, max_model_len=512)
    engine.load_weights(adapters[2])
    return engine


def _same(outs, refs, atol=1e-4):
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    for o, r in zip(outs, refs):
        assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) < atol


def test_hf_engine_serves_adapters_like_the_merged_model(tiny_model_dir, adapters, reference):
    state, config, _ = adapters
    engine = make_engine("hf", tiny_model_dir, max_model_len=512)
    base = engine.generate(PROMPTS, GREEDY)
    assert engine.info.serves_lora
    engine.load_lora(state, config)
    for params in (GREEDY, SAMPLED):
        _same(engine.generate(PROMPTS, params), reference.generate(PROMPTS, params))
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] != [o.token_ids for o in base]
    # adapters of another shape or rank are refused, and the served ones stay
    bad = {k: v[:2] if ".lora_A." in k else v for k, v in state.items()}
    with pytest.raises(ValueError, match="do not match"):
        engine.load_lora(bad, config)
    with pytest.raises(ValueError, match="do not match"):
        engine.load_lora(state, {**config, "target_modules": ["q_proj"]})
    _same(engine.generate(PROMPTS, GREEDY), reference.generate(PROMPTS, GREEDY))
    # another run's adapters (another alpha): the engine re-wraps its base; B·A is scaled by the new alpha / r
    engine.load_lora(state, {**config, "lora_alpha": 4.0})
    assert engine.model.peft_config["default"].lora_alpha == 4.0
    engine.load_lora(state, config)
    _same(engine.generate(PROMPTS, GREEDY), reference.generate(PROMPTS, GREEDY))
    limited = make_engine("hf", tiny_model_dir, max_model_len=512, max_lora_rank=2)
    with pytest.raises(ValueError, match="LoRA ranks up to 2, not 4"):
        limited.load_lora(state, config)


def test_lora_config_is_checked():
    ok = {"r": 4, "lora_alpha": 8, "target_modules": ["v_proj", "q_proj"]}
    assert lora_adapter_config(ok) == {"r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
    for bad in ({"r": 0, "lora_alpha": 8, "target_modules": ["q"]}, {"r": True, "lora_alpha": 8, "target_modules": ["q"]},
                {"r": 4, "lora_alpha": -1, "target_modules": ["q"]}, {"r": 4, "lora_alpha": 8, "target_modules": []},
                {"r": 4, "lora_alpha": 8, "target_modules": ["q"], "extra": 1}, [4, 8]):
        with pytest.raises(ValueError):
            lora_adapter_config(bad)


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir):
    with EngineServer(tiny_model_dir, engine="hf", max_model_len=512, extra_args=["--max-lora-rank", "8"]) as server:
        yield server


def test_remote_engine_syncs_only_the_adapters(lora_server, tiny_model_dir, adapters, reference):
    state, config, merged = adapters
    remote = RemoteEngine(lora_server.url, model_path=str(tiny_model_dir))
    try:
        assert remote.info.serves_lora and remote.info.max_lora_rank == 8
        before = remote.health()[0]["weights_version"]
        assert remote.load_lora(state, config, tag="step-1") == [before + 1]
        _same(remote.generate(PROMPTS, GREEDY), reference.generate(PROMPTS, GREEDY))
        _same(remote.generate(PROMPTS, SAMPLED), reference.generate(PROMPTS, SAMPLED))
        # what went over the wire: the adapter tensors, a small fraction of the model
        assert sum(v.numel() for v in state.values()) * 20 < sum(v.numel() for v in merged.values())
        # a sync that does not fit is refused with a 4xx and loads nothing
        wrong = {k: (v[:, :3] if ".lora_A." in k else v) for k, v in state.items()}
        with pytest.raises(ValueError, match="do not fit the served model"):
            remote.load_lora(wrong, config)
        with pytest.raises(ValueError, match="matching 'lora' config"):
            remote.load_lora(state, {**config, "r": 2})
        with pytest.raises(ValueError, match="up to 8, not 16"):
            remote.load_lora({k: torch.zeros(16, v.shape[1]) if ".lora_A." in k else torch.zeros(v.shape[0], 16)
                              for k, v in state.items()}, {**config, "r": 16})
        assert remote.health()[0]["weights_version"] == before + 1
        _same(remote.generate(PROMPTS, GREEDY), reference.generate(PROMPTS, GREEDY))
        # a commit's lora config is strict input
        r = httpx.post(f"{lora_server.url}/weights/x1/commit", json={"buckets": 1, "lora": {"r": 4}})
        assert r.status_code == 422
    finally:
        remote.close()


def test_collective_sync_of_adapters_serves_what_the_http_sync_serves(lora_server, tiny_model_dir, adapters, reference):
    """weight_sync=collective with LoRA: a gloo group (this process rank 0, the server rank 1) broadcasts the adapter
    tensors only; the server loads them as its next adapter version: the same generations and log-probs as an http
    sync of the same adapters, and as the merged model."""
    state, config, _ = adapters
    halved = {k: 0.5 * v for k, v in state.items()}  # another adapter version (B·A scaled by 1/4)
    http = RemoteEngine(lora_server.url, model_path=str(tiny_model_dir))
    collective = RemoteEngine(lora_server.url, model_path=str(tiny_model_dir), weight_sync="collective")
    scored = [p + [11, 12, 13] for p in PROMPTS]
    try:
        assert collective.info.serves_lora and collective.info.max_lora_rank == 8
        http.load_lora(state, config)
        via_http = http.generate(PROMPTS, SAMPLED), http.score(scored, [1] * len(scored))
        version = collective.load_lora(halved, config, tag="halved")[0]
        halved_out = collective.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in halved_out] != [o.token_ids for o in reference.generate(PROMPTS, GREEDY)]
        assert collective.load_lora(state, config, tag="step-2") == [version + 1]
        assert collective.health()[0]["weights_tag"] == "step-2"
        got = collective.generate(PROMPTS, SAMPLED), collective.score(scored, [1] * len(scored))
        assert [(o.token_ids, o.logprobs) for o in got[0]] == [(o.token_ids, o.logprobs) for o in via_http[0]]
        assert got[1] == via_http[1]
        _same(collective.generate(PROMPTS, GREEDY), reference.generate(PROMPTS, GREEDY))
        # a receive whose lora config does not match the adapters is a 4xx before anything is broadcast
        with pytest.raises(ValueError, match="matching 'lora' config"):
            collective.load_lora(halved, {**config, "r": 2})
        assert collective.load_lora(halved, config) == [version + 2]  # the next sync builds a new group
        _same(collective.generate(PROMPTS, GREEDY), halved_out)
    finally:
        http.close()
        collective.close()


def test_trainer_pushes_adapters_to_a_lora_server_and_refuses_one_without(lora_server, tiny_model_dir, tmp_path):
    def cfg(url: str, out: str, *extra: str) -> TrainConfig:
        return load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [
            f"run.output_dir={tmp_path / out}", f"model.policy={tiny_model_dir}", "logging.progress=false",
            "logging.tensorboard=false", "data.prompts_per_step=2", "algorithm.mini_batch_size=4", "rollout.max_tokens_per_turn=8",
            "rollout.max_response_tokens=8", "rollout.engine=remote", f"rollout.engine_urls=[{url}]", "rollout.engine_wait=60",
            "model.lora.enabled=true", "model.lora.rank=4", "run.save_every=0", *extra])

    for transport in ("http", "collective"):
        trainer = Trainer(cfg(lora_server.url, transport, f"rollout.weight_sync={transport}")).setup()
        try:
            version = trainer.engine.health()[0]["weights_version"]
            pushed = trainer.policy.export_weights(all_ranks=True)
            assert pushed and all(".lora_A." in k or ".lora_B." in k for k in pushed)
            trainer.train_step()  # the first rollout syncs (remote servers start on weights of their own)
            assert trainer.engine.health()[0]["weights_version"] == version + 1
        finally:
            trainer.close()
    with EngineServer(tiny_model_dir, engine="hf", max_model_len=512) as plain:
        trainer = Trainer(cfg(plain.url, "b"))
        try:
            with pytest.raises(ConfigError, match=r"not started with LoRA support.*--max-lora-rank 4.*engine_weights=merged"):
                trainer.setup()
            assert httpx.get(f"{plain.url}/health").json()["weights_version"] == 0  # nothing was pushed
        finally:
            trainer.close()
