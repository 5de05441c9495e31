"""Hostile input against the real generation server (``emapg engine serve``, transformers engine, untied
tiny Qwen2): values that used to pass validation and then break the engine step for every batch mate,
weight syncs of NaN / integer tensors, unbounded staging, non-JSON log-probs, loose types, stalled and
abandoned bodies, collective joins to arbitrary addresses. Real server process, real HTTP, real sockets.

The server runs with ``--max-staged-mb 6``: the model is 8.5 MiB in float32 and 4.3 MiB in bfloat16, so
bfloat16 syncs go through and float32 ones hit the cap.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import threading
import time
import uuid

import httpx
import pytest
import torch
from safetensors.torch import save
from transformers import AutoModelForCausalLM

from agent.engines import SamplingParams
from agent.engines.engine_loop import EngineLoop, EngineStepError
from agent.engines.hf_engine import HFEngine
from agent.engines.launch import EngineServer
from agent.engines.remote import RemoteEngine
from agent.engines.weight_routes import allowed_address
from agent.engines.wire import params_to_json
from app.cli import main as emapg_main
from emapg.server_input import HTTPError
from tests.fixtures.http_checks import hold_many_open, local_port, raw_exchange, strict_json

KEY = "hardening-key"
H = {"X-API-Key": KEY}
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def server(untied_tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("engine-hardening") / "server.log"
    with EngineServer(untied_tiny_dir, engine="hf", api_key=KEY, max_model_len=256, log_path=log,
                      extra_args=["--body-timeout", "3", "--max-staged-mb", "6", "--header-timeout", "2"]) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="module")
def bf16_weights(untied_tiny_dir):
    sd = AutoModelForCausalLM.from_pretrained(untied_tiny_dir, dtype=torch.float32).state_dict()
    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


@pytest.fixture(scope="module")
def remote(server, untied_tiny_dir, bf16_weights):
    engine = RemoteEngine(server.url, model_path=str(untied_tiny_dir), api_key=KEY, bucket_bytes=1 << 20)
    engine.load_weights(bf16_weights)
    yield engine
    engine.close()


def _post(url: str, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={**H, "content-type": "application/json"}, timeout=120, **kw)


def _metrics(server) -> dict:
    return httpx.get(server.url + "/metrics", headers=H).json()


def _version(server) -> int:
    return httpx.get(server.url + "/health").json()["weights_version"]


def test_values_that_broke_the_engine_step_are_refused_and_concurrent_good_requests_are_served(server, remote):
    """Before: seed >= 2**64, temperature NaN or 1e-300 passed validation and failed the engine step of
    every request batched with them (11 of 12 and 5 of 12 concurrent good requests got 500)."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    sampled = SamplingParams(temperature=1.0, max_tokens=8, seed=11)
    good = {"prompts": prompts, "params": params_to_json(sampled)}
    expected = strict_json(_post(server.url, "/generate", good).text)["outputs"]  # seeded: independent of batch mates
    bad = [
        (b'{"prompts": [[5]], "params": {"seed": 18446744073709551616}}', 422, "params.seed must be between 0 and"),
        (b'{"prompts": [[5], [6]], "params": {"seed": 9223372036854775807, "max_tokens": 4}}', 422, "prompt 1's seed"),
        (b'{"prompts": [[5]], "params": {"temperature": NaN}}', 400, "NaN is not a JSON number"),
        (b'{"prompts": [[5]], "params": {"temperature": 1e-300}}', 422, "temperature must be >= 0"),
        (b'{"prompts": [[5]], "params": {"temperature": Infinity}}', 400, "Infinity is not a JSON number"),
        (b'{"prompts": [[5]], "params": {"temperature": 1e999}}', 422, "overflows a 64-bit float"),
        (b'{"prompts": [[5]], "params": {"temperature": 1e39}}', 422, "between 1e-05 and 100"),
        (b'{"prompts": [[5]], "params": {"top_p": NaN}}', 400, "NaN is not a JSON number"),
    ]
    jobs = [("good", json.dumps(good).encode(), 200, "")] * 12 + [("bad", *b) for b in bad]
    barrier = threading.Barrier(len(jobs))

    def send(job):
        barrier.wait()
        return job, _post(server.url, "/generate", job[1])

    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(send, jobs))
    for (kind, _, status, message), r in answers:
        assert r.status_code == status, r.text
        if kind == "good":
            for got, want in zip(strict_json(r.text)["outputs"], expected, strict=True):
                assert got["token_ids"] == want["token_ids"] and got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)
        else:
            assert message in r.json()["detail"], r.text


