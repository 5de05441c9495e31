"""Weight-scripted tool callers: the tiny Qwen2 speaking hermes tool calls (tests, benchmarks).

:func:`build_tool_tiny` gives the tiny Qwen2's tokenizer Qwen's tool-call pieces as added tokens (``<tool_call>``,
``</tool_call>``, the JSON head of a search call and its tail) and the bundled tool chat template
(agent/formats.py ``chatml_tools``), over a random untied model of the grown vocabulary. Whole pieces as
single tokens make a call a bigram chain, so :func:`agent.scripted.save_scripted` can script a model that
emits a real hermes call on every turn (:data:`TOOL_SEARCH_SCRIPT`), answers in plain text at once
(:data:`TOOL_ANSWER_SCRIPT`) or writes a malformed call (:data:`TOOL_BROKEN_SCRIPT`).
"""

from __future__ import annotations

from pathlib import Path

from agent.scripted import build_untied_tiny

CALL_HEAD = '{"name": "search", "arguments": {"query": "'
CALL_TAIL = '"}}'
TOOL_SEARCH_SCRIPT = f"<tool_call>{CALL_HEAD}capital of France{CALL_TAIL}</tool_call><|im_end|>"
TOOL_ANSWER_SCRIPT = "Paris<|im_end|>"
TOOL_BROKEN_SCRIPT = "<tool_call>broken</tool_call><|im_end|>"


# Two tools in one turn (rollout.tools=[search, calculator]): the calculator call's open and close are single added
# tokens (each holds <tool_call> / </tool_call>), so the chain's tokens stay unique and the hermes parser reads both calls.
CALC_OPEN = '<tool_call>{"name": "calculate", "arguments": {"expression": "'
CALC_CLOSE = '"} }</tool_call>'  # not '"}}</tool_call>': the search call's tail would match it
TOOL_SEARCH_AND_CALC_SCRIPT = f"<tool_call>{CALL_HEAD}capital of France{CALL_TAIL}</tool_call>{CALC_OPEN}7*8{CALC_CLOSE}<|im_end|>"


def build_two_tool_tiny(out: Path, tiny_dir: Path, seed: int = 3) -> Path:
    """:func:`build_tool_tiny` with the calculator call's tokens too (for :data:`TOOL_SEARCH_AND_CALC_SCRIPT`)."""
    from agent.formats import CHATML_TOOLS_TEMPLATE

    def edit(tok) -> None:
        tok.add_tokens(["<tool_call>", "</tool_call>", CALL_HEAD, CALL_TAIL, CALC_OPEN, CALC_CLOSE])
        tok.chat_template = CHATML_TOOLS_TEMPLATE

    return build_untied_tiny(out, tiny_dir, seed=seed, edit_tokenizer=edit)


def build_tool_tiny(out: Path, tiny_dir: Path, seed: int = 2) -> Path:
    """The tiny Qwen2 of ``tiny_dir`` with the tool-call tokens and template (module docstring), random weights."""
    from agent.formats import CHATML_TOOLS_TEMPLATE

    def edit(tok) -> None:
        tok.add_tokens(["<tool_call>", "</tool_call>", CALL_HEAD, CALL_TAIL])
        tok.chat_template = CHATML_TOOLS_TEMPLATE

    return build_untied_tiny(out, tiny_dir, seed=seed, edit_tokenizer=edit)
