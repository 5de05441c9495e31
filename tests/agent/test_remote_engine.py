"""The generation server (``emapg engine serve``) and ``RemoteEngine``: real servers in subprocesses, real HTTP.

Two transformers-engine servers on the untied tiny Qwen2 serve the module (replicas of one
model; one API key). Every test that changes weights loads the weights it needs first. The
local ``HFEngine`` in this process is the reference: a remote engine must return the same
tokens (and log-probs up to float noise) for the same weights, prompts and seeds.
"""

from __future__ import annotations

import concurrent.futures as cf
import uuid

import httpx
import pytest
import torch
from safetensors.torch import save
from transformers import AutoModelForCausalLM

from agent.engines import SamplingParams, make_engine
from agent.engines.launch import EngineServer
from agent.engines.remote import RemoteEngine
from emapg.config import ConfigError, load_config
from emapg.paths import CONFIG_DIR
from trainer.config import TrainConfig

KEY = "test-key-123"
PROMPTS = ["who wrote hamlet", "capital of france", "a longer question about rivers, mountains and the sea", "x"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, stop=("</search>", "</answer>"))


@pytest.fixture(scope="module")
def servers(untied_tiny_dir):
    """Two hf-engine servers on the same model, started concurrently."""
    procs = [EngineServer(untied_tiny_dir, engine="hf", api_key=KEY) for _ in range(2)]
    with cf.ThreadPoolExecutor(2) as pool:
        started = [pool.submit(p.start) for p in procs]
        try:
            [f.result() for f in started]
        except Exception:
            for p in procs:
                p.stop()
            raise
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def local(untied_tiny_dir):
    return make_engine("hf", untied_tiny_dir, max_model_len=2048)


@pytest.fixture(scope="module")
def weights(untied_tiny_dir):
    """(original, perturbed) HF state dicts; the perturbation changes greedy outputs."""
    sd = AutoModelForCausalLM.from_pretrained(untied_tiny_dir, dtype=torch.float32).state_dict()
    g = torch.Generator().manual_seed(0)
    return sd, {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in sd.items()}


def _prompts(tok):
    return [tok(q).input_ids for q in PROMPTS]


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and len(x.token_ids) > 0
        assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def _version(server) -> int:
    return httpx.get(server.url + "/health").json()["weights_version"]


def test_outputs_identical_to_the_local_engine(servers, local, weights, untied_tiny_dir):
    remote = RemoteEngine([s.url for s in servers], model_path=str(untied_tiny_dir), api_key=KEY)
    remote.load_weights(weights[0])
    local.load_weights(weights[0])
    prompts = _prompts(local.tokenizer)
    assert remote.info.kind == "remote" and remote.info.max_model_len == 2048
    _same(remote.generate(prompts, GREEDY), local.generate(prompts, GREEDY))
    # Seeded sampling: prompt i gets seed s + i on both sides, wherever the server batches it.
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=7)
    _same(remote.generate(prompts, sampled), local.generate(prompts, sampled))
    # The async driver's interface: submit / step / has_unfinished, spread over both replicas.
    for i, p in enumerate(prompts):
        remote.submit(f"r{i}", p, sampled.with_(seed=7 + i))
    got = {}
    while remote.has_unfinished():
        got.update(remote.step())
    _same([got[f"r{i}"] for i in range(len(prompts))], local.generate(prompts, sampled))
    assert remote.score(prompts[:2], [1, 2]) == [pytest.approx(x, abs=1e-5) for x in local.score(prompts[:2], [1, 2])]
    served = [httpx.get(s.url + "/metrics", headers={"X-API-Key": KEY}).json()["prompts"] for s in servers]
    assert min(served) > 0  # both replicas took a share
    remote.close()


def test_bad_requests_get_a_4xx_with_a_message(servers, untied_tiny_dir):
    url = servers[0].url
    h = {"X-API-Key": KEY}
    cases = [
        ({"prompts": []}, "non-empty"),
        ({"prompts": [[]]}, "prompt 0 is empty"),
        ({"prompts": [[5, 99999]]}, "outside the vocabulary"),
        ({"prompts": [[5] * 2040], "params": {"max_tokens": 100}}, "exceeds max_model_len=2048"),
        ({"prompts": [[5]], "params": {"temperature": -1}}, "temperature must be >= 0"),
        ({"prompts": [[5]], "params": {"top_p": 0}}, "top_p must be in (0, 1]"),
        ({"prompts": [[5]], "params": {"temprature": 1}}, "unknown field(s) ['temprature']"),
        ({"prompts": [[5]], "params": {"allowed_token_ids": [1, 99999]}}, "allowed_token_ids has ids outside"),
        ({"prompts": [[5], [6]], "params": [{}]}, "got 1 SamplingParams for 2 prompts"),
        ({"prompts": [[5]], "n": 2}, "unknown field(s) ['n']"),
    ]
    for body, message in cases:
        r = httpx.post(url + "/generate", json=body, headers=h)
        assert r.status_code == 422 and message in r.json()["detail"], (body, r.text)
    r = httpx.post(url + "/generate", content=b"{not json", headers=h)
    assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]
    r = httpx.post(url + "/weights/abc/bucket/0", content=b"garbage", headers=h)
    assert r.status_code == 422 and "not a valid safetensors body" in r.json()["detail"]
    # Through the client: a 4xx becomes a ValueError with the server's message (not retried).
    remote = RemoteEngine(url, model_path=str(untied_tiny_dir), api_key=KEY, retries=3)
    with pytest.raises(ValueError, match="HTTP 422.*exceeds max_model_len"):
        remote._post_generate(url, [[5] * 2040], [SamplingParams(max_tokens=100)])
    with pytest.raises(ValueError, match="outside the vocabulary"):  # checked before any request
        remote.generate([[99999]], GREEDY)
    remote.close()