POISON = 1999  # a token id of the tiny vocabulary that nothing else here uses


class PoisonedEngine(HFEngine):
    """The real transformers engine with one injected fault: a batch holding token POISON fails, as an engine bug would."""

    def _generate_batch(self, prompts, params, seeds, max_tokens):
        if any(POISON in p for p in prompts):
            raise RuntimeError("injected fault")
        return super()._generate_batch(prompts, params, seeds, max_tokens)


def _start(loop: EngineLoop) -> None:
    """Start the loop and wait (up to 120 s) until its engine has loaded."""
    loop.start()
    deadline = time.monotonic() + 120
    while loop.status == "loading" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loop.status == "ok"


def test_a_request_that_breaks_an_engine_step_fails_alone(untied_tiny_dir):
    """Validation cannot foresee every failure: when a step fails, each of its requests runs again alone."""
    loop = EngineLoop(lambda: PoisonedEngine(str(untied_tiny_dir), max_model_len=256), max_wait_s=0.5)
    _start(loop)
    try:
        jobs = [[[5, 6], [7, 8, 9]], [[10, POISON, 11]], [[12, 13, 14]]]
        futures = [loop.generate(prompts, [GREEDY] * len(prompts)) for prompts in jobs]  # one batch (0.5 s collect)
        results = [f.exception(timeout=120) or f.result() for f in futures]
        assert isinstance(results[1], EngineStepError) and "injected fault" in str(results[1])
        alone = HFEngine(str(untied_tiny_dir), max_model_len=256)
        for i in (0, 2):
            assert [o.token_ids for o in results[i]] == [o.token_ids for o in alone.generate(jobs[i], GREEDY)]
        assert loop.counters["failed_steps"] == 1 and loop.counters["failed_requests"] == 1
        after = loop.generate([[5, 6]], [GREEDY]).result(timeout=120)  # the loop keeps serving
        assert after[0].token_ids == results[0][0].token_ids
    finally:
        loop.stop()


def test_weight_syncs_of_non_finite_or_integer_tensors_are_refused_before_loading(server, remote, bf16_weights, untied_tiny_dir):
    """Before: only names and shapes were checked; NaN weights were committed and /generate answered NaN."""
    prompts = [[5, 6, 7], [9, 10]]
    expected = remote.generate(prompts, GREEDY)
    version = _version(server)
    name = "model.layers.0.mlp.up_proj.weight"
    nan, inf, ints = dict(bf16_weights), dict(bf16_weights), dict(bf16_weights)
    nan[name] = nan[name].clone()
    nan[name][3, 4] = float("nan")
    inf["lm_head.weight"] = torch.full_like(inf["lm_head.weight"], float("inf"))
    ints["model.norm.weight"] = torch.ones(ints["model.norm.weight"].shape, dtype=torch.int32)
    sync = uuid.uuid4().hex
    r = _post(server.url, f"/weights/{sync}/bucket/0", save({name: nan[name].contiguous()}))
    assert r.status_code == 422 and f"tensor '{name}' has 1 non-finite value" in r.json()["detail"]
    r = _post(server.url, f"/weights/{sync}/bucket/0", save({"model.norm.weight": ints["model.norm.weight"]}))
    assert r.status_code == 422 and "tensor 'model.norm.weight' has dtype int32" in r.json()["detail"]
    with pytest.raises(ValueError, match=r"HTTP 422.*'lm_head.weight' has \d+ non-finite"):
        remote.load_weights(inf)
    collective = RemoteEngine(server.url, model_path=str(untied_tiny_dir), api_key=KEY, weight_sync="collective")
    try:
        with pytest.raises(ValueError, match=f"HTTP 422.*'{name}' has 1 non-finite"):
            collective.load_weights(nan)
    finally:
        collective.close()
    assert _version(server) == version and _metrics(server)["staged_bytes"] == 0
    got = remote.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert all(math.isfinite(x) for o in got for x in o.logprobs)


