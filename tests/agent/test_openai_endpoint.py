"""The generation server's OpenAI-compatible, recording endpoint, driven by the official ``openai`` client.

Real parts: an ``emapg engine serve`` subprocess on a free port (transformers engine, API key) serving the
tiny tool-call searcher (tests/fixtures/toolcalls.py: it calls the search tool in hermes syntax on every
turn), the ``openai`` package, real HTTP. The built-in tool-call loop (agent/rollout.py) on the same model
is the reference an assembled session must equal token for token.
"""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

from agent.engines import make_engine
from agent.engines.launch import EngineServer
from agent.formats import SEARCH_TOOL, ToolCallFormat
from agent.recorded_sessions import RecordedCall, SessionStore, assemble
from agent.teacher_forcing import ReplayRetriever
from agent.rollout import RolloutConfig, run_rollouts
from emapg.server_input import HTTPError

KEY = "endpoint-key"
HITS = [{"id": "7", "contents": "\"Paris\"\nParis is the capital of France."}]
ROLLOUT = RolloutConfig(format="tool_calls", max_turns=2, max_tokens_per_turn=24, max_obs_tokens=200, topk=1,
                        temperature=1.0, top_p=1.0)


@pytest.fixture(scope="module")
def server(tool_searcher_dir):
    with EngineServer(tool_searcher_dir, engine="hf", api_key=KEY, extra_args=["--openai-max-sessions", "4"]) as s:
        yield s


def _client(server, session: str | None = None, key: str = KEY) -> openai.OpenAI:
    headers = {"X-Session-Id": session} if session else None
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, default_headers=headers, max_retries=0)


def _session(server, sid: str, method: str = "GET") -> httpx.Response:
    return httpx.request(method, f"{server.url}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {KEY}"})


def test_a_tool_calling_episode_assembles_into_the_built_in_loops_trajectory(server, tool_searcher_dir):
    """A plain openai-client tool loop (call, run the tool, send the result back) records one trajectory whose
    ids, mask and spans are exactly what the built-in tool-call loop produces on the same model."""
    engine = make_engine("hf", tool_searcher_dir, max_model_len=2048)
    (ref,) = run_rollouts(engine, ["what is the capital of france"], ReplayRetriever([HITS, HITS]), ROLLOUT)
    fmt = ToolCallFormat(engine.tokenizer, ROLLOUT)

    sid = f"episode-{uuid.uuid4().hex[:8]}"
    client = _client(server, sid)
    messages = [{"role": "user", "content": fmt.build_prompt("what is the capital of france").text}]
    for turn in range(3):
        resp = client.chat.completions.create(model="policy", messages=messages, tools=[SEARCH_TOOL], max_tokens=24,
                                              logprobs=True, seed=turn)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "search" and json.loads(call.function.arguments) == {"query": "capital of France"}
        assert len(choice.logprobs.content) == resp.usage.completion_tokens and all(t.logprob <= 0 for t in choice.logprobs.content)
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": fmt.results_messages([HITS[0:1]], 1, "")[0]["content"]})
    record = _session(server, sid).json()
    assert len(record["calls"]) == 3 and record["split"] is False
    (traj,) = record["trajectories"]
    assert traj["prompt_ids"] == ref.prompt_ids
    assert traj["response_ids"] == ref.response_ids and traj["loss_mask"] == ref.loss_mask
    assert [tuple(s) for s in traj["spans"]] == [(s.start, s.end, s.role) for s in ref.spans]
    sampled = [lp for c in record["calls"] for lp in c["logprobs"]]
    assert [lp for lp, m in zip(traj["logprobs"], traj["loss_mask"]) if m] == sampled
    assert _session(server, sid, "DELETE").status_code == 200 and _session(server, sid).status_code == 404


def test_recorded_tokens_are_a_direct_generate_calls(server):
    """At a temperature where the seed matters, the recorded call equals POST /generate with the same prompt and seed."""
    sid = f"seeded-{uuid.uuid4().hex[:8]}"
    resp = _client(server, sid).chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}],
                                                       temperature=50.0, seed=11, max_tokens=12, logprobs=True)
    (call,) = _session(server, sid, "DELETE").json()["calls"]
    direct = httpx.post(server.url + "/generate", headers={"Authorization": f"Bearer {KEY}"}, json={
        "prompts": [call["prompt_ids"]], "params": {"temperature": 50.0, "seed": 11, "max_tokens": 12}}).json()["outputs"][0]
    assert direct["token_ids"] == call["completion_ids"] and len(call["completion_ids"]) == resp.usage.completion_tokens
    assert direct["logprobs"] == pytest.approx(call["logprobs"], abs=1e-5)
    assert [t.logprob for t in resp.choices[0].logprobs.content] == pytest.approx(call["logprobs"], abs=1e-5)
    other = httpx.post(server.url + "/generate", headers={"Authorization": f"Bearer {KEY}"}, json={
        "prompts": [call["prompt_ids"]], "params": {"temperature": 50.0, "seed": 12, "max_tokens": 12}}).json()["outputs"][0]
    assert other["token_ids"] != call["completion_ids"]  # the seed matters here, so the equality above is not luck