def test_api_key_is_enforced(servers, untied_tiny_dir):
    url = servers[0].url
    assert httpx.get(url + "/health").status_code == 200  # open, as the retriever's
    for headers in ({}, {"X-API-Key": "wrong"}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url + "/generate", json={"prompts": [[5]]}, headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["detail"]
        assert httpx.post(url + "/weights/x/commit", json={"buckets": 1}, headers=headers).status_code == 401
    assert httpx.post(url + "/generate", json={"prompts": [[5]], "params": {"max_tokens": 2}}, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    with pytest.raises(ValueError, match="HTTP 401"):
        RemoteEngine(url, model_path=str(untied_tiny_dir)).generate([[5]], GREEDY)


@pytest.mark.parametrize("transport", ["http", "collective"])
def test_weight_sync_serves_exactly_the_new_weights_on_every_replica(servers, local, weights, untied_tiny_dir, transport):
    """http: safetensors buckets (tiny buckets: many requests); collective: a gloo group with both servers as ranks 1 and 2."""
    original, perturbed = weights
    remote = RemoteEngine([s.url for s in servers], model_path=str(untied_tiny_dir), api_key=KEY,
                          weight_sync=transport, bucket_bytes=64 << 10)
    prompts = _prompts(local.tokenizer)
    remote.load_weights(original)
    before = [_version(s) for s in servers]
    old = remote.generate(prompts, GREEDY)
    versions = remote.load_weights(perturbed, tag="perturbed")
    assert versions == [v + 1 for v in before] == [_version(s) for s in servers]
    assert httpx.get(servers[1].url + "/health").json()["weights_tag"] == "perturbed"
    local.load_weights(perturbed)
    for s in servers:  # each replica, not just the one a batch happened to reach
        one = RemoteEngine(s.url, model_path=str(untied_tiny_dir), api_key=KEY)
        new = one.generate(prompts, GREEDY)
        _same(new, local.generate(prompts, GREEDY))
        one.close()
    assert [o.token_ids for o in new] != [o.token_ids for o in old]
    remote.load_weights(original)  # a second sync over the same group / a fresh sync id
    local.load_weights(original)
    _same(remote.generate(prompts, GREEDY), local.generate(prompts, GREEDY))
    remote.close()


def test_staged_weights_upload_while_generating_and_load_only_on_commit(servers, local, weights, untied_tiny_dir):
    """stage_weights uploads while requests are in flight and changes nothing served; commit_weights loads exactly
    those weights (refused while requests are in flight); discard_weights frees a staged sync, which then cannot load."""
    original, perturbed = weights
    url = servers[0].url
    remote = RemoteEngine(url, model_path=str(untied_tiny_dir), api_key=KEY, bucket_bytes=64 << 10)
    prompts = _prompts(local.tokenizer)
    remote.load_weights(original)
    expected_old = remote.generate(prompts, GREEDY)
    version = _version(servers[0])
    for i, prompt in enumerate(prompts):  # in flight while the next weights upload
        remote.submit(f"r{i}", prompt, GREEDY)
    staged = remote.stage_weights(perturbed, tag="staged")
    assert staged.buckets > 1 and staged.tensors == len(perturbed)
    with pytest.raises(RuntimeError, match="in flight"):
        remote.commit_weights(staged)
    done: dict[str, object] = {}
    while remote.has_unfinished():
        done.update(remote.step(timeout=1.0))
    _same([done[f"r{i}"] for i in range(len(prompts))], expected_old)  # the batch in flight finished on the old weights
    assert _version(servers[0]) == version
    assert remote.commit_weights(staged) == [version + 1] == [_version(servers[0])]
    assert httpx.get(url + "/health").json()["weights_tag"] == "staged"
    local.load_weights(perturbed)
    _same(remote.generate(prompts, GREEDY), local.generate(prompts, GREEDY))
    again = remote.stage_weights(original)
    remote.discard_weights(again)
    with pytest.raises(ValueError, match="HTTP 409"):
        remote.commit_weights(again)
    assert _version(servers[0]) == version + 1
    remote.load_weights(original)
    local.load_weights(original)
    remote.close()


def test_aborted_or_mismatched_sync_leaves_the_old_weights(servers, local, weights, untied_tiny_dir):
    original, perturbed = weights
    url, h = servers[0].url, {"X-API-Key": KEY}
    remote = RemoteEngine(url, model_path=str(untied_tiny_dir), api_key=KEY)
    remote.load_weights(original)
    prompts = _prompts(local.tokenizer)
    expected = remote.generate(prompts, GREEDY)
    version = _version(servers[0])
    names = list(perturbed)
    half = len(names) // 2
    # Bucket 0 of 2 arrives, bucket 1 never does: the commit refuses and nothing is loaded.
    sync = uuid.uuid4().hex
    assert httpx.post(f"{url}/weights/{sync}/bucket/0", content=save({n: perturbed[n].contiguous() for n in names[:half]}), headers=h).status_code == 200
    r = httpx.post(f"{url}/weights/{sync}/commit", json={"buckets": 2}, headers=h)
    assert r.status_code == 409 and "missing buckets [1]" in r.json()["detail"]
    # A new sync id discards the stale staged bucket: the old sync can no longer be committed.
    other = uuid.uuid4().hex
    assert httpx.post(f"{url}/weights/{other}/bucket/0", content=save({names[0]: perturbed[names[0]].contiguous()}), headers=h).status_code == 200
    httpx.post(f"{url}/weights/{sync}/bucket/1", content=save({n: perturbed[n].contiguous() for n in names[half:]}), headers=h)
    r = httpx.post(f"{url}/weights/{sync}/commit", json={"buckets": 2}, headers=h)
    assert r.status_code == 409 and "missing buckets [0]" in r.json()["detail"]
    assert httpx.delete(f"{url}/weights/{sync}", headers=h).json() == {"discarded": True}
    # A state dict that does not fit the model is refused before any weight is touched.
    bad = dict(perturbed)
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="HTTP 422.*do not fit the served model.*wrong shape"):
        remote.load_weights(bad)
    with pytest.raises(ValueError, match="HTTP 422.*missing="):
        remote.load_weights({k: v for k, v in perturbed.items() if k != "lm_head.weight"})
    assert _version(servers[0]) == version
    _same(remote.generate(prompts, GREEDY), expected)
    remote.close()


def test_trainer_run_pushes_its_weights_to_the_servers(servers, tiny_model_dir, untied_tiny_dir, tmp_path, monkeypatch):
    """Two steps of the math preset against both replicas (async driver, collective sync): the servers get the
    policy before step 1 (they started on another model) and after step 1."""
    from trainer.loop import train

    monkeypatch.setenv("EMAPG_TEST_ENGINE_KEY", KEY)
    before = [_version(s) for s in servers]
    urls = ",".join(s.url for s in servers)
    cfg = load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [
        f"run.output_dir={tmp_path}", f"model.policy={untied_tiny_dir}", "run.total_steps=2", "run.save_every=0", "logging.progress=false",
        "data.prompts_per_step=2", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2", "rollout.max_tokens_per_turn=16",
        "rollout.max_response_tokens=16", "rollout.mode=async", "rollout.engine=remote", f"rollout.engine_urls=[{urls}]",
        "rollout.engine_api_key_env=EMAPG_TEST_ENGINE_KEY", "rollout.weight_sync=collective", "optim.lr=1e-2",
    ])  # fmt: skip
    history = train(cfg)
    assert len(history) == 2 and history[-1]["response/length_mean"] > 0
    for s, v in zip(servers, before):
        health = httpx.get(s.url + "/health").json()
        assert health["weights_version"] == v + 2 and health["weights_tag"] == "step-1"


