"""``POST /v1/responses`` on the recording endpoint, driven by the official ``openai`` client's ``responses.create``.

Real parts: an ``emapg engine serve`` subprocess (transformers engine, API key) serving the tiny tool-call searcher
(tests/fixtures/toolcalls.py: it calls the search tool in hermes syntax on every turn), real HTTP. The references:
``POST /generate`` with the recorded prompt and seed, and the built-in tool-call loop (agent/rollout.py).
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
from agent.rollout import RolloutConfig, run_rollouts
from agent.teacher_forcing import ReplayRetriever

KEY = "responses-key"
HITS = [{"id": "7", "contents": "\"Paris\"\nParis is the capital of France."}]
ROLLOUT = RolloutConfig(format="tool_calls", max_turns=2, max_tokens_per_turn=24, max_obs_tokens=200, topk=1,
                        temperature=1.0, top_p=1.0)
TOOL = {"type": "function", **SEARCH_TOOL["function"]}  # the Responses API's flat function tool


@pytest.fixture(scope="module")
def server(tool_searcher_dir):
    with EngineServer(tool_searcher_dir, engine="hf", api_key=KEY, extra_args=["--openai-max-sessions", "8"]) as s:
        yield s


def _client(server, session: str | None = None) -> openai.OpenAI:
    headers = {"X-Session-Id": session} if session else None
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, default_headers=headers, max_retries=0)


def _session(server, sid: str, method: str = "GET") -> httpx.Response:
    return httpx.request(method, f"{server.url}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {KEY}"})


def test_a_tool_episode_with_previous_response_id_is_the_built_in_loops_trajectory(server, tool_searcher_dir):
    """responses.create with tools, then function_call_output items chained by previous_response_id: one recorded
    trajectory, token for token the built-in tool-call loop's."""
    engine = make_engine("hf", tool_searcher_dir, max_model_len=2048)
    (ref,) = run_rollouts(engine, ["what is the capital of france"], ReplayRetriever([HITS, HITS]), ROLLOUT)
    fmt = ToolCallFormat(engine.tokenizer, ROLLOUT)
    result = fmt.results_messages([HITS[0:1]], 1, "")[0]["content"]

    sid = f"resp-{uuid.uuid4().hex[:8]}"
    client = _client(server, sid)
    resp = client.responses.create(model="policy", input=fmt.build_prompt("what is the capital of france").text,
                                   tools=[TOOL], max_output_tokens=24)
    for turn in range(3):
        assert resp.status == "completed" and resp.object == "response"
        (call,) = [o for o in resp.output if o.type == "function_call"]
        assert call.name == "search" and json.loads(call.arguments) == {"query": "capital of France"}
        assert resp.usage.output_tokens > 0 and resp.output_text == ""
        if turn == 2:
            break
        resp = client.responses.create(model="policy", previous_response_id=resp.id, tools=[TOOL], max_output_tokens=24,
                                       input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}])
    record = _session(server, sid, "DELETE").json()
    assert len(record["calls"]) == 3 and record["split"] is False
    (traj,) = record["trajectories"]
    assert traj["prompt_ids"] == ref.prompt_ids
    assert traj["response_ids"] == ref.response_ids and traj["loss_mask"] == ref.loss_mask
    assert [tuple(s) for s in traj["spans"]] == [(s.start, s.end, s.role) for s in ref.spans]


def test_the_whole_history_in_input_gives_the_same_context(server):
    """An agent that resends the conversation (function_call + function_call_output items) instead of chaining ids
    continues the same recorded context: one trajectory, no split."""
    sid = f"resend-{uuid.uuid4().hex[:8]}"
    client = _client(server, sid)
    items: list = [{"role": "user", "content": "capital of France?"}]
    first = client.responses.create(model="m", input=items, tools=[TOOL], max_output_tokens=24, instructions="Be brief.")
    (call,) = [o for o in first.output if o.type == "function_call"]
    items += [{"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "Paris."}]
    client.responses.create(model="m", input=items, tools=[TOOL], max_output_tokens=24, instructions="Be brief.")
    record = _session(server, sid, "DELETE").json()
    assert len(record["calls"]) == 2 and record["split"] is False and len(record["trajectories"]) == 1


def test_recorded_tokens_are_a_direct_generate_calls(server):
    sid = f"seeded-{uuid.uuid4().hex[:8]}"
    resp = _client(server, sid).responses.create(model="m", input="hello", temperature=50.0, max_output_tokens=12,
                                                 extra_body={"seed": 11})  # fmt: skip
    (call,) = _session(server, sid, "DELETE").json()["calls"]
    direct = httpx.post(server.url + "/generate", headers={"Authorization": f"Bearer {KEY}"}, json={
        "prompts": [call["prompt_ids"]], "params": {"temperature": 50.0, "seed": 11, "max_tokens": 12}}).json()["outputs"][0]
    assert direct["token_ids"] == call["completion_ids"] and len(call["completion_ids"]) == resp.usage.output_tokens
    assert direct["logprobs"] == pytest.approx(call["logprobs"], abs=1e-5)
    assert resp.status in ("completed", "incomplete")


def test_bad_requests_are_4xx_with_messages(server):
    client = _client(server)
    cases = [
        (dict(input="x", stream=False, tools=[{"type": "web_search"}]), "tools[0]"),
        (dict(input=[{"type": "reasoning", "summary": []}]), "input[0].type"),
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]), "only text parts"),
        (dict(input="x", tool_choice="required", tools=[TOOL]), "'tool_choice'"),
        (dict(input="x", reasoning={"effort": "low"}), "'reasoning'"),
        (dict(input=[{"type": "function_call", "call_id": "c", "name": "search", "arguments": "{not json"}]), "arguments"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(openai.APIStatusError) as e:
            client.responses.create(model="m", max_output_tokens=2, **kwargs)
        assert e.value.status_code == 422 and needle in e.value.response.json()["detail"], (kwargs, e.value.response.text)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="m", input="x", previous_response_id="resp_never")
    assert "previous_response_id" in e.value.response.json()["detail"]
    kept = client.responses.create(model="m", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="y", previous_response_id=kept.id, max_output_tokens=2)
    assert httpx.post(server.url + "/v1/responses", json={"input": "x"}).status_code == 401


def test_an_external_agent_on_the_responses_api_trains_like_a_chat_agent(tool_searcher_dir, retriever_client, retriever_index):
    """rollout.agent=examples.search_agent:solve_responses (responses.create + previous_response_id) gives exactly the
    trajectories of the same agent written against chat completions (examples.search_agent:solve)."""
    engine = make_engine("hf", tool_searcher_dir, max_model_len=2048)
    questions = [q["question"] for q in retriever_index.questions[:2]]
    common = dict(max_tokens_per_turn=24, max_response_tokens=4096, seed=3)
    via_responses = run_rollouts(engine, questions, retriever_client,
                                 RolloutConfig(agent="examples.search_agent:solve_responses", **common), batch_tag="r")
    via_chat = run_rollouts(engine, questions, retriever_client, RolloutConfig(agent="examples.search_agent:solve", **common),
                            batch_tag="r")  # fmt: skip
    for a, b in zip(via_responses, via_chat):
        assert a.error is None and a.format == "external" and (a.stop_reason, a.num_turns, a.num_searches) == ("max_turns", 3, 2)
        assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids and a.loss_mask == b.loss_mask
        assert sum(a.loss_mask) > 0 and a.spans == b.spans