def test_staged_weight_bytes_are_capped_per_sync(server, remote, bf16_weights):
    """Before: staged buckets had no total cap (300 x 2 MiB accepted, memory 540 -> 1,138 MiB)."""
    health = httpx.get(server.url + "/health").json()
    assert health["max_staged_bytes"] == 6 << 20
    sync = uuid.uuid4().hex
    junk = save({"not.a.weight": torch.zeros(512, 1024)})  # 2 MiB of a name the model does not have
    for i in range(30):
        r = _post(server.url, f"/weights/{sync}/bucket/{i}", junk)
        assert r.status_code == 422 and "unknown=['not.a.weight']" in r.json()["detail"]
    assert _metrics(server)["staged_bytes"] == 0
    version = _version(server)
    float32 = {k: v.float() for k, v in bf16_weights.items()}  # 8.5 MiB > the 6 MiB cap
    with pytest.raises(ValueError, match="HTTP 413.*would stage .* more than the limit of 6291456"):
        remote.load_weights(float32)
    assert _metrics(server)["staged_bytes"] == 0 and _version(server) == version
    assert remote.load_weights(bf16_weights) == [version + 1]  # a sync within the cap still goes through


def test_log_probs_stay_valid_json_when_the_model_overflows(server, remote, bf16_weights):
    """Finite weights can still overflow (here logits of +-inf): the answer carries null, never NaN."""
    huge = dict(bf16_weights)
    huge["lm_head.weight"] = torch.full_like(huge["lm_head.weight"], 3e38)
    remote.load_weights(huge)
    try:
        r = _post(server.url, "/generate", {"prompts": [[5, 6, 7]], "params": params_to_json(GREEDY)})
        out = strict_json(r.text)["outputs"][0]  # Python's json would read NaN; RFC JSON must not contain it
        assert r.status_code == 200 and None in out["logprobs"]
        s = _post(server.url, "/score", {"token_ids": [[5, 6, 7]], "start": [1]})
        assert s.status_code == 200 and None in strict_json(s.text)["logprobs"][0]
        assert any(math.isnan(x) for x in remote.generate([[5, 6, 7]], GREEDY)[0].logprobs)  # the client reads null as NaN
        assert any(math.isnan(x) for x in remote.score([[5, 6, 7]], [1])[0])
        assert _metrics(server)["nonfinite_logprob_rows"] >= 2
    finally:
        remote.load_weights(bf16_weights)


STRICT = [
    ("/score", {"token_ids": [[5, 6]], "start": [True]}, "start[0] must be an integer, got true"),
    ("/score", {"token_ids": [[5, 6]], "start": [3]}, "start[0] must be between 1 and 2"),
    ("/score", {"token_ids": [[5, 6]]}, "missing field(s) ['start']"),
    ("/weights/s1/commit", {"buckets": True}, "'buckets' must be an integer, got true"),
    ("/weights/s1/commit", {"buckets": 1, "tag": [1]}, "'tag' must be an integer"),
    ("/weights/s1/commit", {"buckets": 1, "tag": "\ud800"}, "'tag' is not valid Unicode"),
    ("/weights/s1/commit", {"buckets": 1, "extra": 1}, "unknown field(s) ['extra']"),
    ("/generate", {"prompts": [[True]]}, "prompts[0] must be a list of integer token ids"),
    ("/generate", {"prompts": [[5]], "params": {"max_tokens": 2.0}}, "params.max_tokens must be an integer"),
    ("/generate", {"prompts": [[5]], "params": {"top_k": True}}, "params.top_k must be an integer"),
    ("/generate", {"prompts": [[5]], "params": {"ignore_eos": "yes"}}, "params.ignore_eos must be true or false"),
    ("/generate", {"prompts": [[5]], "params": {"stop": "x"}}, "params.stop must be a list"),
    ("/generate", {"prompts": [[5]], "params": {"stop": 0.0}}, "params.stop must be a list"),  # falsy is not "none" (fuzz find)
    ("/generate", {"prompts": [[5]], "params": {"stop": ""}}, "params.stop must be a list"),
    ("/generate", {"prompts": [[5]], "params": {"stop": ["\udfff"]}}, "params.stop[0] is not valid Unicode"),
    ("/generate", {"prompts": [[5]], "params": {"allowed_token_ids": [False]}}, "allowed_token_ids[0] must be an integer"),
    ("/generate", {"prompts": [[5]], "params": [{}, {}]}, "got 2 SamplingParams for 1 prompts"),
    ("/weights/collective/init", {"host": "127.0.0.1", "port": "80", "world_size": 2, "rank_offset": 1, "backend": "gloo", "group": "g"},
     "'port' must be an integer"),
    ("/weights/collective/init", {"host": "127.0.0.1", "port": 80, "world_size": True, "rank_offset": 1, "backend": "gloo", "group": "g"},
     "'world_size' must be an integer"),
    ("/weights/collective/receive", {"sync_id": "x", "buckets": [{"dtype": "float32", "tensors": [["a", [True]]]}]},
     "every tensor entry must be [name, [dims...]]"),
]