def test_config_and_cli_errors(tmp_path):
    with pytest.raises(ConfigError, match="needs rollout.engine_urls"):
        load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", ["rollout.engine=remote"])
    with pytest.raises(ConfigError, match="use rollout.engine=remote"):
        load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", ["rollout.engine_urls=[http://127.0.0.1:1]"])
    with pytest.raises(ConfigError, match="not an http"):
        load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", ["rollout.engine=remote", "rollout.engine_urls=[127.0.0.1:1]"])
    from agent.engines.cli import serve_parser

    for action in serve_parser()._actions:
        assert action.help, action.dest


@pytest.mark.vllm
def test_vllm_server_matches_transformers_and_syncs_over_both_transports(untied_tiny_dir, local, weights):
    """One vLLM server: greedy identity with the local transformers engine, then an http and a collective
    (gloo, received inside the vLLM worker process) sync, each checked against the local engine."""
    pytest.importorskip("vllm")
    original, perturbed = weights
    with EngineServer(untied_tiny_dir, engine="vllm") as server:
        remote = RemoteEngine(server.url, model_path=str(untied_tiny_dir), bucket_bytes=64 << 10)
        assert remote.info.extra["server_engines"] == ["vllm"]
        prompts = _prompts(local.tokenizer)
        local.load_weights(original)
        _same(remote.generate(prompts, GREEDY), local.generate(prompts, GREEDY))
        for transport, sd in (("http", perturbed), ("collective", original), ("collective", perturbed)):
            remote.weight_sync = transport
            remote.load_weights(sd)
            local.load_weights(sd)
            _same(remote.generate(prompts, GREEDY), local.generate(prompts, GREEDY))
        assert _version(server) == 3
        remote.close()
    local.load_weights(original)
