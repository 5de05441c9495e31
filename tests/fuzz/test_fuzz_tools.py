"""Hostile tool calls against the agent's tool box (agent/tools.py): what a model's text can put into a call's arguments
never reaches a tool client, and one failing call never takes another call's tool with it.

Real parts: the bundled calculator (a stdio MCP server), ``emapg serve --mcp`` over the small real index, and the
stdio test server (tests/agent/mcp_tool_server.py), whose ``crash`` tool ends its own process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

SERVER = Path(__file__).resolve().parents[1] / "agent" / "mcp_tool_server.py"

#: Arguments a hermes-style parser hands over from model text, each refused before any client sees it.
HOSTILE = {
    "lone surrogate": {"expression": "\ud800"},
    "surrogate in a key": {"\udfff": "1"},
    "NaN": {"expression": float("nan")},
    "infinity": {"expression": float("inf")},
    "deep nesting": {"expression": ((lambda f: f(f, 200))(lambda f, n: [f(f, n - 1)] if n else 1))},
    "long integer": {"expression": 10 ** 5000},
    "not an object": ["1 + 1"],
    "huge": {"expression": "1" * (2 << 20)},
}


@pytest.fixture(scope="module")
def mcp_search_url(retriever_index):
    from retriever.launch import RetrieverServer

    with RetrieverServer(retriever_index.index_dir, omp_num_threads=1, topk=3, extra_args=["--mcp"]) as server:
        yield server.url + "/mcp"


@pytest.fixture(scope="module")
def box(mcp_search_url):
    from agent.tools import ToolBox

    box = ToolBox(["calculator", mcp_search_url, f"stdio:{sys.executable} {SERVER} nosearch"], timeout_s=20, max_output_chars=4000)
    yield box
    box.close()


def good_calls(box) -> None:
    """A good call on every tool of ``box`` answers."""
    calc, search, lookup = box.call_many([("calculate", {"expression": "(1969 - 1903) * 2"}),
                                          ("search", {"query": "who wrote hamlet", "topk": 2}),
                                          ("lookup", {"key": "abc"})])  # fmt: skip
    assert (calc.text, calc.error) == ("132", None)
    assert search.error is None and search.text.startswith("Doc 1(Title:"), search
    assert (lookup.text, lookup.error) == ("ABC", None)


def test_a_lone_surrogate_is_refused_and_every_tool_still_answers(box):
    """The outside run's defect: ``"\\ud800"`` in one call closed every MCP client of the process. Now it is refused
    with a message (counted as a failure), in a calculator call and in a search call, and the next good calls of
    every tool succeed -- in the same round and in the next."""
    calc, search, good = box.call_many([("calculate", {"expression": "\ud800"}), ("search", {"query": "a\ud800b"}),
                                        ("calculate", {"expression": "2 + 2"})])  # fmt: skip
    for r in (calc, search):
        assert r.error == "invalid arguments" and "lone surrogate" in r.text and r.text.startswith("Error: "), r
    assert (good.text, good.error) == ("4", None)
    good_calls(box)
    assert box.reconnects == 0


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_arguments_are_refused_before_any_client(box, kind):
    (r,) = box.call_many([("calculate", HOSTILE[kind])])
    assert r.error == "invalid arguments" and r.text.startswith("Error: calculate was not called: the arguments"), r
    good_calls(box)
    assert box.reconnects == 0


def test_a_crashed_tool_server_is_reconnected_and_the_others_never_notice(box):
    """A tool server that dies mid-call fails that call only; its next call reconnects it; the calculator's and the
    search's clients (other sources) were never closed."""
    before = box.reconnects
    (crash,) = box.call_many([("crash", {})])
    assert crash.error is not None and crash.text.startswith("Error: the tool crash"), crash
    good_calls(box)
    assert box.reconnects == before + 1


def test_64_runaways_do_not_starve_4_good_calculations(box):
    """The outside run's defect: with 64 runaway expressions in a round, that round's 4 good calls timed out (the
    server evaluated a few at a time). Now the good ones answer with their values, every runaway gets an error,
    and the next round's good calls answer too."""
    runaway = [("calculate", {"expression": f"9 ** 9 ** 9 ** {9 + i}"}) for i in range(64)]
    good = [("calculate", {"expression": f"{i} * 7 + 1"}) for i in range(4)]
    answers = box.call_many(runaway[:32] + good + runaway[32:])
    assert [(a.text, a.error) for a in answers[32:36]] == [(str(i * 7 + 1), None) for i in range(4)]
    bad = answers[:32] + answers[36:]
    assert all(a.error is not None and a.text.startswith("Error") for a in bad)
    assert {a.error for a in bad} == {"tool error"}, {a.error for a in bad}  # answered by the calculator, not cut off
    good_calls(box)


@pytest.mark.parametrize("topk", ["5", True, 5.0, 0, -1, [5]])
def test_mcp_search_topk_follows_retrieve_rules(box, mcp_search_url, topk):
    """MCP ``search`` took ``topk`` "5", true and 5.0 for 5, which ``/retrieve`` refuses: now the same check answers
    both, with /retrieve's message, as a tool error (never a 5xx); an integer works."""
    (r,) = box.call_many([("search", {"query": "who wrote hamlet", "topk": topk})])
    assert r.error == "tool error" and "'topk' must be" in r.text, r
    retrieve = httpx.post(mcp_search_url.removesuffix("/mcp") + "/retrieve", json={"queries": ["who wrote hamlet"], "topk": topk})
    assert retrieve.status_code == 422 and "'topk' must be" in retrieve.json()["detail"]
    (ok,) = box.call_many([("search", {"query": "who wrote hamlet", "topk": 5})])
    assert ok.error is None and ok.text.count("Doc ") == 5


def test_mcp_get_is_refused_instead_of_an_empty_stream_held_open(mcp_search_url):
    """``GET /mcp`` opened an event stream that never carried anything and stayed open (256 of them at most): the
    endpoint is stateless, so it answers 405 at once."""
    for method in ("GET", "DELETE", "PUT"):
        r = httpx.request(method, mcp_search_url, headers={"Accept": "text/event-stream"}, timeout=10)
        assert r.status_code == 405 and r.headers["allow"] == "POST" and "POST only" in r.json()["detail"], (method, r.text)
