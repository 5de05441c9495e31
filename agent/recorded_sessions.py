"""Recorded sessions of the OpenAI-compatible endpoint, and their assembly into training trajectories.

Every call an agent makes with a session id (agent/engines/openai_endpoint.py) is recorded as a
:class:`RecordedCall`: the exact prompt token ids the engine was given, the token ids it sampled and their
sampling log-probs. :func:`assemble` turns a session's calls into trajectories token-exactly: a call whose
prompt starts with an earlier call's prompt + completion continues that context -- the tokens in between
(tool results, the next user turn, the chat template's framing) are context, masked out of the loss; the
completion is the model's, trainable. A call whose prompt extends no earlier context (the agent rewrote its
history, or ran a side conversation) starts a new trajectory; :class:`Assembly` says how many there are.

The endpoint builds prompts so that an agent that sends its conversation back unchanged continues the
context exactly (it reuses the recorded ids for the known prefix), so a plain tool-calling loop assembles
into one trajectory.

:class:`SessionStore` bounds memory by count and by bytes: at most ``max_sessions`` sessions of at most
``max_calls`` calls, holding at most ``max_bytes`` bytes (:func:`call_nbytes`: what the recorded ids,
log-probs and messages take in this process) together. A session idle for ``ttl_s`` seconds is dropped
when room is needed. Past any bound a call is refused (429, with ``Retry-After`` when waiting can help:
the seconds until the least recently used idle session may be dropped) rather than a session evicted: a
session an agent is still using must not lose calls, or its trajectory would be silently cut.

Admission comes before work: :meth:`SessionStore.admit` takes a call's place (a new session's slot, a
call of the session) before its prompt is built, :meth:`Admission.reserve` its largest possible size
before it is sampled, :meth:`Admission.record` stores it after; so a refused call never costs a
generation, and concurrent calls cannot overfill the store between admission and recording.
"""

from __future__ import annotations

import math
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from emapg.server_input import HTTPError

__all__ = ["RecordedCall", "Session", "SessionStore", "Admission", "Segment", "Assembly", "assemble", "call_nbytes",
           "expected_call_nbytes", "value_nbytes"]

# What one element of a recorded list takes: the list's pointer and the object (an int above 256 is its own
# 28-byte object; a float 24 bytes). Small ints are shared, so this overcounts a little, as a budget should.
ID_BYTES = 8 + 28
LOGPROB_BYTES = 8 + 24
CALL_OVERHEAD = 1024  # the RecordedCall, its lists' headers, the session's list slot


@dataclass
class RecordedCall:
    """One generation of a session, exactly as the engine ran it."""

    kind: Literal["chat", "completion"]
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    messages: list[dict] | None = None  # chat: the request's messages (normalised), for prefix reuse
    reply: dict | None = None  # chat: the assistant message returned (normalised)
    prompt_text: str | None = None  # completion: the prompt text, for prefix reuse
    completion_text: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "prompt_ids": self.prompt_ids, "completion_ids": self.completion_ids,
                "logprobs": self.logprobs, "finish_reason": self.finish_reason}


def value_nbytes(value: Any) -> int:
    """Bytes a JSON-like value (normalised messages, a reply) takes in this process: ``sys.getsizeof`` over
    its containers, strings and numbers, walked iteratively (the endpoint bounds their depth anyway)."""
    total, stack = 0, [value]
    while stack:
        node = stack.pop()
        total += sys.getsizeof(node)
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return total


def call_nbytes(call: RecordedCall) -> int:
    """What a recorded call holds, as the byte budget counts it (ids and log-probs by :data:`ID_BYTES` and
    :data:`LOGPROB_BYTES` each, texts and messages by :func:`value_nbytes`)."""
    texts = [call.messages, call.reply, call.prompt_text, call.completion_text]
    return (CALL_OVERHEAD + ID_BYTES * (len(call.prompt_ids) + len(call.completion_ids)) + LOGPROB_BYTES * len(call.logprobs)
            + sum(value_nbytes(t) for t in texts if t is not None))  # fmt: skip


