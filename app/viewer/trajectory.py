"""A recorded trajectory as display data: segments of text pieces, never markup.

What the browser receives is data: a trajectory is a list of *segments* (the prompt, each model turn, each
observation), each a list of *pieces* ``{"text": str, "gold": bool}``; the page puts each piece into the DOM as a
text node, so model output (untrusted: a ``<script>``, an ``<img onerror>``, a ``javascript:`` link) is shown as
the characters it is and does nothing. Gold answers are marked where they occur in the passages the search
returned (and in the answer), whole words only, case-insensitively.

Three sources are read: ``samples.jsonl`` rows that carry ``segments`` (written by :mod:`trainer.samples`: each
span decoded on its own, with its token count and loss mask), older rows that carry only ``response``, and
``emapg eval`` item records; the last two are split at their observations (``<information>...</information>``,
or ``<tool_response>...</tool_response>`` in the tool-call format).
"""

from __future__ import annotations

import bisect
import re
from typing import Any

from agent.actions import INVALID_ACTION_MESSAGE

#: An observation inside a decoded response: Search-R1's information block, a tool-call format tool response, or
#: the corrective message the loop inserts after an invalid action.
OBSERVATION = re.compile(r"<information>.*?(?:</information>|\Z)|<tool_response>.*?(?:</tool_response>|\Z)|"
                         + re.escape(INVALID_ACTION_MESSAGE.strip()), re.S)
#: A passage of an observation, as :func:`agent.actions.format_passages` writes it.
PASSAGE = re.compile(r"(?:^|\n)Doc \d+\(Title: ")
#: The tags around an observation's passages (a chat template may wrap them in more).
WRAPPER = re.compile(r"<(information|tool_response)>(.*?)(?:</\1>|\Z)", re.S)


#: Bounds on the gold-answer marking of one text (a crafted record must not make it slow): the golds looked for, and
#: the occurrences marked (the rest of the text is shown unmarked).
MAX_GOLDS, MAX_GOLD_SPANS = 64, 10_000
_WORD = re.compile(r"\w")
_SPACE = re.compile(r"\s+")
#: Characters that reorder the text around them (bidirectional embeddings, overrides, isolates and marks).
BIDI_CONTROLS = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
_VISIBLE = {ord(c): f"[U+{ord(c):04X}]" for c in BIDI_CONTROLS}


def shown(text: str) -> str:
    """``text`` with every bidirectional control character written as its code point (``[U+202E]``): model text can
    hold them, and in the page one would reorder the text and the labels around it."""
    return text.translate(_VISIBLE)


def _folded(text: str) -> str:
    """``text`` lower-cased position for position (a character whose lower case is longer is kept as it is)."""
    low = text.lower()
    if len(low) == len(text):
        return low
    return "".join(c if len(c.lower()) != 1 else c.lower() for c in text)


class _Collapsed:
    """``text`` case-folded with every run of whitespace as one space, and the map back to ``text``'s positions."""

    def __init__(self, text: str) -> None:
        folded = _folded(text)
        parts, self.starts, self.origins, at, size = [], [], [], 0, 0
        for m in _SPACE.finditer(folded):
            if m.start() > at:
                parts.append(folded[at:m.start()])
                self.starts.append(size)
                self.origins.append(at)
                size += m.start() - at
            parts.append(" ")
            self.starts.append(size)
            self.origins.append(m.start())
            size += 1
            at = m.end()
        parts.append(folded[at:])
        self.starts.append(size)
        self.origins.append(at)
        self.text = "".join(parts)

    def origin(self, position: int) -> int:
        i = bisect.bisect_right(self.starts, position) - 1
        return self.origins[i] + (position - self.starts[i])


def gold_spans(text: str, golds: list[str]) -> list[tuple[int, int]]:
    """Sorted, merged ``[start, end)`` spans of ``text`` where a gold answer occurs (case-insensitive, any run of
    whitespace between its words; a gold that starts or ends with a word character must not be part of a longer
    word: gold "1" is not marked in "1990").

    Linear in the text for each gold (a substring search in the case-folded, whitespace-collapsed text, never a
    backtracking regular expression: a 500-word gold over a megabyte of its own words once stalled the viewer), and
    bounded: at most :data:`MAX_GOLDS` golds and :data:`MAX_GOLD_SPANS` occurrences."""
    wanted = sorted({" ".join(_folded(g).split()) for g in golds if g and g.strip()})[:MAX_GOLDS]
    if not wanted or not text:
        return []
    c = _Collapsed(text)
    hay, found = c.text, []
    for needle in wanted:
        head, tail = bool(_WORD.match(needle[0])), bool(_WORD.match(needle[-1]))
        at = hay.find(needle)
        while at >= 0 and len(found) < MAX_GOLD_SPANS:
            end = at + len(needle)
            if (not head or at == 0 or not _WORD.match(hay[at - 1])) and (not tail or end == len(hay) or not _WORD.match(hay[end])):
                found.append((c.origin(at), c.origin(end - 1) + 1))
                at = hay.find(needle, end)
            else:
                at = hay.find(needle, at + 1)
    merged: list[tuple[int, int]] = []
    for start, end in sorted(found):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def pieces(text: str, golds: list[str] = ()) -> list[dict[str, Any]]:
    """``text`` cut into ``{"text", "gold"}`` pieces, the gold answers' occurrences marked."""
    out, at = [], 0
    for start, end in gold_spans(text, list(golds)):
        if start > at:
            out.append({"text": text[at:start], "gold": False})
        out.append({"text": text[start:end], "gold": True})
        at = end
    if at < len(text) or not out:
        out.append({"text": text[at:], "gold": False})
    return out


