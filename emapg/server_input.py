"""What the request handlers of both servers (retriever, generation engine) do with their input.

One strict path from bytes to checked values, shared by ``retriever/server.py`` and
``agent/engines/server.py``:

* :func:`read_body`: the body, bounded in size (413) and in time (408; both close the connection),
  sent as is (a ``Content-Encoding`` other than ``identity`` is 415: nothing is decompressed); a
  client that goes away mid-body is one log line, not a traceback.
* :func:`parse_json`: UTF-8 JSON and nothing looser than the RFC: no ``NaN``/``Infinity``, no
  duplicate keys, no integer literal longer than :data:`MAX_INT_DIGITS` digits (Python's own
  limit of 4,300 digits would otherwise raise deep in the parser), no float that overflows,
  no nesting deeper than the interpreter can parse. :func:`parse_json_field`: JSON held inside a string
  field (tool-call arguments), as strict and also bounded in size and depth; :func:`check_json_value`:
  the depth and Unicode of a parsed value a handler keeps whole (iterative: nothing recurses on it
  unbounded). Both answer 422 naming the field.
* ``as_int`` / ``as_float`` / ``as_bool`` / ``as_text`` / ``as_list`` / :func:`check_fields`: typed
  field readers. Booleans are never integers, integers are bounded, floats finite and in range,
  strings valid Unicode scalar values (a lone surrogate such as ``"\\ud800"`` is rejected here
  instead of failing in a tokenizer or in the JSON encoder of the answer).
* :func:`guarded`: wraps a handler so that *every* outcome is a JSON answer counted by reason, and
  no exception reaches uvicorn (which would close the kept-alive connection of a pooled client);
  an HTTP/1.1 request without ``Host`` is refused (400, as RFC 9112 requires; h11 does it itself,
  httptools does not).

* :func:`openapi_body`: the OpenAPI ``requestBody`` of a route whose body a pydantic model documents (the
  handlers parse the body themselves, at least as strictly).

What a connection may cost before its request arrives (header deadline, idle connections) is
bounded below the app, in :mod:`emapg.connection_guard`.

Every refusal is an :class:`HTTPError` carrying a status, a message that says what to fix, a
``reason`` label for ``/metrics`` and, for a capacity refusal a retry may pass, a ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI
    from pydantic import BaseModel
    from starlette.requests import Request
    from starlette.responses import Response

MAX_INT_DIGITS = 30  # > 2**64 (20 digits); every integer field of both APIs is far smaller
MAX_MESSAGE_CHARS = 1000
MAX_JSON_DEPTH = 64  # nesting of JSON a handler keeps whole (tool arguments, schemas); real ones stay under 10

# The reason label of a refusal when the handler gives none.
DEFAULT_REASONS = {
    400: "invalid_json", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
    408: "body_timeout", 409: "conflict", 413: "too_large", 415: "content_encoding", 422: "invalid_field",
    499: "client_disconnected",
    500: "internal", 503: "not_ready",
}  # fmt: skip

# A request counter: (route, status, reason or None for a success, seconds spent).
Count = Callable[[str, int, "str | None", float], None]


class HTTPError(Exception):
    """A request the server refuses: answered with ``status`` and ``{"detail": message}``, counted as ``reason``.

    ``close``: also close the connection (its state is unknown, e.g. a body that stopped arriving).
    ``retry_after``: seconds sent as ``Retry-After`` (a capacity refusal that a later retry may pass).
    """

    def __init__(self, status: int, message: str, reason: str | None = None, *, close: bool = False,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason or DEFAULT_REASONS.get(status, f"http_{status}")
        self.close = close
        self.retry_after = retry_after


class ClientGone(HTTPError):
    """The client disconnected before its body arrived: nobody reads the answer, the log gets one line."""

    def __init__(self, message: str):
        super().__init__(499, message, "client_disconnected")


# ----------------------------------------------------------------------------- the body


def api_key_ok(request: Request, api_key: str | None) -> bool:
    """Whether ``request`` carries ``api_key`` (``Authorization: Bearer KEY`` or ``X-API-Key: KEY``); True when there is no key."""
    if not api_key:
        return True
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    return hmac.compare_digest(given.encode("utf-8", "replace"), api_key.encode())


async def read_body(request: Request, limit: int, *, timeout_s: float, hint: str = "") -> bytes:
    """The request body, bounded in size and in time.

    415 for a ``Content-Encoding`` other than ``identity`` (the servers decompress nothing: a
    small compressed body can inflate a thousandfold past the size bound). 413 (message ending in
    ``hint``) once it exceeds ``limit`` bytes: the declared Content-Length is checked first and the
    stream is counted, so an oversized body is never held whole. 408 when the whole body has not
    arrived within ``timeout_s`` seconds (a client that declares more than it sends would otherwise
    hold the connection and its buffers forever). The 415, 413 and 408 answers close the connection:
    the rest of the body is not read. :class:`ClientGone` when the client disconnects mid-body.
    """
    from starlette.requests import ClientDisconnect

    encodings = [e.strip().lower() for v in request.headers.getlist("content-encoding") for e in v.split(",") if e.strip()]
    if any(e != "identity" for e in encodings):
        named = ", ".join(show(e) for e in encodings[:3])
        raise HTTPError(415, f"Content-Encoding {named} is not supported: send the body uncompressed (identity)", close=True)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise HTTPError(413, f"body of {declared[:30]} bytes exceeds the limit of {limit} bytes{hint}", close=True)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise HTTPError(413, f"body exceeds the limit of {limit} bytes{hint}", close=True)
                chunks.append(chunk)
    except TimeoutError:
        from emapg.connection_guard import CLOSES

        CLOSES.note("body_timeout", f"a request body did not arrive within {timeout_s:g} s ({size} bytes received)")
        expected = f" of {declared}" if declared else ""
        raise HTTPError(408, f"the body did not arrive within {timeout_s:g} s ({size} bytes{expected} received); "
                             "the connection is closed", close=True) from None  # fmt: skip
    except ClientDisconnect:
        raise ClientGone(f"client disconnected after {size} bytes of the body{f' (of {declared})' if declared else ''}") from None
    return b"".join(chunks)


class _BadNumber(ValueError):
    pass


class _DuplicateKey(ValueError):
    pass


class _BadConstant(ValueError):
    pass


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _BadNumber(f"an integer with {len(text.lstrip('-'))} digits is out of range (at most {MAX_INT_DIGITS})")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _BadNumber(f"the number {text[:40]} overflows a 64-bit float")
    return value


def _no_constants(name: str) -> Any:
    raise _BadConstant(f"{name} is not a JSON number (send a finite number or null)")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(f"key {show(key)} appears twice in one object")
            seen.add(key)
    return obj


def parse_json(body: bytes, example: str = "") -> Any:
    """Strict JSON (see the module docstring) or :class:`HTTPError` 400/422; ``example`` is appended to syntax errors."""
    if not body.strip():
        raise HTTPError(400, f"empty body{': send JSON like ' + example if example else ''}", "empty_body")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"body is not valid JSON: it is not UTF-8 ({e})") from None
    try:
        return json.loads(text, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_no_constants,
                          object_pairs_hook=_unique_keys)  # fmt: skip
    except json.JSONDecodeError as e:
        raise HTTPError(400, f"body is not valid JSON ({e}){'; send ' + example if example else ''}") from None
    except RecursionError:
        raise HTTPError(400, "body is not valid JSON for this server: it is nested too deeply", "too_deep") from None
    except _BadNumber as e:
        raise HTTPError(422, f"body holds a number out of range: {e}", "invalid_number") from None
    except _DuplicateKey as e:
        raise HTTPError(400, f"body is not valid JSON for this server: {e}", "duplicate_key") from None
    except _BadConstant as e:
        raise HTTPError(400, f"body is not valid JSON: {e}") from None


def parse_json_field(text: str, where: str, *, max_chars: int, max_depth: int | None = None) -> Any:
    """JSON held in a string field (an OpenAI tool call's ``arguments``): as strict as a body (:func:`parse_json`),
    at most ``max_chars`` characters and ``max_depth`` levels deep (default :data:`MAX_JSON_DEPTH`), its strings
    valid Unicode (:func:`check_json_value`); every refusal a 422 naming ``where``."""
    max_depth = MAX_JSON_DEPTH if max_depth is None else max_depth
    text = as_text(text, where, max_chars=max_chars, nonempty=False)
    try:
        value = json.loads(text, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_no_constants,
                           object_pairs_hook=_unique_keys)  # fmt: skip
    except RecursionError:  # deeper than the interpreter parses (thousands): the bound below says the same
        raise _invalid(where, f"is nested more than {max_depth} levels deep; flatten it") from None
    except (_BadNumber, _DuplicateKey, _BadConstant) as e:
        raise _invalid(where, f"is not JSON this server accepts: {e}") from None
    except ValueError as e:  # JSONDecodeError
        raise _invalid(where, f"is not a JSON string ({str(e)[:120]})") from None
    check_json_value(value, where, max_depth=max_depth)
    return value


def check_json_value(value: Any, where: str, *, max_depth: int | None = None) -> Any:
    """``value`` (parsed JSON that a handler keeps whole: tool-call arguments, a tool's parameter schema) at most
    ``max_depth`` levels deep (default :data:`MAX_JSON_DEPTH`; a scalar is level 0) with every string and key
    valid Unicode. Iterative, so no depth the parser let through can make it (or the caller's later recursive
    use, a chat template's ``tojson``, ``json.dumps``) recurse past the interpreter's limit. 422 naming ``where``."""
    max_depth = MAX_JSON_DEPTH if max_depth is None else max_depth
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            as_text(node, f"{where} (a string in it)", max_chars=len(node), nonempty=False)
        elif isinstance(node, (dict, list)):
            if depth + 1 > max_depth:
                raise _invalid(where, f"is nested more than {max_depth} levels deep; flatten it")
            if isinstance(node, dict):
                for key, item in node.items():
                    as_text(key, f"{where} (a key in it)", max_chars=len(key), nonempty=False)
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in node)
    return value


# ----------------------------------------------------------------------------- typed fields


def show(value: Any) -> str:
    """A short description of a JSON value for an error message (never recursive, never long)."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    text = json.dumps(value)  # ASCII: safe for lone surrogates
    return text if len(text) <= 60 else text[:57] + "..."


def _invalid(where: str, message: str) -> HTTPError:
    return HTTPError(422, f"{where} {message}")


def check_fields(data: Any, where: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """``data`` as an object with only ``allowed`` fields and every ``required`` one."""
    if not isinstance(data, dict):
        raise HTTPError(422, f"{where} must be a JSON object with fields {list(allowed)}, got {show(data)}")
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise HTTPError(422, f"{where}: unknown field(s) {[k[:60] for k in unknown[:10]]}; allowed fields are {list(allowed)}")
    missing = [k for k in required if k not in data]
    if missing:
        raise HTTPError(422, f"{where}: missing field(s) {missing}")
    return data


def as_int(value: Any, where: str, lo: int, hi: int) -> int:
    """An integer (not a boolean, not 3.0) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(where, f"must be an integer, got {show(value)}")
    if not lo <= value <= hi:
        raise _invalid(where, f"must be between {lo} and {hi}, got {value}")
    return value


def as_float(value: Any, where: str, lo: float, hi: float) -> float:
    """A finite number (JSON integers too, booleans not) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(where, f"must be a number, got {show(value)}")
    value = float(value)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise _invalid(where, f"must be between {lo:g} and {hi:g}, got {value:g}")
    return value


def as_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _invalid(where, f"must be true or false, got {show(value)}")
    return value


def as_text(value: Any, where: str, *, max_chars: int, nonempty: bool = True) -> str:
    """A string of valid Unicode scalar values (no lone surrogates), at most ``max_chars`` long."""
    if not isinstance(value, str):
        raise _invalid(where, f"must be a string, got {show(value)}")
    if len(value) > max_chars:
        raise _invalid(where, f"has {len(value)} characters, more than the limit of {max_chars}; shorten it")
    if nonempty and not value.strip():
        raise _invalid(where, "is empty or whitespace; it needs text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _invalid(where, f"is not valid Unicode: a lone surrogate {show(value[e.start : e.end])} at character {e.start}") from None
    return value


def as_list(value: Any, where: str, *, max_len: int, min_len: int = 0) -> list:
    if not isinstance(value, list):
        raise _invalid(where, f"must be a list, got {show(value)}")
    if len(value) < min_len:
        raise _invalid(where, f"must have at least {min_len} item(s), got {len(value)}")
    if len(value) > max_len:
        raise HTTPError(413, f"{where} has {len(value)} items, more than the limit of {max_len}; split it over several requests")
    return value


# ----------------------------------------------------------------------------- answers


def _plain(value: Any) -> Any:
    """JSON for the few non-JSON types answers hold (numpy scalars in index info, paths)."""
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    if isinstance(value, PurePath):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """``obj`` as strict JSON (``allow_nan=False``: a NaN must be mapped by the handler, never sent as ``NaN``)."""
    from starlette.responses import Response

    try:
        body = json.dumps(obj, ensure_ascii=False, allow_nan=False, default=_plain).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate slipped through: \u-escaped ASCII is still valid JSON
        body = json.dumps(obj, ensure_ascii=True, allow_nan=False, default=_plain).encode("ascii")
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def error_response(e: HTTPError) -> Response:
    message = e.message if len(e.message) <= MAX_MESSAGE_CHARS else e.message[: MAX_MESSAGE_CHARS - 3] + "..."
    headers = {"connection": "close"} if e.close else {}
    if e.retry_after is not None:
        headers["retry-after"] = str(max(1, int(e.retry_after)))
    return json_response({"detail": message}, e.status, headers=headers or None)


def check_host(request: Request) -> None:
    """HTTP/1.1 requires a ``Host`` header (RFC 9112 section 3.2: answered 400); h11 enforces it, httptools does not."""
    if request.scope.get("http_version") == "1.1" and "host" not in request.headers:
        raise HTTPError(400, "an HTTP/1.1 request needs a Host header", "missing_host", close=True)


UNAUTHORIZED = "missing or wrong API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'"


def route_of(request: Request) -> str:
    """The route template (``/weights/{sync_id}/commit``): a bounded label, unlike the raw path."""
    route = request.scope.get("route")
    return getattr(route, "path", None) or "(unmatched)"


def guarded(api_key: str | None, count: Count, log: logging.Logger, *, open_: bool = False):
    """Decorator: API key (unless ``open_``), every outcome a JSON answer, counted by ``count``.

    The handler returns a Response or a JSON-able object; it raises :class:`HTTPError` to refuse.
    Any other exception is a server bug: logged with its traceback and answered 500 ("internal"),
    but still as JSON and without closing the connection.
    """

    def decorate(fn: Callable[..., Awaitable[Any]]):
        @functools.wraps(fn)  # FastAPI reads the path parameters from fn's signature
        async def wrapper(request: Request, **kwargs):
            from starlette.responses import Response

            t0 = time.perf_counter()
            route = route_of(request)
            reason: str | None = None
            try:
                check_host(request)
                if not open_ and not api_key_ok(request, api_key):
                    raise HTTPError(401, UNAUTHORIZED)
                result = await fn(request, **kwargs)
                response = result if isinstance(result, Response) else json_response(result)
            except ClientGone as e:
                log.info("%s %s: %s", request.method, request.url.path[:200], e.message)
                reason, response = e.reason, error_response(e)
            except HTTPError as e:
                reason, response = e.reason, error_response(e)
            except Exception as e:  # noqa: BLE001 - a bug: answer it, keep the connection and the server
                log.exception("%s %s failed", request.method, route)
                reason, response = "internal", error_response(HTTPError(500, f"internal error: {type(e).__name__}: {e}"))
            count(route, response.status_code, reason, time.perf_counter() - t0)
            return response

        return wrapper

    return decorate


def install_error_handlers(app: FastAPI, count: Count) -> None:
    """Unknown routes, wrong methods and bad path parameters: JSON answers, counted like the rest."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    async def http_exception(request: Request, exc: StarletteHTTPException):
        e = HTTPError(exc.status_code, str(exc.detail))
        try:
            check_host(request)
        except HTTPError as missing:
            e = missing
        count(route_of(request), e.status, e.reason, 0.0)
        return error_response(e)

    async def validation_error(request: Request, exc: RequestValidationError):
        parts = [f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg', '')}" for err in exc.errors()[:3]]
        e = HTTPError(422, "; ".join(parts) or "invalid request", "invalid_path")
        count(route_of(request), 422, e.reason, 0.0)
        return error_response(e)

    app.add_exception_handler(StarletteHTTPException, http_exception)
    app.add_exception_handler(RequestValidationError, validation_error)


def serve_directly(app: FastAPI, method: str, path: str, handler: Callable[[Request], Awaitable[Response]]) -> None:
    """Answer ``method path`` with ``handler`` (a :func:`guarded` handler of a route already on ``app``)
    straight from the ASGI entry point, past Starlette's router and FastAPI's dependency solving.

    For the hot route of a server: those layers cost about half of a small request's Python time
    (profiled: 0.3 of 0.6 ms per /retrieve on the event loop), time the loop does not spend parsing
    the next request. The route stays declared on ``app`` for OpenAPI, other methods on the path
    still get 405 from the router, and :func:`guarded` gives the same answers and counts either way.
    """
    from starlette.requests import Request as StarletteRequest

    route = next((r for r in app.routes if getattr(r, "path", None) == path and method in getattr(r, "methods", ())), None)
    if route is None:
        raise ValueError(f"serve_directly: {app.title} has no {method} {path} route")

    class DirectRoute:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http" and scope["path"] == path and scope["method"] == method:
                scope["route"] = route
                response = await handler(StarletteRequest(scope, receive, send))
                await response(scope, receive, send)
            else:
                await self.app(scope, receive, send)

    app.add_middleware(DirectRoute)


def _inline(node: Any, defs: dict) -> Any:
    """A JSON schema with its ``$defs`` references replaced by the definitions (``#/$defs/...`` does not
    resolve once the schema sits inside an OpenAPI document)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline(defs[node["$ref"].rsplit("/", 1)[1]], defs)
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def openapi_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` for a route whose JSON body ``model`` documents (required; its ``$defs`` inlined)."""
    schema = model.model_json_schema()
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": _inline(schema, schema.get("$defs", {}))}}}}