def expected_call_nbytes(prompt_tokens: int, max_new_tokens: int, *, request_bytes: int, reply_bytes: int) -> int:
    """The most a call can hold once sampled (reserved before sampling): its prompt, ``max_new_tokens`` sampled ids
    and log-probs, what it keeps of the request (``request_bytes``: :func:`value_nbytes` of the messages or the prompt
    text) and of the reply (``reply_bytes``: a bound on the returned text's size)."""
    return (CALL_OVERHEAD + ID_BYTES * (prompt_tokens + max_new_tokens) + LOGPROB_BYTES * max_new_tokens
            + request_bytes + reply_bytes)  # fmt: skip


@dataclass
class Session:
    id: str
    calls: list[RecordedCall] = field(default_factory=list)
    last_used: float = 0.0
    nbytes: int = 0  # what its recorded calls hold (call_nbytes)
    pending: int = 0  # calls admitted and not yet recorded or released


class SessionStore:
    """Sessions by id, bounded by count and bytes (module docstring). ``clock`` is injectable for tests of the TTL."""

    def __init__(self, max_sessions: int, max_calls: int, ttl_s: float, max_bytes: int = 1 << 62,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_sessions, self.max_calls, self.ttl_s, self.max_bytes, self.clock = max_sessions, max_calls, ttl_s, max_bytes, clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.expired = 0
        self.nbytes = 0  # recorded calls, all sessions
        self.reserved = 0  # admitted calls' largest possible sizes, until they are recorded or released

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, sid: str) -> Session | None:
        return self._sessions.get(sid)

    def admit(self, sid: str) -> Admission:
        """Take a place for one call of session ``sid`` (opened if new), before any work on it; 429 when the store
        has no room for a new session or the session none for another call. Release it (:meth:`Admission.release`,
        a no-op once recorded) whatever happens."""
        session = self._sessions.get(sid)
        if session is None:
            self._drop_expired()
            if len(self._sessions) >= self.max_sessions:
                raise HTTPError(429, f"{self.max_sessions} sessions are open (--openai-max-sessions); fetch and delete "
                                     "finished ones (DELETE /v1/sessions/ID) or retry later", "too_many_sessions",
                                retry_after=self._retry_after())  # fmt: skip
            session = self._sessions[sid] = Session(sid)
        if len(session.calls) + session.pending >= self.max_calls:
            raise HTTPError(429, f"session {sid!r} already holds {self.max_calls} calls (--openai-max-calls-per-session)"
                                 f"{f', {session.pending} of them still running' if session.pending else ''}", "session_full")
        session.pending += 1
        self._touch(session)
        return Admission(self, session)

    def pop(self, sid: str) -> Session | None:
        """Forget session ``sid`` (its admitted calls still running are recorded nowhere)."""
        session = self._sessions.pop(sid, None)
        if session is not None:
            self.nbytes -= session.nbytes
        return session

    def stats(self) -> dict[str, int]:
        """For ``/metrics``: sessions, calls and bytes held, bytes reserved by running calls, and the bounds."""
        return {"open": len(self._sessions), "calls": sum(len(s.calls) for s in self._sessions.values()),
                "running_calls": sum(s.pending for s in self._sessions.values()), "bytes": self.nbytes,
                "reserved_bytes": self.reserved, "max_bytes": self.max_bytes, "max_sessions": self.max_sessions,
                "max_calls_per_session": self.max_calls, "expired": self.expired}  # fmt: skip

    def _touch(self, session: Session) -> None:
        session.last_used = self.clock()
        self._sessions.move_to_end(session.id)

    def _drop_expired(self) -> None:
        """Drop sessions idle for ``ttl_s`` (least recently used first; a session with a call running is not idle)."""
        now = self.clock()
        for sid, session in list(self._sessions.items()):
            if now - session.last_used < self.ttl_s:
                break  # the rest were used more recently
            if session.pending:
                continue
            self.pop(sid)
            self.expired += 1

    def _retry_after(self) -> int:
        """Seconds until the least recently used idle session may be dropped (1 when every session has a call running)."""
        now = self.clock()
        idle = next((s for s in self._sessions.values() if not s.pending), None)
        return 1 if idle is None else max(1, math.ceil(self.ttl_s - (now - idle.last_used)))


