"""Schema-driven fuzzing of both servers (schemathesis over their OpenAPI schemas, real servers, real HTTP).

For every operation of each server's ``/openapi.json``, schemathesis generates requests that fit the
schema (positive) and requests that break it (negative). Every answer must be below 500, JSON answers
must be strict JSON (RFC 8259: no NaN), negative requests must be refused with a 4xx, and afterwards a
fixed good request must get exactly the answer it got before (the fuzzing changed no state and broke
no worker).

Positive requests to the generation server are brought into the served model's range (token ids
modulo the vocabulary, at most 8 new tokens, integral floats such as ``3.0`` written as integers, which
JSON Schema allows and the servers refuse) so that they reach the engine instead of stopping at the
range checks. The collective transport is off on the fuzzed server (``--collective-allow`` with no
address), so a generated init cannot make it wait for a group.

Bounded for CI: a fixed number of examples per operation and mode (``EXAMPLES``), derandomized, no
example database, so every run sends the same requests.
"""

from __future__ import annotations

import collections
import json

import httpx
import pytest
import requests

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from agent.engines.launch import EngineServer  # noqa: E402
from tests.fixtures.http_checks import strict_json  # noqa: E402

EXAMPLES = {"positive": 40, "negative": 40}
KEY = "fuzz-key"


def fuzz(url: str, headers: dict[str, str], prepare=None) -> collections.Counter:
    """Run every operation of ``url``'s schema in both modes; returns (mode, method, path, status) counts.

    ``prepare(case)`` may adjust a positive case before it is sent.
    """
    schema = schemathesis.openapi.from_dict(httpx.get(url + "/openapi.json").json())
    seen: collections.Counter = collections.Counter()
    failures: list[str] = []
    session = requests.Session()

    def check(case, mode: GenerationMode, path: str) -> None:
        if prepare is not None and mode is GenerationMode.POSITIVE:
            prepare(case)
        r = case.call(base_url=url, session=session, headers=headers, timeout=120)
        seen[(mode.value, case.method, path, r.status_code)] += 1
        where = f"{mode.value} {case.method} {case.formatted_path} body={json.dumps(case.body, default=repr)[:300]}"
        if r.status_code >= 500:
            failures.append(f"{where} -> {r.status_code} {r.text[:300]}")
        if mode is GenerationMode.NEGATIVE and r.status_code < 400:
            failures.append(f"{where} -> accepted ({r.status_code}) although it breaks the schema")
        if (r.headers.get("content-type") or [""])[0].startswith("application/json"):  # schemathesis: header -> list of values
            try:
                strict_json(r.content)
            except ValueError as e:
                failures.append(f"{where} -> not strict JSON ({e}): {r.text[:200]}")

    for path, methods in schema.raw_schema["paths"].items():
        for method, spec in methods.items():
            has_input = bool(spec.get("parameters") or spec.get("requestBody"))
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_input else (GenerationMode.POSITIVE,):
                strategy = schema[path][method.upper()].as_strategy(generation_mode=mode)
                fuzz_one = settings(max_examples=EXAMPLES[mode.value], derandomize=True, database=None, deadline=None,
                                    suppress_health_check=list(HealthCheck), print_blob=False)(given(case=strategy)(_bound(check, mode, path)))  # fmt: skip
                try:
                    fuzz_one()
                except Unsatisfiable:  # nothing in this operation's schema can be broken (e.g. a free-form binary body)
                    assert mode is GenerationMode.NEGATIVE
                    print(f"  (no negative case can be generated for {method.upper()} {path})")
    assert not failures, "\n".join(failures[:20])
    return seen


def _json_integers(value):
    """``3.0`` -> ``3`` throughout: JSON Schema calls 3.0 an integer, the servers want integers written as such."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [_json_integers(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_integers(v) for k, v in value.items()}
    return value


def _bound(check, mode, path):
    """``check`` with mode and path fixed (``@given`` refuses functions with default arguments)."""

    def one_case(case):
        check(case, mode, path)

    return one_case


def _report(name: str, seen: collections.Counter) -> None:
    per_op = collections.Counter((mode, method, path) for mode, method, path, _ in seen.elements())
    print(f"\n{name}: {sum(seen.values())} requests over {len({k[1:] for k in per_op})} operations")
    for (mode, method, path), n in sorted(per_op.items()):
        statuses = sorted({s for m, me, p, s in seen if (m, me, p) == (mode, method, path)})
        print(f"  {mode:8} {method:6} {path:40} {n:4}  statuses {statuses}")


def test_fuzz_the_retriever(retriever_server, retriever_index):
    good = {"queries": [q["question"] for q in retriever_index.questions[:3]], "topk": 3, "return_scores": True}
    before = httpx.post(retriever_server.url + "/retrieve", json=good, timeout=60).json()["result"]
    seen = fuzz(retriever_server.url, {})
    _report("retriever", seen)
    assert any(k[0] == "positive" and k[2] == "/retrieve" and k[3] == 200 for k in seen)  # valid requests were answered
    after = httpx.post(retriever_server.url + "/retrieve", json=good, timeout=60).json()["result"]
    assert [[h["document"]["id"] for h in hits] for hits in after] == [[h["document"]["id"] for h in hits] for hits in before]
    for hits_a, hits_b in zip(after, before):
        assert [h["score"] for h in hits_a] == pytest.approx([h["score"] for h in hits_b], abs=1e-5)


@pytest.fixture(scope="module")
def engine_server(untied_tiny_dir):
    with EngineServer(untied_tiny_dir, engine="hf", api_key=KEY, max_model_len=64, extra_args=["--collective-allow"]) as server:
        yield server


def test_fuzz_the_generation_server(engine_server):
    url, headers = engine_server.url, {"X-API-Key": KEY}
    health = httpx.get(url + "/health").json()
    vocab = health["vocab_size"]
    good = {"prompts": [[5, 6, 7], [100, 200]], "params": {"temperature": 0, "max_tokens": 8}}
    before = httpx.post(url + "/generate", json=good, headers=headers, timeout=60).json()

    def in_range(case) -> None:
        if not isinstance(case.body, dict):
            return
        case.body = body = _json_integers(case.body)
        for key in ("prompts", "token_ids"):
            rows = body.get(key)
            if isinstance(rows, list) and all(isinstance(r, list) and all(type(t) is int for t in r) for r in rows):
                body[key] = [[t % vocab for t in r][:24] for r in rows]
        if "prompts" in body and body.get("params") is None:
            body["params"] = {}
        params = body.get("params")
        for p in params if isinstance(params, list) else [params]:
            if isinstance(p, dict):
                p["max_tokens"] = min(p.get("max_tokens") or 8, 8)

    seen = fuzz(url, headers, prepare=in_range)
    _report("generation server", seen)
    assert any(k[0] == "positive" and k[2] == "/generate" and k[3] == 200 for k in seen)
    after = httpx.post(url + "/generate", json=good, headers=headers, timeout=60).json()
    assert after["weights_version"] == before["weights_version"] == health["weights_version"]
    for a, b in zip(after["outputs"], before["outputs"], strict=True):
        assert a["token_ids"] == b["token_ids"] and a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    assert httpx.get(url + "/health").json()["asleep"] is False
