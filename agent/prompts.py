"""Prompt templates (data) and prompt building (chat template applied exactly once).

A template is a plain string with one ``{question}`` placeholder, substituted by
string replacement (not ``str.format``), so templates may contain braces such as
``\\boxed{}``. Templates live in a registry by descriptive name; ``load_template``
also accepts a path to a text file, so a user can bring their own.

Registered templates:

* ``search_r1`` -- the Search-R1 "base" prompt used by EMA-PG's search setting
  (ALGORITHM.md §4.1). The question is stripped and gets a trailing "?" when it has
  none. The rendered text is byte-identical to the ``prompt`` field of Search-R1's
  NQ parquet files, so a model trained with Search-R1 sees the prompt it knows.
* ``search_tools`` -- the same task for ``rollout.format=tool_calls`` (agent/formats.py): the search
  tool is declared by the chat template (``tools=``), the answer is plain text.
* ``math`` -- the raw problem text, as in the EMA-PG math setting (ALGORITHM.md §5:
  no instruction is added; the DeepSeek-R1-distill chat template supplies
  ``<|User|>...<|Assistant|><think>\\n``).
* ``math_boxed`` -- the raw problem plus DeepSeek's recommended "put your final answer
  within \\boxed{}" line; not what the paper used, useful for small models.

``build_prompt`` wraps the rendered text as one user message and applies the
tokenizer's chat template once (with its default system prompt, as Search-R1 does),
or, for base models without a chat template, uses the raw text. Token ids are
produced here and never re-derived from text later.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

PLACEHOLDER = "{question}"

SEARCH_R1_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time "
    "you get new information. After reasoning, if you find you lack some knowledge, you can call a search "
    "engine by <search> query </search> and it will return the top searched results between <information> "
    "and </information>. You can search as many times as your want. If you find no further external "
    "knowledge needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)

# rollout.format=tool_calls (agent/formats.py): the search tool is declared by the chat template.
SEARCH_TOOLS_TEMPLATE = (
    "Answer the given question. Think step by step. If you lack some knowledge, call the search tool; you can "
    "search as many times as you want. When you know the answer, reply with the answer only (a short phrase, "
    "without detailed illustrations) and no tool call. Question: {question}\n"
)

MATH_TEMPLATE = "{question}"
MATH_BOXED_TEMPLATE = "{question}\nPlease reason step by step, and put your final answer within \\boxed{}."

TEMPLATES: dict[str, str] = {
    "search_r1": SEARCH_R1_TEMPLATE,
    "math": MATH_TEMPLATE,
    "math_boxed": MATH_BOXED_TEMPLATE,
    "search_tools": SEARCH_TOOLS_TEMPLATE,
}

# Question normalisation per template: Search-R1 strips and appends "?" (make_prefix).
_QUESTION_MARK_TEMPLATES = {"search_r1", "search_tools"}

TruncationPolicy = Literal["error", "truncate_question"]
ChatMode = Literal["auto", "chat", "raw"]


class PromptTooLongError(ValueError):
    """A prompt does not fit its token budget and the policy is "error"."""


def register_template(name: str, text: str) -> None:
    """Add a named template (must contain ``{question}`` exactly once)."""
    _check_template(name, text)
    TEMPLATES[name] = text


def _check_template(name: str, text: str) -> None:
    if text.count(PLACEHOLDER) != 1:
        raise ValueError(f"template {name!r} must contain {PLACEHOLDER} exactly once")


def load_template(name_or_path: str) -> str:
    """A registered template by name, or the contents of a UTF-8 text file."""
    if name_or_path in TEMPLATES:
        return TEMPLATES[name_or_path]
    path = Path(name_or_path).expanduser()
    if path.is_file():
        text = path.read_text(encoding="utf-8")
        _check_template(str(path), text)
        return text
    raise ValueError(f"unknown prompt template {name_or_path!r}: not one of {sorted(TEMPLATES)} and not a file")


def normalize_question(question: str, template_name: str) -> str:
    if not isinstance(question, str):
        raise TypeError(f"question must be a string, got {type(question).__name__}")
    q = question.strip()
    if not q:
        raise ValueError("empty question")
    if template_name in _QUESTION_MARK_TEMPLATES and not q.endswith("?"):
        q += "?"
    return q


def render(template: str, question: str) -> str:
    return template.replace(PLACEHOLDER, question)


def uses_chat_template(tokenizer, mode: ChatMode = "auto") -> bool:
    if mode == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat mode requested but the tokenizer has no chat template")
        return True
    if mode == "raw":
        return False
    return bool(getattr(tokenizer, "chat_template", None))


def encode_text(tokenizer, text: str, chat: bool, *, tools: list[dict] | None = None,
                chat_template: str | None = None) -> list[int]:
    """Token ids of ``text`` as the model sees it: one user turn + generation prompt, or raw.

    ``tools`` (function schemas) and ``chat_template`` (a template in place of the tokenizer's) go to
    the chat template (``rollout.format=tool_calls``, agent/formats.py)."""
    if chat:
        extra = {"tools": tools} if tools else {}
        if chat_template is not None:
            extra["chat_template"] = chat_template
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True, **extra
        )
        # The chat template already contains any BOS; don't let the tokenizer add another.
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


@dataclass
class BuiltPrompt:
    """A prompt ready for generation."""

    question: str  # after normalisation and any truncation
    text: str  # the rendered template (before the chat template)
    token_ids: list[int]
    truncated_question_tokens: int = 0  # how many question tokens the truncation policy dropped


def build_prompt(
    tokenizer,
    question: str,
    template: str = "search_r1",
    *,
    max_tokens: int | None = None,
    truncation: TruncationPolicy = "error",
    chat: ChatMode = "auto",
    tools: list[dict] | None = None,
    chat_template: str | None = None,
) -> BuiltPrompt:
    """Render ``template`` for ``question`` and tokenize it once.

    If the prompt exceeds ``max_tokens``: ``"error"`` raises :class:`PromptTooLongError`;
    ``"truncate_question"`` drops tokens from the *start* of the question (the end of a
    question usually carries what is asked) until it fits, and raises only if the
    template alone is too long. Search-R1 instead keeps the last ``max_start_length``
    tokens of the whole prompt, which would cut the instructions; we never do that.
    """
    text_template = load_template(template)
    q = normalize_question(question, template)
    use_chat = chat_template is not None or uses_chat_template(tokenizer, chat)
    text = render(text_template, q)
    ids = encode_text(tokenizer, text, use_chat, tools=tools, chat_template=chat_template)
    if max_tokens is None or len(ids) <= max_tokens:
        return BuiltPrompt(q, text, ids)
    if truncation == "error":
        raise PromptTooLongError(f"prompt has {len(ids)} tokens > max_prompt_tokens={max_tokens}")
    if truncation != "truncate_question":
        raise ValueError(f"unknown truncation policy {truncation!r}")
    q_ids = tokenizer(q, add_special_tokens=False)["input_ids"]
    # Largest kept suffix of the question that fits: binary search over its length.
    lo, hi, best = 0, len(q_ids), None
    while lo <= hi:
        keep = (lo + hi) // 2
        q_cut = tokenizer.decode(q_ids[len(q_ids) - keep :]).strip() if keep else ""
        cand = encode_text(tokenizer, render(text_template, q_cut), use_chat, tools=tools, chat_template=chat_template)
        if len(cand) <= max_tokens:
            best, lo = (q_cut, cand, len(q_ids) - keep), keep + 1
        else:
            hi = keep - 1
    if best is None:
        raise PromptTooLongError(f"the template alone needs more than max_prompt_tokens={max_tokens} tokens")
    q_cut, cand, dropped = best
    return BuiltPrompt(q_cut, render(text_template, q_cut), cand, truncated_question_tokens=dropped)