def test_completions_with_token_ids_and_log_probs(server):
    sid = f"completion-{uuid.uuid4().hex[:8]}"
    client = _client(server, sid)
    first = client.completions.create(model="m", prompt="capital", max_tokens=6, temperature=0, logprobs=0)
    assert len(first.choices[0].logprobs.token_logprobs) == first.usage.completion_tokens
    (call,) = _session(server, sid).json()["calls"]
    more = call["prompt_ids"] + call["completion_ids"] + call["prompt_ids"][:2]  # token-in: continues the context
    client.completions.create(model="m", prompt=more, max_tokens=4, temperature=0)
    record = _session(server, sid, "DELETE").json()
    (traj,) = record["trajectories"]
    assert traj["loss_mask"] == [1] * len(call["completion_ids"]) + [0, 0] + [1] * len(record["calls"][1]["completion_ids"])


def test_bad_requests_are_4xx_with_messages(server):
    client = _client(server)
    user = [{"role": "user", "content": "hi"}]
    cases = [
        (dict(messages=user, n=2), "'n' must be 1"),
        (dict(messages=user, stream=True), "streaming is not supported"),
        (dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role must be one of"),
        (dict(messages=user, tool_choice="required", tools=[SEARCH_TOOL]), "'tool_choice'"),
        (dict(messages=user, top_logprobs=2, logprobs=True), "'top_logprobs'"),
        (dict(messages=user, max_tokens=100000), "exceeds max_model_len"),
        (dict(messages=user, tools=[{"type": "retrieval"}]), "tools[0]"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model="m", **kwargs)
        assert e.value.status_code == 422 and needle in e.value.response.json()["detail"], (kwargs, e.value.response.text)
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="wrong").chat.completions.create(model="m", messages=user)
    assert httpx.post(server.url + "/v1/chat/completions", json={"messages": user}).status_code == 401
    assert _session(server, "never-seen").status_code == 404
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="m", messages=user, user="has spaces")
    assert e.value.status_code == 422


def test_sessions_are_bounded(server):
    ids = [f"full-{i}-{uuid.uuid4().hex[:6]}" for i in range(5)]
    for sid in ids[:4]:
        _client(server, sid).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:  # --openai-max-sessions 4: refused, nothing evicted
        _client(server, ids[4]).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert "4 sessions are open" in e.value.response.json()["detail"]
    assert _session(server, ids[0]).status_code == 200
    for sid in ids[:4]:
        assert _session(server, sid, "DELETE").status_code == 200


def _record(store: SessionStore, sid: str, call: RecordedCall) -> None:
    admission = store.admit(sid)
    admission.reserve(0)
    admission.record(call)


def test_session_store_ttl_lru_and_call_limit():
    now = [0.0]
    store = SessionStore(max_sessions=2, max_calls=2, ttl_s=10.0, clock=lambda: now[0])
    call = RecordedCall("completion", [1], [2], [-0.1], "stop")
    _record(store, "a", call)
    now[0] = 5.0
    _record(store, "b", call)
    with pytest.raises(HTTPError) as e:
        store.admit("c")
    assert e.value.status == 429 and e.value.retry_after == 5  # "a" may be dropped in 5 s
    now[0] = 10.5  # "a" idle 10.5 s: dropped to make room; "b" (5.5 s) kept
    _record(store, "c", call)
    assert store.get("a") is None and store.get("b") is not None and store.expired == 1
    _record(store, "c", call)
    with pytest.raises(HTTPError, match="already holds 2 calls"):
        store.admit("c")


def test_assembly_splits_when_a_prompt_extends_no_context():
    calls = [RecordedCall("chat", [1, 2], [3, 4], [-1.0, -2.0], "stop"),
             RecordedCall("chat", [1, 2, 3, 4, 5], [6], [-3.0], "stop"),  # continues
             RecordedCall("chat", [9, 9], [7], [-4.0], "stop")]  # another conversation
    a = assemble(calls)
    assert a.split and [s.calls for s in a.segments] == [[0, 1], [2]]
    first = a.segments[0]
    assert (first.prompt_ids, first.response_ids, first.loss_mask) == ([1, 2], [3, 4, 5, 6], [1, 1, 0, 1])
    assert first.logprobs == [-1.0, -2.0, 0.0, -3.0] and first.spans == [(0, 2, "model"), (2, 3, "observation"), (3, 4, "model")]
