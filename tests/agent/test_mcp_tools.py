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


def _never_answering_port() -> tuple[object, int]:
    """A real TCP listener on a free port that accepts connections (the kernel completes them) and never answers."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock, sock.getsockname()[1]


def test_a_server_that_never_answers_is_cut_off_at_connect_naming_the_url(searcher):
    """agent/tools.py: the connect (transport + handshake) of a server that accepts the connection and never answers is
    cut off after rollout.tool_connect_timeout_s with an error naming the URL and the step, counted, instead of hanging;
    through run_rollouts the same error stops the batch (the trainer retries it, then stops with it)."""
    from agent.tools import ToolBox, ToolConnectError

    sock, port = _never_answering_port()
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        t0 = time.perf_counter()
        with pytest.raises(ToolConnectError) as e:
            ToolBox([url], timeout_s=5, max_output_chars=100, connect_timeout_s=2.0)
        took = time.perf_counter() - t0
        assert (e.value.source, e.value.phase) == (url, "connect") and "no answer within 2 s" in str(e.value)
        assert url in str(e.value) and took < 15, took
        t0 = time.perf_counter()
        with pytest.raises(ToolConnectError, match=f"cannot reach the MCP server '{url}' \\(connect\\)"):
            run_rollouts(searcher, ["q"], None, RolloutConfig(**FAST, tools=[url], tool_connect_timeout_s=2.0))
        assert time.perf_counter() - t0 < 15
    finally:
        sock.close()


def test_an_mcp_sdk_that_cannot_be_imported_fails_at_once_with_the_reason(monkeypatch):
    """The old connect "hang": run as a script, benchmarks/mcp.py was what ``import mcp`` found, the tool loop's
    import of the SDK failed before the connect began, and the toolbox waited out its whole deadline with the error
    unseen. Now the import's failure is the toolbox's error, at once."""
    import types

    from agent.tools import ToolBox

    monkeypatch.setitem(sys.modules, "mcp", types.ModuleType("mcp"))  # a module named mcp that is not the SDK
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="rollout.tools: cannot import name 'Client' from 'mcp'"):
        ToolBox(["http://127.0.0.1:9/mcp"], timeout_s=5, max_output_chars=100, connect_timeout_s=30.0)
    assert time.perf_counter() - t0 < 10


def test_a_connect_timeout_leaves_the_tool_loop_usable():
    """After a source timed out, a toolbox on a live stdio server connects and calls normally (nothing left hanging
    on a shared loop), and the failed box counted its failure."""
    from agent.tools import ToolBox, ToolConnectError

    sock, port = _never_answering_port()
    try:
        with pytest.raises(ToolConnectError):
            ToolBox([stdio("ok"), f"http://127.0.0.1:{port}/mcp"], timeout_s=5, max_output_chars=1000, connect_timeout_s=2.0)
    finally:
        sock.close()
    box = ToolBox([stdio("ok")], timeout_s=5, max_output_chars=1000, connect_timeout_s=20.0)
    try:
        (r,) = box.call_many([("lookup", {"key": "abc"})])
        assert (r.text, r.error, box.connect_failures) == ("ABC", None, 0)
    finally:
        box.close()


def test_an_http_source_with_an_api_key(retriever_index, monkeypatch):
    """rollout.tool_api_key_env: `emapg serve --mcp` started with a key refuses the toolbox without it (401, the error
    says which option sends one) and serves it with the key from the named environment variable as a Bearer token."""
    from agent.tools import ToolBox, ToolConnectError, close_toolboxes, toolbox_for
    from retriever.launch import RetrieverServer

    with RetrieverServer(retriever_index.index_dir, omp_num_threads=1, topk=3, api_key="mcp-secret", extra_args=["--mcp"],
                         startup_timeout=900) as server:
        url = server.url + "/mcp"
        with pytest.raises(ToolConnectError, match="401") as e:
            ToolBox([url], timeout_s=10, max_output_chars=10_000, connect_timeout_s=20.0)
        assert e.value.source == url and "rollout.tool_api_key_env" in str(e.value)
        with pytest.raises(ToolConnectError, match="401"):  # a wrong key is refused the same way
            ToolBox([url], timeout_s=10, max_output_chars=10_000, connect_timeout_s=20.0, headers={"Authorization": "Bearer nope"})
        cfg = RolloutConfig(**FAST, tools=[url], tool_api_key_env="EMAPG_TEST_MCP_KEY")
        monkeypatch.delenv("EMAPG_TEST_MCP_KEY", raising=False)
        with pytest.raises(ConfigError, match="'EMAPG_TEST_MCP_KEY' is unset"):
            toolbox_for(cfg)
        monkeypatch.setenv("EMAPG_TEST_MCP_KEY", "mcp-secret")
        try:
            box = toolbox_for(cfg)
            assert box.names() == ["search", "search_batch"]
            (r,) = box.call_many([("search", {"query": retriever_index.questions[0]["question"], "topk": 2})])
            assert r.error is None and r.text.startswith("Doc 1(Title:") and "Doc 2(Title:" in r.text
            other = ToolBox([url], timeout_s=10, max_output_chars=10_000, headers={"X-API-Key": "mcp-secret"})  # rollout.tool_headers
            try:
                assert other.call_many([("search", {"query": "x", "topk": 1})])[0].error is None
            finally:
                other.close()
        finally:
            close_toolboxes()
