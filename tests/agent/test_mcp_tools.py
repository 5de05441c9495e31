"""``rollout.tools``: MCP tool servers in rollouts (agent/tools.py), token-exact, failures counted, never fatal.

Real parts: the tiny Qwen2 weight-scripted to call ``search`` on every turn in hermes syntax (tests/fixtures/toolcalls.py),
the transformers engine, ``emapg serve --mcp`` over the small real index (started here), and a stdio MCP server
(tests/agent/mcp_tool_server.py) whose ``search`` answers, hangs, answers 100,000 characters or fails.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from agent.engines import make_engine
from agent.rollout import RolloutConfig, run_rollouts, summarize
from emapg.config import ConfigError
from tests.fixtures.agent import Recorder, check_token_exact

FAST = dict(format="tool_calls", max_tokens_per_turn=24, max_obs_tokens=400, temperature=1.0, top_p=0.95, max_turns=2)
SERVER = Path(__file__).with_name("mcp_tool_server.py")


def stdio(mode: str) -> str:
    return f"stdio:{sys.executable} {SERVER} {mode}"


@pytest.fixture(scope="module")
def searcher(tool_searcher_dir):
    return make_engine("hf", tool_searcher_dir, max_model_len=2048)


@pytest.fixture(scope="module")
def questions(retriever_index):
    return [q["question"] for q in retriever_index.questions[:3]]


@pytest.fixture(scope="module")
def mcp_retriever(retriever_index):
    from retriever.launch import RetrieverServer

    with RetrieverServer(retriever_index.index_dir, omp_num_threads=1, topk=3, extra_args=["--mcp"]) as server:
        yield server


def test_search_through_emapg_serve_mcp_is_the_built_in_search(searcher, mcp_retriever, retriever_client, questions):
    """The retriever's MCP search as the agent's tool gives exactly the built-in search's trajectories (same passages,
    same tool messages, same sampled tokens), token-exact, with the calls counted per tool."""
    rec = Recorder(searcher)
    via_mcp = run_rollouts(rec, questions, None, RolloutConfig(**FAST, topk=3, tools=[mcp_retriever.url + "/mcp"]), batch_tag="t")
    check_token_exact(via_mcp, rec.calls)
    built_in = run_rollouts(searcher, questions, retriever_client, RolloutConfig(**FAST, topk=3), batch_tag="t")
    for a, b in zip(via_mcp, built_in):
        assert a.stop_reason == b.stop_reason == "max_turns" and a.error is None
        assert a.response_ids == b.response_ids and a.loss_mask == b.loss_mask
        assert a.tool_calls == {"search": 2} and a.tool_failures == 0 and a.num_searches == 0
    assert "Doc 1(Title:" in via_mcp[0].response_text
    assert summarize(via_mcp)["rollout/tool_calls/search"] == 2 * len(questions)


def test_tools_of_several_sources_are_declared_with_their_schemas(searcher, retriever_client, questions):
    # the stdio server also offers `search`: with the built-in search it is refused, naming both
    with pytest.raises(ConfigError, match="also offered by the built-in search"):
        run_rollouts(searcher, questions[:1], retriever_client, RolloutConfig(**FAST, tools=["search", stdio("ok")]))
    rec = Recorder(searcher)
    trajs = run_rollouts(rec, questions[:2], None, RolloutConfig(**FAST, tools=[stdio("ok")]))
    check_token_exact(trajs, rec.calls)
    prompt = searcher.tokenizer.decode(trajs[0].prompt_ids)
    assert '"name": "lookup"' in prompt and '"name": "search"' in prompt and '"required": ["key"]' in prompt
    assert "Paris is the capital of France. (query: capital of France)" in trajs[0].response_text
    assert all(t.tool_calls == {"search": 2} and t.tool_failures == 0 for t in trajs)


def test_a_hung_tool_is_cut_off_with_a_counted_error(searcher, questions):
    rec = Recorder(searcher)
    t0 = time.perf_counter()
    trajs = run_rollouts(rec, questions, None, RolloutConfig(**FAST, tools=[stdio("hang")], tool_timeout_s=1.0))
    took = time.perf_counter() - t0
    check_token_exact(trajs, rec.calls)
    for t in trajs:
        assert t.stop_reason == "max_turns" and t.error is None
        assert t.tool_calls == {"search": 2} and t.tool_failures == 2 and t.tool_errors == ["search: timeout"] * 2
        assert "did not answer within 1 s" in t.response_text
    assert took < 30  # two rounds of concurrent 1-s deadlines, not 3 x 2 x an hour
    assert summarize(trajs)["rollout/tool_failures"] == 2 * len(questions)


def test_an_oversized_output_is_cut_with_a_counted_error(searcher, questions):
    rec = Recorder(searcher)
    trajs = run_rollouts(rec, questions[:2], None, RolloutConfig(**FAST, tools=[stdio("big")], max_tool_output_chars=50))
    check_token_exact(trajs, rec.calls)
    for t in trajs:
        assert t.tool_failures == 2 and t.tool_errors == ["search: oversized"] * 2
        assert "[output cut: 100000 characters, the limit is 50]" in t.response_text and "x" * 51 not in t.response_text


def test_a_failing_tool_answers_the_model_and_the_async_driver_agrees(searcher, questions):
    cfg = RolloutConfig(**FAST, tools=[stdio("fail")])
    batched = run_rollouts(searcher, questions[:2], None, cfg, batch_tag="f")
    for t in batched:
        assert t.tool_failures == 2 and t.tool_errors == ["search: tool error"] * 2 and "the index is on fire" in t.response_text
    asynchronous = run_rollouts(searcher, questions[:2], None, RolloutConfig(**FAST, tools=[stdio("fail")], mode="async"), batch_tag="f")
    assert [t.response_ids for t in asynchronous] == [t.response_ids for t in batched]


def test_config_checks_name_the_option():
    with pytest.raises(ConfigError, match="rollout.tools needs rollout.format=tool_calls"):
        RolloutConfig(tools=["search"]).validate()
    with pytest.raises(ConfigError, match="is not a tool source"):
        RolloutConfig(format="tool_calls", tools=["ftp://x"]).validate()
    with pytest.raises(ConfigError, match="twice"):
        RolloutConfig(format="tool_calls", tools=["search", "search"]).validate()
    with pytest.raises(ConfigError, match="cannot reach the MCP server"):
        from agent.tools import ToolBox

        ToolBox(["http://127.0.0.1:9/mcp"], timeout_s=1, max_output_chars=10)