@pytest.mark.parametrize("path,body,message", STRICT, ids=[f"{i}{p}" for i, (p, _, _) in enumerate(STRICT)])
def test_strict_types_are_4xx_counted_and_the_connection_keeps_serving(server, remote, path, body, message):
    """Before: ``"start": [true]`` on /score and ``"buckets": true`` on commit were accepted (booleans as integers)."""
    before = _metrics(server)["errors"].get("invalid_field", 0)
    with httpx.Client(base_url=server.url, headers=H, timeout=60, limits=httpx.Limits(max_connections=1)) as http:
        bad = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        bad_port = local_port(bad)
        good = http.post("/generate", json={"prompts": [[5, 6]], "params": params_to_json(GREEDY)})
        good_port = local_port(good)
    assert bad.status_code == 422 and message in strict_json(bad.text)["detail"], bad.text
    assert good.status_code == 200 and bad_port == good_port
    assert _metrics(server)["errors"]["invalid_field"] == before + 1


def test_collective_init_connects_only_to_allowed_addresses(server, remote):
    """Before: any local process could make the server open a connection to any host and port."""
    body = {"host": "10.255.255.1", "port": 29500, "world_size": 2, "rank_offset": 1, "backend": "gloo", "group": "g", "timeout_s": 600}
    r = _post(server.url, "/weights/collective/init", body)
    assert r.status_code == 403 and "joins weight-sync groups only at ['127.0.0.0/8', '::1']" in r.json()["detail"]
    assert _metrics(server)["errors"]["forbidden"] >= 1
    assert allowed_address("localhost", ["127.0.0.0/8"]) == "127.0.0.1"
    assert allowed_address("127.0.0.1", ["localhost"]) == "127.0.0.1"
    for host, allow, message in (("127.0.0.1", ["10.0.0.0/8"], "refused"), ("127.0.0.1", [], "is off"), ("::1", ["127.0.0.1"], "refused")):
        with pytest.raises(HTTPError, match=message):
            allowed_address(host, allow)


def test_stalled_and_abandoned_bodies(server, remote):
    """A body shorter than its Content-Length gets 408 and a closed connection; a client that hangs up is one log line."""
    a = raw_exchange(server.url, "/generate", b'{"prompts": [[5', declared_length=400, headers=H, wait_s=30)
    assert a.status == 408 and a.closed and "did not arrive within 3 s" in strict_json(a.body)["detail"]
    assert _metrics(server)["errors"]["body_timeout"] == 1
    for _ in range(2):
        raw_exchange(server.url, "/generate", b'{"prompts": [[5', declared_length=400, headers=H, hang_up=True)
    deadline = time.monotonic() + 30
    while server.log_path.read_text(errors="replace").count("client disconnected") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log_path.read_text(errors="replace")
    assert log.count("client disconnected") == 2 and "Traceback" not in log, log[-3000:]


