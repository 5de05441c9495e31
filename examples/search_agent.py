"""An external agent written against the plain OpenAI API: search through function calling, then answer.

Nothing in it is ema-pg's agent loop: it sends messages and a tool schema with the official ``openai``
client, runs the tool calls it gets back itself (here on the run's retriever, or a retriever server named
by ``$EMAPG_RETRIEVER_URL`` when run on its own) and returns the model's final text. Trained as is::

    emapg train --config configs/search_tiny_cpu.yaml rollout.agent=examples.search_agent:solve

(run from the repository root, so that ``examples`` is importable; agent/external.py says what the
function receives). :func:`solve_responses` is the same agent written against the Responses API
(``client.responses.create`` with ``previous_response_id``; ``rollout.agent=examples.search_agent:solve_responses``);
:func:`solve_compacting` rewrites its history every few rounds (its sessions split into several trained contexts).
Against any OpenAI-compatible server, e.g. ``emapg engine serve``::

    python examples/search_agent.py --base-url http://127.0.0.1:8001/v1 "who wrote hamlet"
"""

from __future__ import annotations

import json
import os
from typing import Any

SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search a Wikipedia corpus; returns the top passages for the query.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
PROMPT = ("Answer the given question. If you lack some knowledge, call the search tool. When you know the answer, "
          "reply with the answer only (a short phrase) and no tool call. Question: {question}")


def _passages(hits: list[dict], max_chars: int) -> str:
    """The hits as numbered lines, each cut to ``max_chars`` characters (the context is the model's budget)."""
    return "\n".join(f"Doc {i}: {str(h.get('contents', ''))[:max_chars]}" for i, h in enumerate(hits, start=1))


def _retriever_or_default(retriever: Any) -> Any:
    """``retriever``, or a client of the server at ``$EMAPG_RETRIEVER_URL`` (default http://127.0.0.1:8000)."""
    if retriever is not None:
        return retriever
    from retriever.client import RetrieverClient

    return RetrieverClient(os.environ.get("EMAPG_RETRIEVER_URL", "http://127.0.0.1:8000"))


def _search(arguments: str, retriever: Any, topk: int, max_chars: int) -> tuple[str, str]:
    """One ``search`` tool call from its JSON ``arguments``: (the query, or "?" when the arguments are unreadable;
    the tool's result text, an ``Error: ...`` line when the call fails)."""
    try:
        query = str(json.loads(arguments)["query"])
        return query, _passages(retriever.retrieve([query], topk=topk)[0], max_chars)
    except (ValueError, KeyError, TypeError) as e:
        return "?", f"Error: {type(e).__name__}: {e}"


def solve(client: Any, row: dict, session_id: str, retriever: Any = None, sampling: dict | None = None,
          max_turns: int = 2, topk: int = 2, max_chars: int = 300) -> str | None:
    """Up to ``max_turns`` rounds of tool calls, then the model's plain answer (None if it never gives one)."""
    retriever = _retriever_or_default(retriever)
    messages: list[dict] = [{"role": "user", "content": PROMPT.format(question=row["question"])}]
    for _ in range(max_turns + 1):
        resp = client.chat.completions.create(model="policy", messages=messages, tools=[SEARCH], **(sampling or {}))
        message = resp.choices[0].message
        if not message.tool_calls:
            return (message.content or "").strip()
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            _, result = _search(call.function.arguments, retriever, topk, max_chars)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


def solve_compacting(client: Any, row: dict, session_id: str, retriever: Any = None, sampling: dict | None = None,
                     max_turns: int = 3, compact_every: int = 2, topk: int = 2, max_chars: int = 300) -> str | None:
    """:func:`solve` with context compaction, as long-running agents do: after every ``compact_every`` rounds of tool
    calls the conversation is rewritten as one user message holding the question and the tool results so far (the
    calls and the model's turns dropped). The recorded session then splits into several contexts, one per
    compaction; every one is trained, each with the episode's reward (agent/external.py)."""
    retriever = _retriever_or_default(retriever)
    prompt = PROMPT.format(question=row["question"])
    messages: list[dict] = [{"role": "user", "content": prompt}]
    notes: list[str] = []
    for turn in range(max_turns + 1):
        resp = client.chat.completions.create(model="policy", messages=messages, tools=[SEARCH], **(sampling or {}))
        message = resp.choices[0].message
        if not message.tool_calls or turn == max_turns:
            return None if message.tool_calls else (message.content or "").strip()
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            query, result = _search(call.function.arguments, retriever, topk, max_chars)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            notes.append(f"search({query!r}) found:\n{result}")
        if (turn + 1) % compact_every == 0:  # rewrite the history: the question and the notes, nothing else
            messages = [{"role": "user", "content": prompt + "\n\nWhat your searches found so far:\n" + "\n".join(notes)}]
    return None


def contains_gold(row: dict, answer: str | None) -> float:
    """A reward function for ``rollout.agent_reward=examples.search_agent:contains_gold``: 1 when the answer
    contains a gold answer (case-insensitive), else 0 -- more lenient than the exact-match metric."""
    if not answer:
        return 0.0
    return float(any(str(g).lower() in answer.lower() for g in row.get("answers", [])))


if __name__ == "__main__":
    import argparse

    import openai

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("question")
    p.add_argument("--base-url", default="http://127.0.0.1:8001/v1")
    p.add_argument("--api-key", default=os.environ.get("EMAPG_ENGINE_API_KEY", "none"))
    args = p.parse_args()
    print(solve(openai.OpenAI(base_url=args.base_url, api_key=args.api_key), {"question": args.question}, "cli"))


def solve_responses(client: Any, row: dict, session_id: str, retriever: Any = None, sampling: dict | None = None,
                    max_turns: int = 2, topk: int = 2, max_chars: int = 300) -> str | None:
    """:func:`solve` over the Responses API: the tool results go back as ``function_call_output`` items chained by
    ``previous_response_id`` (the server keeps the conversation)."""
    retriever = _retriever_or_default(retriever)
    tool = {"type": "function", **SEARCH["function"]}
    options = dict(sampling or {})
    if "max_tokens" in options:
        options["max_output_tokens"] = options.pop("max_tokens")
    resp = client.responses.create(model="policy", input=PROMPT.format(question=row["question"]), tools=[tool], **options)
    for _ in range(max_turns):
        calls = [o for o in resp.output if o.type == "function_call"]
        if not calls:
            return resp.output_text.strip()
        outputs = []
        for call in calls:
            _, result = _search(call.arguments, retriever, topk, max_chars)
            outputs.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
        resp = client.responses.create(model="policy", previous_response_id=resp.id, input=outputs, tools=[tool], **options)
    calls = [o for o in resp.output if o.type == "function_call"]
    return None if calls else resp.output_text.strip()
