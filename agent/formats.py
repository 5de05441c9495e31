"""The agent's output format (``rollout.format``): Search-R1 tags, or the model's own chat-template tool calls.

* ``tags`` (default, the paper's): ``<search>…</search>`` / ``<answer>…</answer>`` in the text, passages
  in ``<information>`` blocks (agent/actions.py).
* ``tool_calls``: the format deployments speak (vLLM's tool parsers, the OpenAI API). The search tool is
  declared as a JSON schema (:data:`SEARCH_TOOL`) through the chat template's ``tools=``; the model calls
  it in its own syntax, read by a parser chosen by name (``rollout.tool_parser``,
  :mod:`agent.toolcall_parsers`); each result goes back as a ``tool`` message rendered by the template;
  the final answer is a plain assistant turn (no call) ended by the model's end-of-turn token.

Token-in/token-out as in the tag loop: the sampled ids are appended unchanged; what the environment adds
after a model turn is the text the chat template renders after that turn -- the turn's close, the tool
messages, the next generation prompt -- found by rendering the conversation with a sentinel in place of
the turn (:meth:`ToolCallFormat.after_turn_ids`), tokenised once. When the model's turn ended with the
end-of-turn token the template would also write (ChatML's ``<|im_end|>``), that text is not added again.

A template without tool support (it never reads ``tools``) is refused with an error naming the model and
``rollout.tool_chat_template``, which can supply one: ``chatml_tools`` (bundled: Qwen2.5's hermes-style
tool template with a neutral system prompt, for ChatML models such as SmolLM2) or a Jinja file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Literal

from agent.actions import Action, format_passages
from agent.prompts import BuiltPrompt, build_prompt
from agent.toolcall_parsers import ToolCall, get_tool_parser
from emapg.config import ConfigError

__all__ = ["FORMATS", "SEARCH_TOOL", "TOOL_CHAT_TEMPLATES", "ToolCallFormat", "tool_chat_template", "strip_reasoning",
           "ids_after_turn"]

AgentFormat = Literal["tags", "tool_calls"]
FORMATS: tuple[str, ...] = ("tags", "tool_calls")

#: The built-in agent's one tool, as an OpenAI-style function schema (what ``tools=`` carries).
SEARCH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search a Wikipedia corpus; returns the top passages for the query.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to look up"}},
            "required": ["query"],
        },
    },
}

#: More calls than this in one turn make it an invalid action (a runaway turn is not a hundred searches).
MAX_CALLS_PER_TURN = 8

INVALID_CALL_MESSAGE = (
    "Error: {reason}. To search, call the search tool with {{\"query\": \"...\"}}; to finish, reply with the "
    "answer only, without a tool call."
)
TOOLS_INVALID_MESSAGE = (
    "Error: {reason}. Call one of the tools with JSON arguments that match its schema; to finish, reply with the "
    "answer only, without a tool call."
)
NO_ANSWER_MESSAGE = (
    "Your reply was cut off before it ended. Call the search tool, or reply with a short final answer."
)

# Qwen2.5's tool template (hermes <tool_call> syntax), with a neutral default system prompt.
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Tool templates of other families, written here in each family's format (for models whose own template lacks tools,
# and to prove the parsers of agent/toolcall_parsers.py on a tiny model): Llama 3.1-style headers with JSON calls and
# ``ipython`` results (parser llama3_json), Mistral v3 ``[AVAILABLE_TOOLS]``/``[TOOL_CALLS]``/``[TOOL_RESULTS]``
# (parser mistral), and ChatML with Qwen3-Coder's XML calls (parser qwen3_coder).
LLAMA3_JSON_TEMPLATE = (
    "{{- bos_token if bos_token else '' }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}{%- set msgs = messages[1:] %}"
    "{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- set msgs = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}{{- system }}"
    "{%- if tools %}{{- '\\n\\nGiven the following functions, respond with a JSON for a function call with its proper arguments '"
    " + 'that best answers the prompt, in the format {\"name\": function name, \"parameters\": dictionary of argument name and its '"
    " + 'value}. Do not use variables.\\n\\n' }}{%- for t in tools %}{{- t | tojson }}{{- '\\n\\n' }}{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- for m in msgs %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for c in m.tool_calls %}{%- set f = c.function if c.function is defined else c %}"
    "{{- '{\"name\": \"' + f.name + '\", \"parameters\": ' + (f.arguments if f.arguments is string else f.arguments | tojson) + '}' }}"
    "{%- if not loop.last %}{{- '; ' }}{%- endif %}{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif m.role == 'tool' or m.role == 'ipython' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
MISTRAL_TOOLS_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}{%- set msgs = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set msgs = messages %}{%- endif %}"
    "{%- set last = namespace(user=-1) %}{%- for m in msgs %}{%- if m.role == 'user' %}{%- set last.user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{{- bos_token if bos_token else '' }}"
    "{%- for m in msgs %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and loop.index0 == last.user %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST]' + ((system + '\\n\\n') if system and loop.index0 == last.user else '') + m.content + '[/INST]' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{{- '[TOOL_CALLS][' }}"
    "{%- for c in m.tool_calls %}{%- set f = c.function if c.function is defined else c %}"
    "{{- '{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments if f.arguments is string else f.arguments | tojson) + '}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ']' + eos_token }}"
    "{%- elif m.role == 'assistant' %}{{- m.content + eos_token }}"
    "{%- elif m.role == 'tool' %}{{- '[TOOL_RESULTS]' + ({'content': m.content} | tojson) + '[/TOOL_RESULTS]' }}"
    "{%- endif %}{%- endfor %}"
)
QWEN3_CODER_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}{%- set msgs = messages[1:] %}"
    "{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- set msgs = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for t in tools %}{%- set f = t.function if t.function is defined else t %}"
    "{{- '\\n<function>\\n<name>' + f.name + '</name>\\n<description>' + (f.description or '') + '</description>\\n<parameters>' + (f.parameters | tojson) + '</parameters>\\n</function>' }}"
    "{%- endfor %}{{- '\\n</tools>\\n\\nTo call a function, reply in this format:\\n\\n<tool_call>\\n<function=example_function_name>\\n'"
    " + '<parameter=example_parameter>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for m in msgs %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant' }}{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    "{%- for c in m.tool_calls %}{%- set f = c.function if c.function is defined else c %}{{- '\\n<tool_call>\\n<function=' + f.name + '>\\n' }}"
    "{%- for k, v in f.arguments | items %}{{- '<parameter=' + k + '>\\n' + (v if v is string else v | tojson) + '\\n</parameter>\\n' }}{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{%- if loop.first or msgs[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or msgs[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOOL_CHAT_TEMPLATES: dict[str, str] = {"chatml_tools": CHATML_TOOLS_TEMPLATE, "llama3_json": LLAMA3_JSON_TEMPLATE,
                                       "mistral_tools": MISTRAL_TOOLS_TEMPLATE, "qwen3_coder": QWEN3_CODER_TEMPLATE}

_SENTINEL = "\u2063EMAPG-TURN\u2063"  # never in a real turn; marks where the model's turn sits in a rendering
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def strip_reasoning(text: str) -> str:
    """A final answer without ``<think>…</think>`` blocks (an unclosed ``<think>`` drops the rest), stripped."""
    text = _THINK.sub("", text)
    return text.split("<think>")[0].strip()


def _template_text(template: Any) -> str:
    if isinstance(template, dict):  # named templates ({"default": ..., "tool_use": ...}): transformers picks by name
        return "\n".join(str(v) for v in template.values())
    return str(template or "")


def tool_chat_template(tokenizer, override: str | None) -> str | None:
    """The chat template to render tool conversations with: ``override`` (a bundled name or a Jinja file),
    else the tokenizer's own (None: let transformers pick it); a ConfigError when it has no tool support."""
    model = getattr(tokenizer, "name_or_path", "") or "this model"
    if override:
        if override in TOOL_CHAT_TEMPLATES:
            template = TOOL_CHAT_TEMPLATES[override]
        else:
            path = Path(override).expanduser()
            if not path.is_file():
                raise ConfigError(f"rollout.tool_chat_template: {override!r} is neither a bundled template "
                                  f"({', '.join(TOOL_CHAT_TEMPLATES)}) nor a file")
            template = path.read_text(encoding="utf-8")
        if "tools" not in template:
            raise ConfigError(f"rollout.tool_chat_template {override!r} never reads `tools`: not a tool-calling template")
        return template
    own = getattr(tokenizer, "chat_template", None)
    if not own:
        raise ConfigError(f"rollout.format=tool_calls: {model} has no chat template; set rollout.tool_chat_template "
                          f"(e.g. chatml_tools for ChatML models) or use rollout.format=tags")
    if "tools" not in _template_text(own):
        raise ConfigError(f"rollout.format=tool_calls: the chat template of {model} has no tool support (it never reads "
                          f"`tools`); set rollout.tool_chat_template (e.g. chatml_tools for ChatML models such as SmolLM2) "
                          f"or use rollout.format=tags")
    return None