def test_headers_that_never_finish_get_408_and_the_connection_closes(server, remote):
    """The retriever's slowloris (tests/retriever/test_server_hardening.py) against the same server stack here."""
    head = b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    answers = hold_many_open(server.url, head, 8)  # odd: headers trickled byte by byte; even: never a byte
    for i, a in enumerate(answers):
        assert a.closed and 1.8 <= a.seconds < 20, (i, a)
        assert (a.status == 408 and "did not arrive within 2 s" in strict_json(a.body)["detail"]) if i % 2 else a.status is None, a
    assert _post(server.url, "/generate", {"prompts": [[5, 6]], "params": params_to_json(GREEDY)}).status_code == 200


GOOD_GENERATE = json.dumps({"prompts": [[5, 6]], "params": params_to_json(GREEDY)}).encode()


@pytest.mark.parametrize("headers,host,status,message,reason", [
    ({"Content-Encoding": "gzip"}, True, 415, 'Content-Encoding "gzip" is not supported', "content_encoding"),
    ({"Content-Encoding": "deflate"}, True, 415, 'Content-Encoding "deflate" is not supported', "content_encoding"),
    ({}, False, 400, "an HTTP/1.1 request needs a Host header", "missing_host"),
], ids=["gzip", "deflate", "no-host"])
def test_protocol_refusals_are_counted_and_close_the_connection(server, remote, headers, host, status, message, reason):
    """Before (the retriever's finding, the same stack): gzip answered "not UTF-8", a request without Host was served."""
    before = _metrics(server)["errors"].get(reason, 0)
    a = raw_exchange(server.url, "/generate", GOOD_GENERATE, headers={**H, **headers}, host=host, wait_s=30)
    assert a.status == status and message in strict_json(a.body)["detail"], a
    assert b"connection: close" in a.head.lower() and a.closed, a
    assert _metrics(server)["errors"][reason] == before + 1


def test_a_declared_oversize_body_gets_413_and_the_connection_closes_at_once(server, remote):
    a = raw_exchange(server.url, "/generate", b'{"prompts": [[5', declared_length=10**10, headers=H, wait_s=30)
    assert a.status == 413 and "exceeds the limit" in strict_json(a.body)["detail"], a
    assert b"connection: close" in a.head.lower() and a.closed and a.seconds < 20, a


def _abandon_warnings(server) -> int:
    return server.log_path.read_text(errors="replace").count("staged buckets of unfinished sync")


def test_the_abandoned_sync_warning_is_logged_only_for_an_abandoned_sync(server, remote, bf16_weights):
    """Before: every successful http sync logged "discarding N staged buckets of unfinished sync" (the staging
    reset ran on commit, while the committed buckets were still held): one false warning per training step."""
    before = _abandon_warnings(server)
    version = _version(server)
    for _ in range(3):  # 1 MiB buckets: several per sync
        remote.load_weights(bf16_weights)
    assert _version(server) == version + 3
    assert _abandon_warnings(server) == before  # 0 for successful syncs
    name = next(iter(bf16_weights))
    bucket = save({name: bf16_weights[name].contiguous()})
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    assert _post(server.url, f"/weights/{first}/bucket/0", bucket).status_code == 200
    assert _post(server.url, f"/weights/{second}/bucket/0", bucket).status_code == 200  # `first` is abandoned
    assert httpx.delete(f"{server.url}/weights/{second}", headers=H).json() == {"discarded": True}  # aborted: no warning
    deadline = time.monotonic() + 10
    while _abandon_warnings(server) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _abandon_warnings(server) == before + 1
    assert f"unfinished sync {first}" in server.log_path.read_text(errors="replace")


