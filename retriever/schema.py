"""The retriever's request and response schema: the OpenAPI models and the strict body checks.

``POST /retrieve`` takes ``{"queries": [str], "topk": int, "return_scores": bool}`` and answers
``{"result": [[{"document": {"id", "contents"}, "score": float}, ...], ...]}`` with scores, or
``{"result": [[{"id", "contents"}, ...], ...]}`` without (Search-R1's shapes). ``POST /search`` takes query
vectors the caller encoded. The pydantic models document the API; :func:`parse_retrieve_body` and
:func:`parse_search_body` check a body (at least as strictly) and raise :class:`HTTPError` with a message
that says what to fix. Used by the server and the router.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Protocol

from pydantic import BaseModel, ConfigDict, Field

from emapg.server_input import HTTPError, as_bool, as_int, as_text, check_fields, parse_json

if TYPE_CHECKING:
    import numpy as np

__all__ = ["RetrieveRequest", "Document", "ScoredHit", "RetrieveResponse", "RequestLimits", "parse_retrieve_body", "check_retrieve",
           "parse_search_body", "format_result"]


class RequestLimits(Protocol):
    """What the body checks read from a server's options (``retriever.server.ServeConfig``, ``retriever.router.RouterConfig``)."""

    topk: int
    max_topk: int
    max_queries_per_request: int
    max_query_chars: int
    max_body_bytes: int


# ----------------------------------------------------------------------------- API schema (OpenAPI)


class RetrieveRequest(BaseModel):
    """Search-R1's request body (documentation: the body is checked by :func:`parse_retrieve_body`, which is
    at least as strict; e.g. a query must also hold a non-whitespace character and valid Unicode)."""

    model_config = ConfigDict(extra="forbid")

    queries: list[Annotated[str, Field(min_length=1)]] = Field(..., description="one or more non-empty query strings", min_length=1)
    topk: int | None = Field(None, description="hits per query (default: the server's --topk)", ge=1)
    return_scores: bool = Field(False, description="true: [[{document, score}]]; false: [[document]] (Search-R1 default)")


class Document(BaseModel):
    id: str
    contents: str = Field(..., description='"Title"\\ntext (Search-R1 / wiki-18 form)')


class ScoredHit(BaseModel):
    document: Document
    score: float


class RetrieveResponse(BaseModel):
    result: list[list[ScoredHit]] | list[list[Document]]


# ----------------------------------------------------------------------------- validation


ALLOWED_FIELDS = ("queries", "topk", "return_scores")
EXAMPLE = '{"queries": ["who wrote hamlet"], "topk": 3}'


def parse_retrieve_body(body: bytes, cfg: RequestLimits) -> tuple[list[str], int, bool]:
    """Check a /retrieve body (strict JSON, strict types); raise :class:`HTTPError` with a fix-it message."""
    return check_retrieve(parse_json(body, EXAMPLE), cfg)


def check_retrieve(data: object, cfg: RequestLimits) -> tuple[list[str], int, bool]:
    """Check a parsed /retrieve request (also what the MCP tools are given: ``retriever.mcp_server``), same limits."""
    if not isinstance(data, dict):
        raise HTTPError(422, f"body must be a JSON object with a 'queries' list, got a JSON {type(data).__name__}")
    check_fields(data, "body", ALLOWED_FIELDS)
    if "queries" not in data:
        raise HTTPError(422, "missing field 'queries': a list of query strings")
    queries = data["queries"]
    if isinstance(queries, str):
        raise HTTPError(422, "'queries' must be a list of strings, got a single string; wrap it in a list")
    if not isinstance(queries, list):
        raise HTTPError(422, f"'queries' must be a list of strings, got {type(queries).__name__}")
    if not queries:
        raise HTTPError(422, "'queries' is empty: send at least one query")
    if len(queries) > cfg.max_queries_per_request:
        raise HTTPError(
            413, f"too many queries: {len(queries)} > {cfg.max_queries_per_request} per request; split them over several requests"
        )
    for i, q in enumerate(queries):
        as_text(q, f"queries[{i}]", max_chars=cfg.max_query_chars)
    topk = data.get("topk")
    topk = cfg.topk if topk is None else as_int(topk, "'topk'", 1, cfg.max_topk)
    return_scores = as_bool(data.get("return_scores", False), "'return_scores'")
    return queries, topk, return_scores


def parse_search_body(body: bytes, cfg: RequestLimits, dim: int) -> tuple[np.ndarray, int, bool]:
    """Check a /search body; the query vectors as float32 ``[B, dim]``, topk and ``documents`` (default true;
    false: answer row numbers and scores only) (HTTPError with a message otherwise)."""
    import base64
    import binascii

    import numpy as np

    data = parse_json(body, '{"vectors_b64": "...", "dim": 384, "topk": 3}')
    if not isinstance(data, dict):
        raise HTTPError(422, "body must be a JSON object with 'vectors_b64', 'dim' and 'topk'")
    check_fields(data, "body", ("vectors_b64", "dim", "topk", "documents"), required=("vectors_b64", "dim"))
    if as_int(data["dim"], "'dim'", 1, 1 << 16) != dim:
        raise HTTPError(422, f"'dim' is {data['dim']}, this index holds {dim}-d vectors")
    try:
        raw = base64.b64decode(as_text(data["vectors_b64"], "'vectors_b64'", max_chars=cfg.max_body_bytes), validate=True)
    except (binascii.Error, ValueError):
        raise HTTPError(422, "'vectors_b64' is not valid base64") from None
    if not raw or len(raw) % (4 * dim):
        raise HTTPError(422, f"'vectors_b64' must hold a whole number of {dim}-d float32 vectors ({len(raw)} bytes)")
    q = np.frombuffer(raw, dtype="<f4").reshape(-1, dim)
    if len(q) > cfg.max_queries_per_request:
        raise HTTPError(413, f"too many vectors: {len(q)} > {cfg.max_queries_per_request} per request")
    if not np.isfinite(q).all():
        raise HTTPError(422, "'vectors_b64' holds a NaN or an infinity")
    topk = data.get("topk")
    documents = as_bool(data.get("documents", True), "'documents'")
    return q, cfg.topk if topk is None else as_int(topk, "'topk'", 1, cfg.max_topk), documents


def format_result(hits: list[list[dict]], return_scores: bool) -> dict:
    """Search-R1 response shapes: [[{document, score}]] or [[document]]."""
    if return_scores:
        return {"result": [[{"document": {"id": h["id"], "contents": h["contents"]}, "score": h["score"]} for h in q] for q in hits]}
    return {"result": [[{"id": h["id"], "contents": h["contents"]} for h in q] for q in hits]}
