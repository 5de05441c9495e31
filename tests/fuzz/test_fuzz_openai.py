"""Fuzzing the OpenAI-compatible routes of the generation server (``/v1/chat/completions``, ``/v1/completions``)
over their schemas: nesting, sizes, types and Unicode, against a real ``emapg engine serve`` (the tiny tool-call
searcher, transformers engine), real HTTP.

Each example takes a well-formed request and changes one place of it: a value of another JSON type, JSON nested
up to 5,000 levels (in the body itself, or as the text of a tool call's ``arguments``), strings and lists at and
past their limits, arbitrary Unicode (lone surrogates included, as the ``\\uXXXX`` escapes JSON allows), bytes
that are not UTF-8, unknown fields, missing ones. Every answer must be below 500 and strict JSON (RFC 8259), and
afterwards the server must answer a fixed good request as it did before and count no internal error. The
schema-driven fuzzing of every route (``tests/fuzz/test_fuzz_servers.py``) covers the same routes from their
OpenAPI bodies; this one reaches the places a schema cannot describe (JSON inside strings, depth, sizes).

Derandomized with fixed example counts, no example database: every run sends the same requests.
"""

from __future__ import annotations

import collections
import json

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from agent.engines.launch import EngineServer  # noqa: E402
from tests.fixtures.http_checks import strict_json  # noqa: E402