def test_refusals_before_binding_and_flag_names(capsys, monkeypatch):
    from agent.engines.cli import serve_parser
    from agent.engines.server import EngineServeConfig
    from emapg.config import config_from_args

    monkeypatch.delenv("EMAPG_ENGINE_API_KEY", raising=False)
    assert emapg_main(["engine", "serve", "--model", "tiny-qwen2", "--engine", "hf", "--host", "0.0.0.0"]) == 2
    assert "refusing to serve 0.0.0.0 without an API key" in capsys.readouterr().err
    assert emapg_main(["engine", "serve", "--model", "tiny-qwen2", "--collective-allow", "not a host!"]) == 2
    assert "is neither an IP address" in capsys.readouterr().err
    argv = ["--model", "m", "--engine", "hf", "--host", "0.0.0.0", "--port", "8000", "--api-key-env", "K", "--max-model-len", "6144",
            "--gpu-memory-utilization", "0.85", "--tensor-parallel-size", "2", "--sleep-mode", "--dtype", "bfloat16", "--device", "cpu",
            "--seed", "3", "--max-wait-ms", "1", "--max-prompts-per-request", "9", "--max-body-bytes", "99", "--max-bucket-mb", "8",
            "--log-level", "warning", "--insecure", "--collective-allow", "10.0.0.0/8", "trainer", "--header-timeout", "4",
            "--max-idle-connections", "9"]  # fmt: skip
    got = config_from_args(EngineServeConfig, serve_parser().parse_args(argv))
    assert got == EngineServeConfig(model="m", engine="hf", host="0.0.0.0", port=8000, api_key_env="K", max_model_len=6144,
                                    gpu_memory_utilization=0.85, tensor_parallel_size=2, sleep_mode=True, dtype="bfloat16",
                                    device="cpu", seed=3, max_wait_ms=1.0, max_prompts_per_request=9, max_body_bytes=99,
                                    max_bucket_mb=8, log_level="warning", insecure=True, collective_allow=["10.0.0.0/8", "trainer"],
                                    header_timeout=4.0, max_idle_connections=9)  # fmt: skip
    assert got.max_bucket_bytes == 8 << 20 and got.engine_options()["seed"] == 3
    assert config_from_args(EngineServeConfig, serve_parser().parse_args(["--model", "m", "--collective-allow"])).collective_allow == []


class EngineDeadError(RuntimeError):
    """Named as vLLM's: its engine core or a worker process died (e.g. the worker was killed for memory)."""


class DyingEngine(HFEngine):
    """The real transformers engine with one injected fault: a batch holding token POISON kills it, as vLLM's
    engine dies when its worker process is killed (every later step would fail or hang)."""

    def _generate_batch(self, prompts, params, seeds, max_tokens):
        if any(POISON in p for p in prompts):
            try:
                raise RuntimeError("Worker proc VllmWorker-0 died unexpectedly (exit code: -9)")
            except RuntimeError as e:
                raise EngineDeadError("EngineCore encountered an issue") from e
        return super()._generate_batch(prompts, params, seeds, max_tokens)


def test_a_dead_engine_fails_every_request_reports_it_and_stops_the_server(untied_tiny_dir):
    """An engine that died is not retried request by request (the old loop kept /health at ok while later requests
    hung): every request in flight or waiting fails with the cause, the status becomes failed and on_fatal stops the
    server (exit code 1), so clients and supervisors see it at once."""
    from agent.engines.engine_loop import is_fatal

    fatal: list[str] = []
    loop = EngineLoop(lambda: DyingEngine(str(untied_tiny_dir), max_model_len=256), max_wait_s=0.5, on_fatal=fatal.append)
    _start(loop)
    try:
        futures = [loop.generate(prompts, [GREEDY] * len(prompts)) for prompts in ([[5, 6]], [[10, POISON, 11]], [[12, 13]])]
        errors = [f.exception(timeout=120) for f in futures]
        assert all(e is not None and "EngineDeadError" in str(e) for e in errors), errors
        assert loop.status == "failed" and "EngineDeadError" in loop.error and fatal == [loop.error]
        assert loop.counters["failed_steps"] == 0  # not rerun request by request on a dead engine
    finally:
        loop.stop()
    assert is_fatal(EngineDeadError("x")) and not is_fatal(RuntimeError("injected fault"))
    try:
        try:
            raise EngineDeadError("core died")
        except EngineDeadError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert is_fatal(outer)  # found anywhere in the chain