class Admission:
    """One admitted call's place in a :class:`SessionStore` (see :meth:`SessionStore.admit`)."""

    def __init__(self, store: SessionStore, session: Session) -> None:
        self.store, self.session = store, session
        self.reserved = 0
        self.open = True

    def reserve(self, nbytes: int) -> None:
        """Hold ``nbytes`` (:func:`expected_call_nbytes`) of the byte budget for this call, before it is sampled;
        413 when one such call exceeds the whole budget, 429 when the budget is in use (after dropping sessions idle
        for the TTL)."""
        store = self.store
        if nbytes > store.max_bytes:
            raise HTTPError(413, f"this call may record {nbytes} bytes (its prompt and max_tokens), more than the whole session "
                                 f"memory budget of {store.max_bytes} bytes (--openai-session-memory-mb); lower max_tokens or "
                                 "shorten the conversation", "session_call_too_large")  # fmt: skip
        if store.nbytes + store.reserved + nbytes > store.max_bytes:
            store._drop_expired()
        if store.nbytes + store.reserved + nbytes > store.max_bytes:
            raise HTTPError(429, f"the session memory budget is in use ({store.nbytes} bytes recorded in {len(store)} sessions, "
                                 f"{store.reserved} reserved by running calls, of {store.max_bytes}: --openai-session-memory-mb); "
                                 "fetch and delete finished sessions (DELETE /v1/sessions/ID) or retry later",
                            "session_memory", retry_after=store._retry_after())  # fmt: skip
        store.reserved += nbytes
        self.reserved += nbytes

    def record(self, call: RecordedCall) -> Session:
        """Store the sampled ``call`` (its actual size replaces the reservation); the session is returned."""
        if not self.open:
            raise RuntimeError("this admission was already recorded or released")
        store, session = self.store, self.session
        nbytes = call_nbytes(call)
        self._close()
        session.calls.append(call)
        if store._sessions.get(session.id) is session:  # not deleted while the call ran
            session.nbytes += nbytes
            store.nbytes += nbytes
            store._touch(session)
        return session

    def release(self) -> None:
        """Give the place back without recording (the call failed or was refused); a no-op once recorded. A session
        opened by this call and left without calls is forgotten."""
        if not self.open:
            return
        self._close()
        session = self.session
        if not session.calls and not session.pending and self.store._sessions.get(session.id) is session:
            del self.store._sessions[session.id]

    def _close(self) -> None:
        self.open = False
        self.store.reserved -= self.reserved
        self.reserved = 0
        self.session.pending -= 1


@dataclass
class Segment:
    """One assembled trajectory: ``prompt_ids`` (the first call's prompt), then ``response_ids`` with
    ``loss_mask`` (1: sampled by the engine; 0: context added between calls) and ``logprobs`` (sampling
    log-probs; 0.0 at context). ``spans``: (start, end, "model" | "observation") over ``response_ids``;
    ``calls``: the indices of the session's calls it holds."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int, str]] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def _append(self, ids: list[int], mask: int, logprobs: list[float] | None, role: str) -> None:
        if not ids:
            return
        start = len(self.response_ids)
        self.response_ids += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.spans.append((start, len(self.response_ids), role))


@dataclass
class Assembly:
    segments: list[Segment]

    @property
    def split(self) -> bool:
        """Whether the session did not assemble into one trajectory (a call extended no earlier context)."""
        return len(self.segments) > 1


def assemble(calls: list[RecordedCall]) -> Assembly:
    """The session's calls as trajectories (module docstring); a call joins the most recent segment whose
    whole context its prompt starts with, else opens a new one."""
    segments: list[Segment] = []
    for i, call in enumerate(calls):
        host = next((s for s in reversed(segments) if call.prompt_ids[: len(s.context)] == s.context), None)
        if host is None:
            host = Segment(list(call.prompt_ids))
            segments.append(host)
        else:
            host._append(call.prompt_ids[len(host.context):], 0, None, "observation")
        host._append(list(call.completion_ids), 1, list(call.logprobs), "model")
        host.calls.append(i)
    return Assembly(segments)