KEY = "fuzz-v1-key"
H = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
SETTINGS = settings(max_examples=150, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
RAW = "__raw_json_text__"  # replaced, after json.dumps, by JSON text Python's encoder could not write (5,000 levels)

CALL = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "paris"}'}}
CHAT = {
    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "capital?"}]},
                 {"role": "assistant", "content": None, "tool_calls": [CALL]},
                 {"role": "tool", "tool_call_id": "call_1", "name": "search", "content": "Paris"}],
    "tools": [{"type": "function", "function": {"name": "search", "description": "search the web",
                                                "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}],
    "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n\n"], "logprobs": True, "tool_choice": "auto",
}  # fmt: skip
COMPLETION = {"prompt": "the capital of france is", "max_tokens": 4, "temperature": 0, "logprobs": 0, "stop": "."}


def _places(value, path=()):
    """Every path into ``value`` (dict keys, list indices), the root included."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _places(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _places(v, (*path, i))


def _set(body, path, value):
    body = json.loads(json.dumps(body))
    if not path:
        return {} if value is _DELETE else value
    node = body
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        if isinstance(node, dict):
            node.pop(path[-1], None)
        else:
            node.pop(path[-1])
    else:
        node[path[-1]] = value
    return body


_DELETE = object()
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
unicode_text = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=60)  # surrogates included
depths = st.sampled_from([1, 63, 64, 65, 200, 990, 1200, 5000])


def _nested(kind: str, depth: int) -> str:
    return "[" * depth + "]" * depth if kind == "list" else '{"a":' * depth + "1" + "}" * depth


@st.composite
def changes(draw, base: dict):
    """(path, new value or _DELETE, raw JSON text or None) for one change of ``base``."""
    path = draw(st.sampled_from(list(_places(base))))
    kind = draw(st.sampled_from(["type", "type", "unicode", "nested_body", "nested_string", "size", "list_size", "delete",
                                 "unknown"]))  # fmt: skip
    if kind == "type":
        return path, draw(json_values), None
    if kind == "unicode":
        return path, draw(unicode_text), None
    if kind == "nested_body":
        return path, RAW, _nested(draw(st.sampled_from(["list", "object"])), draw(depths))
    if kind == "nested_string":
        return path, _nested(draw(st.sampled_from(["list", "object"])), draw(depths)), None
    if kind == "size":
        n = draw(st.sampled_from([0, 256, 257, 16_384, 16_385, 200_000, (1 << 22) + 1]))
        return path, draw(st.sampled_from(["x", "é", "😀", " "])) * n, None
    if kind == "list_size":
        n = draw(st.sampled_from([0, 65, 129, 257, 1025]))
        return path, [draw(json_values)] * n, None
    if kind == "delete":
        return path, _DELETE, None
    node = base
    for key in path:
        node = node[key]
    extra = {draw(st.text(min_size=1, max_size=10)): 1}  # an unknown field (or an object where none belongs)
    return path, {**node, **extra} if isinstance(node, dict) else extra, None


ARGUMENTS = ("messages", 2, "tool_calls", 0, "function", "arguments")
KNOWN = {"/v1/chat/completions": [
    (ARGUMENTS, _nested("object", 5000), None),  # issue 46, E1: answered 500 RecursionError
    (ARGUMENTS, RAW, _nested("object", 990)),  # as an object in the body, as deep as the body parser goes
    (("tools", 0, "function", "parameters"), RAW, _nested("object", 990)),
    (("messages", 2, "tool_calls", 0, "id"), RAW, _nested("list", 990)),  # str() of it recursed
    (ARGUMENTS, '{"q": "\\ud800"}', None),  # a lone surrogate inside the string's JSON
]}  # fmt: skip


def _encode(body, raw: str | None) -> bytes:
    text = json.dumps(body)  # ASCII: lone surrogates become \ud800 escapes, as a client's JSON may hold them
    return (text.replace(json.dumps(RAW), raw) if raw is not None else text).encode()


@pytest.fixture(scope="module")
def server(tool_searcher_dir):
    with EngineServer(tool_searcher_dir, engine="hf", api_key=KEY, max_model_len=1024, extra_args=["--openai-max-sessions", "64"]) as s:
        yield s


def _check(server, path: str, content: bytes, seen: collections.Counter, failures: list[str]) -> None:
    r = httpx.post(server.url + path, content=content, headers=H, timeout=120)
    seen[(path, r.status_code)] += 1
    if r.status_code >= 500:
        failures.append(f"{path} {content[:200]!r} -> {r.status_code} {r.text[:300]}")
    try:
        strict_json(r.content)
    except ValueError as e:
        failures.append(f"{path} {content[:200]!r} -> not strict JSON ({e}): {r.text[:200]}")


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)], ids=["chat", "completions"])
def test_fuzz_the_openai_routes(server, path, base):
    good = httpx.post(server.url + path, content=json.dumps({**base, "temperature": 0}).encode(), headers=H, timeout=120)
    assert good.status_code == 200, good.text
    seen: collections.Counter = collections.Counter()
    failures: list[str] = []

    def one(change, session):
        where, value, raw = change
        body = _set(base, where, value)
        if session and isinstance(body, dict):
            body = {**body, "user": session}
        _check(server, path, _encode(body, raw), seen, failures)

    for place, value, raw in KNOWN.get(path, ()):  # the reported cases, whatever the draw
        one((place, value, raw), None)
    SETTINGS(given(change=changes(base), session=st.sampled_from([None, None, "fuzz-a", "fuzz-b"]))(one))()
    for junk in (b"\xff\xfe{}", b'{"messages": "\xc0\xaf"}', b"", b"[]", b"null", b'"x"', b"[" * 5000 + b"]" * 5000):
        _check(server, path, junk, seen, failures)
    print(f"\n{path}: {sum(seen.values())} requests, statuses {dict(sorted(collections.Counter(s for _, s in seen.elements()).items()))}")
    assert not failures, "\n".join(failures[:20])
    assert any(status == 200 for _, status in seen)  # some changes keep the request valid: the engine ran them too
    after = httpx.post(server.url + path, content=json.dumps({**base, "temperature": 0}).encode(), headers=H, timeout=120)
    assert after.status_code == 200 and after.json()["choices"] == good.json()["choices"]
    metrics = httpx.get(server.url + "/metrics", headers=H).json()
    assert metrics["errors"].get("internal", 0) == 0 and metrics["sessions"]["reserved_bytes"] == 0 and metrics["in_flight"] == 0
    for sid in ("fuzz-a", "fuzz-b"):
        httpx.delete(f"{server.url}/v1/sessions/{sid}", headers=H)
