"""Parsing the model's action and building the environment's observation.

Text is only *read* here (to find the action); the model's tokens are never
re-tokenized. The only text that is tokenized is the observation, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tasks.qa import find_tags

STOP_STRINGS = ("</search>", "</answer>")

# Search-R1's corrective observation for a turn with no valid action (generation.py).
INVALID_ACTION_MESSAGE = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)
INFO_OPEN = "\n\n<information>"
INFO_CLOSE = "</information>\n\n"
# Ours (Search-R1 has no retry and no failure path: a failed request crashes the run).
SEARCH_FAILED_MESSAGE = "The search engine is unavailable right now; no documents were retrieved."

ActionKind = Literal["search", "answer", "invalid"]


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    content: str = ""  # stripped query or answer; "" for invalid
    reason: str = ""  # why an action is invalid ("no_tag", "empty_query", ...)
    queries: tuple[str, ...] = ()  # search: every query of the turn (one here; one per call in the tool-call format)
    calls: tuple = ()  # tool-call format with rollout.tools: every call of the turn, in order (agent.toolcall_parsers.ToolCall)


def parse_action(text: str, *, max_query_chars: int = 1000) -> Action:
    """The first well-formed search/answer action in ``text``.

    * Unbalanced or mismatched tags (``<search> x </answer>``) are not actions.
    * An empty search query is invalid (the retriever would embed an empty string);
      an empty answer is a (wrong) answer, as in Search-R1.
    * Queries longer than ``max_query_chars`` characters are cut (the retriever has
      its own limits; a runaway generation should not become a 100 kB request).
    """
    first = next(find_tags(text, ("search", "answer")), None)  # the first complete tag, names matching
    if first is None:
        return Action("invalid", reason="no_tag")
    kind, content = first[0], first[1].strip()
    if kind == "search":
        # Control characters carry no meaning for retrieval and can break JSON logs.
        content = "".join(ch for ch in content if ch.isprintable() or ch in " \t\n").strip()
        if not content:
            return Action("invalid", reason="empty_query")
        return Action("search", content[:max_query_chars], queries=(content[:max_query_chars],))
    return Action("answer", content)


def format_passages(hits: list[dict]) -> str:
    """Search-R1 passage format: ``Doc i(Title: <first line>) <rest>\\n`` per hit (i from 1).

    ``contents`` follows the wiki-18 convention ``"Title"\\ntext``; the title keeps its
    quotes. A hit without a newline is all title and empty text, exactly as Search-R1
    splits it.
    """
    parts = []
    for i, hit in enumerate(hits, start=1):
        contents = str(hit.get("contents", ""))
        title, _, body = contents.partition("\n")
        parts.append(f"Doc {i}(Title: {title}) {body}\n")
    return "".join(parts)


def information_text(body: str) -> str:
    """Search-R1 observation: ``\\n\\n<information>`` + stripped passages + ``</information>\\n\\n``."""
    return f"{INFO_OPEN}{body.strip()}{INFO_CLOSE}"


ObsTruncation = Literal["keep_tags", "cut"]


def observation_ids(tokenizer, text: str, max_tokens: int, policy: ObsTruncation = "keep_tags") -> tuple[list[int], bool]:
    """Tokenize an observation once and cap it at ``max_tokens``; returns (ids, truncated).

    If it fits, the ids are the tokenization of the whole text (as Search-R1 does).
    Otherwise ``"cut"`` keeps the first ``max_tokens`` ids (Search-R1's behaviour, which
    drops the closing ``</information>``), and ``"keep_tags"`` (default) truncates the
    passages in the middle so that the observation still ends with
    ``</information>\\n\\n``: the model is never shown an unterminated block.
    """
    if max_tokens < 1:
        raise ValueError("max_tokens for an observation must be >= 1")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) <= max_tokens:
        return ids, False
    if policy == "cut" or not (text.startswith(INFO_OPEN) and text.endswith(INFO_CLOSE)):
        return ids[:max_tokens], True
    head = list(tokenizer(INFO_OPEN, add_special_tokens=False)["input_ids"])
    tail = list(tokenizer(INFO_CLOSE, add_special_tokens=False)["input_ids"])
    room = max_tokens - len(head) - len(tail)
    if room < 1:
        return ids[:max_tokens], True
    body = text[len(INFO_OPEN) : len(text) - len(INFO_CLOSE)]
    body_ids = list(tokenizer(body, add_special_tokens=False)["input_ids"])[:room]
    return head + body_ids + tail, True