def split_response(response: str) -> list[dict[str, Any]]:
    """A decoded response cut into model turns and observations (for records without ``segments``); token counts
    are unknown (None), masks inferred from the role (observations are never trained on)."""
    out, at = [], 0
    for m in OBSERVATION.finditer(response):
        if m.start() > at:
            out.append({"role": "model", "action": "", "text": response[at:m.start()], "tokens": None, "masked": False})
        action = "invalid" if m.group(0) == INVALID_ACTION_MESSAGE.strip() else "information"
        out.append({"role": "observation", "action": action, "text": m.group(0), "tokens": None, "masked": True})
        at = m.end()
    if at < len(response) or not out:
        out.append({"role": "model", "action": "", "text": response[at:], "tokens": None, "masked": False})
    return out


def passages(text: str) -> list[str]:
    """An observation's passages (``Doc i(Title: ...) ...`` blocks), or [] when it holds none (a failure message)."""
    inside = WRAPPER.search(text)
    body = (inside.group(2) if inside else text).strip()
    starts = [m.start() + (1 if body[m.start()] == "\n" else 0) for m in PASSAGE.finditer(body)]
    if not starts or starts[0] != 0:
        return []
    return [body[s:e].strip() for s, e in zip(starts, [*starts[1:], len(body)])]


def _segment(raw: dict[str, Any], golds: list[str], query: str | None) -> dict[str, Any]:
    text = str(raw.get("text", ""))
    seg = {"role": raw.get("role", "model"), "action": raw.get("action", ""), "tokens": raw.get("tokens"),
           "masked": bool(raw.get("masked", raw.get("role") == "observation")), "query": query}
    if seg["role"] == "observation":
        docs = passages(text)
        seg["passages"] = [{"pieces": pieces(d, golds), "has_gold": bool(gold_spans(d, golds))} for d in docs]
        seg["pieces"] = [] if docs else pieces(text, golds)
        seg["has_gold"] = any(p["has_gold"] for p in seg["passages"]) or any(p["gold"] for p in seg["pieces"])
    else:
        seg["pieces"] = pieces(text)
    return seg


def render(record: dict[str, Any]) -> dict[str, Any]:
    """A ``samples.jsonl`` row or an eval item record (its first sample's response) as display data."""
    golds = [str(g) for g in (record.get("golds") or [])]
    raw = record.get("segments")
    inferred = raw is None
    if raw is None:
        raw = split_response(str(record.get("response", "")))
    queries = [str(q) for q in (record.get("queries") or [])]
    searched = iter(queries)
    segments = []
    for i, s in enumerate(raw):
        # the model turn a search's observation follows is the one that sent that query
        follows = i + 1 < len(raw) and raw[i + 1].get("role") == "observation" and raw[i + 1].get("action") != "invalid"
        is_search = s.get("role") == "model" and (s.get("action") == "search" or (inferred and follows))
        segments.append(_segment(s, golds, next(searched, None) if is_search else None))
    tokens = {k: record.get(k) for k in ("prompt_tokens", "response_tokens", "model_tokens")}
    if tokens["model_tokens"] is None and not inferred:
        tokens["model_tokens"] = sum(s["tokens"] or 0 for s in segments if not s["masked"])
    answer = record.get("answer", record.get("prediction"))
    return {
        "question": str(record.get("question", "")),
        "golds": golds,
        "prompt": pieces(str(record["prompt"])) if record.get("prompt") else None,
        "segments": segments,
        "segments_inferred": inferred,
        "answer": None if answer is None else str(answer),
        "answer_pieces": None if answer is None else pieces(str(answer), golds),
        "reward": record.get("reward"),
        "advantage": record.get("advantage"),
        "scores": record.get("scores"),
        "tokens": tokens,
        "stop_reason": record.get("stop_reason"),
        "searches": record.get("searches", len(queries)),
        "queries": queries,
        "format": record.get("format", "tags"),
        "group_id": record.get("group_id"),
        "step": record.get("step"),
        "gold_shown": any(s.get("has_gold") for s in segments),
    }