class ToolCallFormat:
    """Prompts, turn reading and environment messages of ``rollout.format=tool_calls`` (module docstring).

    ``cfg`` is an :class:`agent.rollout.RolloutConfig` (its template, tool parser, tool chat template,
    prompt and observation budgets).
    """

    def __init__(self, tokenizer, cfg: Any, toolbox: Any = None) -> None:
        self.tok, self.cfg = tokenizer, cfg
        self.parser = get_tool_parser(cfg.tool_parser)
        self.template = tool_chat_template(tokenizer, cfg.tool_chat_template)
        # rollout.tools (agent/tools.py): the sources' schemas; the built-in search only when listed there
        self.toolbox = toolbox
        self.tools = list(toolbox.schemas) if toolbox is not None else [SEARCH_TOOL]
        self.builtin_search = toolbox is None or toolbox.builtin_search

    # --- prompts
    def build_prompt(self, question: str) -> BuiltPrompt:
        cfg = self.cfg
        return build_prompt(self.tok, question, cfg.template_name, max_tokens=cfg.max_prompt_tokens,
                            truncation=cfg.prompt_truncation, chat="chat" if self.template is None else "auto",
                            tools=self.tools, chat_template=self.template)

    def render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        """The chat template's text for ``messages`` with the search tool declared."""
        return self.tok.apply_chat_template(messages, tools=self.tools, chat_template=self.template, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)

    # --- one model turn
    def read_turn(self, text: str, finish_reason: str) -> Action:
        """The action of one turn: ``search`` (``queries``: one per call), ``answer`` (plain text, the turn ended
        by the model), or ``invalid`` (``reason``: what was wrong, shown to the model)."""
        parsed = self.parser.parse(text)
        if parsed.errors:
            return Action("invalid", reason="; ".join(parsed.errors))
        if parsed.calls:
            if len(parsed.calls) > MAX_CALLS_PER_TURN:
                return Action("invalid", reason=f"{len(parsed.calls)} tool calls in one turn (at most {MAX_CALLS_PER_TURN})")
            queries = []
            for call in parsed.calls:
                if self.toolbox is not None and self.toolbox.offers(call.name):
                    continue  # an MCP tool: its server checks the arguments against its schema
                if self.toolbox is not None and (call.name != "search" or not self.builtin_search):
                    return Action("invalid", reason=f"unknown tool {call.name!r} (the tools are {', '.join(self.toolbox.names())})")
                query = _search_query(call)
                if not isinstance(query, tuple):
                    return Action("invalid", reason=query)
                queries.append(query[0][: self.cfg.max_query_chars])
            calls = parsed.calls if self.toolbox is not None else ()
            return Action("search", queries[0] if queries else "", queries=tuple(queries), calls=calls)
        if finish_reason != "stop":
            return Action("invalid", reason="cut off")
        return Action("answer", strip_reasoning(parsed.content))

    def script_turns(self, query: str, answer: str) -> list[str]:
        """The two turns of a constructed trajectory (search, then answer), as the model writes them (SFT)."""
        eos = self.tok.eos_token or ""
        return [self.parser.render(ToolCall("search", {"query": query})) + eos, answer + eos]

    # --- what the environment appends
    def results_messages(self, hits: list[list[dict]] | None, n: int, failure: str, *, calls: tuple = (),
                         tool_results: list | tuple = ()) -> list[dict]:
        """One ``tool`` message per call: the passages (Search-R1's ``Doc i(Title: …)`` lines) or the failure text;
        with ``rollout.tools``, ``calls`` are the turn's calls in order, each built-in search answered from ``hits``
        and each MCP call by the next of ``tool_results`` (:class:`agent.tools.ToolResult`)."""
        if calls:
            searches = iter(self.results_messages(hits, n, failure))
            results = iter(tool_results)
            out = []
            for call in calls:
                if self.toolbox is not None and self.toolbox.offers(call.name):
                    out.append({"role": "tool", "name": call.name, "content": next(results).text})
                else:
                    out.append(next(searches))
            return out
        if hits is None:
            return [{"role": "tool", "name": "search", "content": failure} for _ in range(n)]
        return [{"role": "tool", "name": "search", "content": format_passages(h).strip()} for h in hits]

    def invalid_messages(self, action: Action) -> list[dict]:
        """A turn with a malformed call gets a ``tool`` message saying why; a turn cut off, a ``user`` one."""
        if action.reason == "cut off":
            return [{"role": "user", "content": NO_ANSWER_MESSAGE}]
        if self.toolbox is not None and self.toolbox.names() != ["search"]:
            return [{"role": "tool", "name": "tool", "content": TOOLS_INVALID_MESSAGE.format(reason=action.reason)}]
        return [{"role": "tool", "name": "search", "content": INVALID_CALL_MESSAGE.format(reason=action.reason)}]

    def after_turn_ids(self, last_token: int | None, messages: list[dict], max_tokens: int) -> tuple[list[int], bool]:
        """Token ids the template puts after a model turn (its close, ``messages``, the generation prompt),
        capped at ``max_tokens`` (``rollout.obs_truncation``); returns (ids, truncated)."""
        ids = self._after_turn(last_token, messages)
        if len(ids) <= max_tokens:
            return ids, False
        if self.cfg.obs_truncation == "cut":
            return ids[:max_tokens], True
        # keep_tags: shorten the message contents, keep the template's structure (tags, generation prompt).
        frame = len(self._after_turn(last_token, [dict(m, content="") for m in messages]))
        room = max_tokens - frame
        if room < len(messages):
            return ids[:max_tokens], True
        budget = room // len(messages)
        for _ in range(8):
            cut = [dict(m, content=self._cut(m["content"], budget)) for m in messages]
            ids = self._after_turn(last_token, cut)
            if len(ids) <= max_tokens:
                return ids, True
            budget -= max(1, (len(ids) - max_tokens) // len(messages))
            if budget < 1:
                break
        return ids[:max_tokens], True

    def _cut(self, text: str, n: int) -> str:
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
        return text if len(ids) <= n else self.tok.decode(ids[:n], skip_special_tokens=True)

    def _after_turn(self, last_token: int | None, messages: list[dict]) -> list[int]:
        return ids_after_turn(self.tok, self.render, [{"role": "user", "content": "?"}], messages, last_token)


def ids_after_turn(tokenizer, render: Callable[..., str], before: list[dict], after: list[dict],
                   last_token: int | None) -> list[int]:
    """Token ids the chat template writes after an assistant turn that follows ``before``: the turn's close,
    the ``after`` messages and the generation prompt. The turn is rendered as a sentinel and only the text
    after it is tokenised (once), so the sampled ids of the turn are never re-derived from text; when the
    turn's last sampled token is the special token the close starts with (ChatML's ``<|im_end|>``), that text
    is not written twice. ``render(messages, add_generation_prompt=...)`` applies the chat template."""
    text = render([*before, {"role": "assistant", "content": _SENTINEL}, *after], add_generation_prompt=True)
    at = text.rfind(_SENTINEL)
    if at < 0:
        raise ValueError("the chat template does not render assistant turns' content; cannot place tool results")
    rest = text[at + len(_SENTINEL):]
    if last_token is not None and last_token in set(tokenizer.all_special_ids):
        closing = tokenizer.decode([last_token])
        if closing and rest.startswith(closing):
            rest = rest[len(closing):]
    return list(tokenizer(rest, add_special_tokens=False)["input_ids"])


def _search_query(call: ToolCall) -> tuple[str] | str:
    """``(query,)`` of a well-formed search call, or why it is not one."""
    if call.name != "search":
        return f"unknown tool {call.name!r} (the only tool is search)"
    query = call.arguments.get("query")
    if not isinstance(query, str):
        return "search needs a string \"query\" argument"
    query = "".join(ch for ch in query if ch.isprintable() or ch in " \t\n").strip()
    if not query:
        return "empty search query"
    return (query,)
