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

:class:`SessionStore` bounds memory: at most ``max_sessions`` sessions of at most ``max_calls`` calls; a
session idle for ``ttl_s`` seconds is dropped when room is needed; a new session beyond the limit is
refused (429) rather than evicting one an agent may still be using.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from emapg.server_input import HTTPError

__all__ = ["RecordedCall", "Session", "SessionStore", "Segment", "Assembly", "assemble"]


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


@dataclass
class Session:
    id: str
    calls: list[RecordedCall] = field(default_factory=list)
    last_used: float = 0.0


class SessionStore:
    """Sessions by id, bounded (module docstring). ``clock`` is injectable for tests of the TTL."""

    def __init__(self, max_sessions: int, max_calls: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_sessions, self.max_calls, self.ttl_s, self.clock = max_sessions, max_calls, ttl_s, clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.expired = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, sid: str) -> Session | None:
        return self._sessions.get(sid)

    def record(self, sid: str, call: RecordedCall) -> Session:
        """Append ``call`` to session ``sid`` (opened if new); 429 when no room."""
        session = self._sessions.get(sid)
        if session is None:
            self._drop_expired()
            if len(self._sessions) >= self.max_sessions:
                raise HTTPError(429, f"{self.max_sessions} sessions are open (--openai-max-sessions); fetch and delete "
                                     "finished ones (DELETE /v1/sessions/ID) or retry later", "too_many_sessions")
            session = self._sessions[sid] = Session(sid)
        if len(session.calls) >= self.max_calls:
            raise HTTPError(429, f"session {sid!r} already holds {self.max_calls} calls (--openai-max-calls-per-session)",
                            "session_full")
        session.calls.append(call)
        session.last_used = self.clock()
        self._sessions.move_to_end(sid)
        return session

    def pop(self, sid: str) -> Session | None:
        return self._sessions.pop(sid, None)

    def _drop_expired(self) -> None:
        now = self.clock()
        while self._sessions:
            sid, oldest = next(iter(self._sessions.items()))
            if now - oldest.last_used < self.ttl_s:
                break
            del self._sessions[sid]
            self.expired += 1


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
