"""Multi-turn search-agent rollouts (and single-turn math rollouts), token-exact.

The loop follows Search-R1 (ALGORITHM.md §4.2): up to ``max_turns`` search rounds,
then one final turn in which a search is not executed; each round generates for all
active trajectories in one engine call, runs one batched retrieval for all searches,
and appends the observation.

Where we depart from Search-R1, on purpose:

* **Token ids are appended directly.** Search-R1 decodes each turn, cuts the text
  after the first closing tag and re-tokenizes it, which can change tokens (and drops
  the EOS). Here generation stops at ``</search>``/``</answer>`` (stop strings, the
  stop text kept), and the sampled ids go into the trajectory unchanged; text is
  decoded only to *read* the action. Only observation text is tokenized, once. So the
  tokens trained on are exactly the tokens sampled, and ``loss_mask`` (1 = sampled,
  0 = observation) is right by construction.
* A turn that ends with EOS or hits the per-turn cap without an action is an invalid
  action (Search-R1's corrective message follows); its EOS token stays in the
  response because it was sampled.
* The rolling context is never cut. Search-R1 keeps the last ``max_prompt_length``
  tokens, which silently drops the instructions; we stop the trajectory with
  ``stop_reason="context"`` when the next turn would not fit the engine's window.
* Retrieval failures (timeout, 5xx, connection refused) become an observation that
  says the search failed, counted in ``search_failures``; Search-R1 crashes.
* Any exception while handling one trajectory marks only that trajectory
  (``stop_reason="error"``); the batch continues.
* Empty search queries are invalid actions (Search-R1 would send "" to the retriever).

Two formats (``RolloutConfig.format``, agent/formats.py): ``tags`` (the above) and ``tool_calls``, where the
search tool is declared through the chat template, the model calls it in its own syntax (several calls in a
turn are several searches), results come back as template-rendered ``tool`` messages and the final answer is
plain text. Budgets, invalid actions, failures and token exactness are the same code in both.

Two drivers (``RolloutConfig.mode``):

* ``"batched"`` -- lock-step turns as in Search-R1: turn t of every trajectory is one
  engine call, then one retrieval call.
* ``"async"`` -- trajectories proceed independently over the engine's continuous-
  batching interface (``submit``/``step``): when a trajectory's turn finishes, its
  search is sent to a retrieval thread pool right away (searches that finish in the
  same engine step share one request) and its next turn is submitted as soon as the
  observation arrives, while the engine keeps generating for the others. With vLLM
  every ``step`` advances all running requests by one token, so nobody waits for the
  slowest generation; the transformers engine runs queued requests to completion per
  step, so there the async driver only overlaps retrieval with generation.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import inspect
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from agent.actions import (
    INVALID_ACTION_MESSAGE,
    SEARCH_FAILED_MESSAGE,
    STOP_STRINGS,
    Action,
    format_passages,
    information_text,
    observation_ids,
    parse_action,
)
from agent.engines.base import Engine, GenerationOutput, SamplingParams
from agent.formats import AgentFormat, ToolCallFormat
from agent.prompts import BuiltPrompt, build_prompt
from agent.spans import Span, TrainingSegment
from emapg.config import ConfigError, option
from tasks.task import Task, get_task

log = logging.getLogger(__name__)

StopReason = Literal["answer", "max_turns", "length", "context", "error"]


@dataclass
class RolloutConfig:
    """Settings of the rollout loop (defaults: the paper's search setting, ALGORITHM.md §3.1, §4)."""

    task: Literal["search", "math"] = option("search", help="search: multi-turn Search-R1 loop; math: one turn, no tools")
    template: str | None = option(
        None, help="prompt template name (agent.prompts.TEMPLATES) or file path; default search_r1 / math by task"
    )
    chat: Literal["auto", "chat", "raw"] = option(
        "auto", help="apply the tokenizer's chat template (auto: when it has one), or use the raw text (base models)"
    )
    max_turns: int = option(4, help="maximum number of searches; one more final turn follows with search disabled")
    max_tokens_per_turn: int = option(500, help="generation cap of one model turn (tokens)")
    max_obs_tokens: int = option(500, help="cap on the tokens of one observation (Search-R1 max_obs_length)")
    obs_truncation: Literal["keep_tags", "cut"] = option(
        "keep_tags",
        help="over-long observations: keep_tags trims the passages but keeps </information>; cut keeps the first tokens",
    )
    max_response_tokens: int = option(4096, help="cap on the whole response (model + observation tokens)")
    max_prompt_tokens: int = option(2048, help="cap on the prompt tokens (Search-R1 max_start_length)")
    prompt_truncation: Literal["error", "truncate_question"] = option(
        "error", help="prompt over max_prompt_tokens: error, or drop tokens from the start of the question"
    )
    max_context_tokens: int | None = option(
        None, help="prompt + response must fit this many tokens (default: the engine's max_model_len)"
    )
    topk: int = option(3, help="passages retrieved per search")
    temperature: float = option(1.0, ge=0, help="sampling temperature (0 = greedy)")
    top_p: float = option(0.95, gt=0, le=1, help="nucleus sampling threshold (Search-R1 passes 0.95 to vLLM)")
    top_k: int = option(-1, help="top-k sampling (-1 = off)")
    seed: int | None = option(0, help="base seed; each trajectory/turn gets its own derived seed (None: random)")
    n_samples: int = option(1, help="samples per prompt (GRPO group size); samples of one prompt share a group_id")
    mode: Literal["batched", "async"] = option(
        "batched", help="batched: lock-step turns; async: trajectories proceed independently (see module doc)"
    )
    retrieval_workers: int = option(4, help="async mode: concurrent retrieval requests")
    max_query_chars: int = option(1000, help="search queries are cut to this many characters")
    allowed_token_ids: list[int] | None = option(
        None, help="constrained decoding: sample only these token ids (debugging, format tests); None = all"
    )
    search_failure_message: str = option(
        SEARCH_FAILED_MESSAGE, help="text inside <information> when a search fails (timeout, 5xx, server down)"
    )
    format: AgentFormat = option(
        "tags", help="search task: tags (Search-R1's <search>/<answer> in the text) or tool_calls (the chat template's "
        "own tool calls: the search tool declared with tools=, results as tool messages, a plain-text final answer; "
        "agent/formats.py)")
    tool_parser: str = option("hermes", help="format=tool_calls: parser of the model's tool-call syntax "
                                             "(agent.toolcall_parsers: hermes = Qwen/Hermes <tool_call>{json}</tool_call>; llama3_json = Llama 3.x "
                                             "JSON calls; mistral = [TOOL_CALLS]; qwen3_coder = Qwen3-Coder XML <function=...>)")
    tool_chat_template: str | None = option(
        None, help="format=tool_calls: chat template to render tools with, in place of the tokenizer's (for models whose "
        "template has no tool support): chatml_tools (bundled, ChatML models such as SmolLM2), llama3_json, mistral_tools, "
        "qwen3_coder (bundled, in those families' formats) or a Jinja file")
    tools: list[str] = option(
        [], help="format=tool_calls: the agent's tool sources (docs/mcp.md): 'search' (the built-in search, answered by the "
        "retriever), 'calculator' (the bundled sandboxed calculator, agent/calculator.py), an MCP server's URL "
        "(http://HOST:PORT/mcp, e.g. `emapg serve --mcp`) or 'stdio:COMMAND ARGS' (an MCP server launched over stdio); every tool an MCP server lists is offered with its own schema. Empty: the built-in "
        "search alone")
    tool_timeout_s: float = option(30.0, gt=0, help="rollout.tools: seconds an MCP tool call may take; a call past it is "
                                                    "answered to the model as timed out and counted as a tool failure")
    max_tool_output_chars: int = option(16000, ge=1, help="rollout.tools: characters of an MCP tool's output given to the model; "
                                                    "a longer output is cut there, with a note, and counted as a tool failure")
    tool_connect_timeout_s: float = option(60.0, gt=0, help="rollout.tools: seconds an MCP server may take to connect (the "
                                                          "transport and handshake) and, again, to list its tools; past it the run "
                                                          "stops with an error naming the server and the step, never hangs")
    tool_api_key_env: str | None = option(
        None, help="rollout.tools: the name of an environment variable holding the API key of the HTTP MCP servers, sent "
        "as 'Authorization: Bearer KEY' to each (e.g. EMAPG_RETRIEVER_API_KEY for `emapg serve --mcp` started with a key); "
        "the run refuses to start when it is unset. None: no key")
    tool_headers: dict[str, str] = option(
        {}, help="rollout.tools: extra HTTP headers sent to every HTTP MCP server (e.g. X-API-Key=KEY); "
        "rollout.tool_api_key_env's Authorization header is added to them")
    agent: str | None = option(
        None, help="an external agent, module:function (agent/external.py): called per trajectory with an openai client "
        "pointed at the policy's recording OpenAI endpoint, the task row and a session id; returns its final answer. "
        "None: the built-in agent")
    agent_reward: str | None = option(
        None, help="a reward function module:function(row, answer) -> float, called per trajectory with the task row (gold "
        "answers included) and the final answer (None when there is none) in place of the task's QA metrics; None: the metrics")
    agent_workers: int = option(8, help="agent: trajectories run concurrently")
    agent_timeout_s: float = option(600.0, gt=0, help="agent: seconds per model call of the agent's client")

    def validate(self) -> None:
        for name in ("max_tokens_per_turn", "max_obs_tokens", "max_response_tokens", "max_prompt_tokens", "topk", "n_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_turns <= 64:
            raise ConfigError(f"max_turns must be in [0, 64], got {self.max_turns}")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError("top_k must be -1 or >= 1")
        if self.retrieval_workers < 1:
            raise ConfigError("retrieval_workers must be >= 1")
        if self.max_context_tokens is not None and self.max_context_tokens <= self.max_prompt_tokens:
            raise ConfigError("max_context_tokens must exceed max_prompt_tokens")
        if self.format not in ("tags", "tool_calls"):
            raise ConfigError(f"rollout.format must be tags or tool_calls, got {self.format!r}")
        if self.format == "tool_calls":
            from agent.toolcall_parsers import get_tool_parser

            get_tool_parser(self.tool_parser)
            if not get_task(self.task).searches:
                raise ConfigError("rollout.format=tool_calls needs rollout.task=search (the math task has no tools)")
            if self.chat == "raw":
                raise ConfigError("rollout.format=tool_calls needs the chat template (rollout.chat auto or chat, not raw)")
        if self.tools:
            from agent.tools import check_sources

            if self.format != "tool_calls":
                raise ConfigError("rollout.tools needs rollout.format=tool_calls (tools are declared through the chat template)")
            if self.agent:
                raise ConfigError("rollout.tools is the built-in agent's; an external agent (rollout.agent) brings its own tools")
            check_sources(self.tools)
        if self.agent_reward:
            from agent.external import load_agent

            load_agent(self.agent_reward, "rollout.agent_reward")
        if self.agent:
            from agent.external import load_agent

            load_agent(self.agent)
            if not get_task(self.task).searches:
                raise ConfigError("rollout.agent needs rollout.task=search (its answer is scored by the QA metrics)")
            if self.agent_workers < 1:
                raise ConfigError("rollout.agent_workers must be >= 1")

    @property
    def template_name(self) -> str:
        return self.template or get_task(self.task).template(self.format)


@dataclass
class Trajectory:
    """One rollout. ``response_ids``, ``loss_mask`` and ``sampling_logprobs`` are aligned.

    loss_mask: 1 at tokens the model sampled, 0 at observation tokens (retrieved text,
        the corrective message), which are in the context but excluded from the loss.
    sampling_logprobs: the engine's log-prob of each sampled token under the processed
        sampling distribution (agent/engines/base.py); 0.0 at observation positions.
    spans: the turn boundaries, alternating model / observation.
    retrieved_ids: per search, the document ids returned ([] when the search failed).
    response_text: the whole response decoded (model turns *and* observations), for logs and reports.
    model_text: only what the model generated -- its turns (the ``loss_mask == 1`` spans), each decoded
        on its own and joined by newlines. Rewards and metrics read this, never ``response_text``, so
        no text the environment inserted (a passage quoting ``<answer>``, the corrective message, an
        observation cut before ``</information>``) can be scored as the model's answer.
    """

    uid: str
    group_id: str
    prompt_index: int
    sample_index: int
    question: str
    example_id: str | None
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)
    retrieved_ids: list[list[str]] = field(default_factory=list)
    final_answer: str | None = None
    stop_reason: StopReason | None = None
    num_turns: int = 0
    num_searches: int = 0
    search_failures: int = 0
    invalid_actions: int = 0
    prompt_truncated_tokens: int = 0
    obs_truncations: int = 0
    error: str | None = None
    search_errors: list[str] = field(default_factory=list)  # why each failed search failed
    tool_calls: dict[str, int] = field(default_factory=dict)  # rollout.tools: MCP tool calls by tool name
    tool_failures: int = 0  # MCP tool calls that failed, hung, or answered more than rollout.max_tool_output_chars
    tool_errors: list[str] = field(default_factory=list)  # "tool: why" of each failed MCP tool call
    response_text: str = ""
    model_text: str = ""
    timings: dict[str, float] = field(default_factory=lambda: {"generation_s": 0.0, "retrieval_s": 0.0})
    weights_version: int | None = None  # asynchronous training: the trainer step whose weights sampled it
    format: str = "tags"  # rollout.format that produced it, or "external" (rollout.agent)
    # rollout.agent: the other token-exact contexts of a recorded session that split (the agent rewrote or truncated
    # its history; agent/external.py); this trajectory holds the session's last call. Each is trained as its own row
    # with this trajectory's advantage (trainer.sampled_batch.training_rows).
    extra_segments: list["TrainingSegment"] = field(default_factory=list)

    @property
    def scored_text(self) -> str:
        """What rewards and QA metrics read (they take the last ``<answer>…</answer>``): ``model_text`` in the
        tags format; in the tool-call format (and for an external agent) the plain final answer as that one
        answer ("" when none), so it is scored by exactly the same metrics on exactly its final answer."""
        if self.format == "tags":
            return self.model_text
        if self.final_answer is None:
            return ""
        return f"<answer>{self.final_answer.replace('<answer>', '').replace('</answer>', '')}</answer>"

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    def span_ids(self, role: Literal["model", "observation"], action: str | None = None) -> list[list[int]]:
        """Token ids of each span of ``role`` (and ``action``, when given), in order."""
        return [self.response_ids[s.start : s.end] for s in self.spans
                if s.role == role and (action is None or s.action == action)]

    def append_model(self, out: GenerationOutput, action: str) -> None:
        start = len(self.response_ids)
        self.response_ids.extend(out.token_ids)
        self.loss_mask.extend([1] * len(out.token_ids))
        self.sampling_logprobs.extend(out.logprobs)
        self.spans.append(Span(start, len(self.response_ids), "model", action))
        self.num_turns += 1

    def append_observation(self, ids: list[int], kind: str) -> None:
        start = len(self.response_ids)
        self.response_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.sampling_logprobs.extend([0.0] * len(ids))
        self.spans.append(Span(start, len(self.response_ids), "observation", kind))


@dataclass
class RolloutStats:
    """Batch-level wall-clock accounting (seconds) for benchmarks and logs."""

    wall_s: float = 0.0
    generation_s: float = 0.0  # wall time inside engine calls
    retrieval_wait_s: float = 0.0  # wall time the driver was blocked on the retriever
    engine_calls: int = 0
    retrieval_calls: int = 0

    @property
    def retrieval_wait_fraction(self) -> float:
        return self.retrieval_wait_s / self.wall_s if self.wall_s > 0 else 0.0


# ---------------------------------------------------------------------------- inputs


def _prompt_fields(p: Any) -> tuple[str, str | None]:
    if isinstance(p, str):
        return p, None
    if isinstance(p, dict):
        return p["question"], (str(p["id"]) if p.get("id") is not None else None)
    question = getattr(p, "question", None)
    if question is None:
        raise TypeError(f"a prompt must be a str, a BuiltPrompt, or have a .question; got {type(p).__name__}")
    ex_id = getattr(p, "id", None)
    return question, (str(ex_id) if ex_id is not None else None)


def _derive_seed(base: int | None, prompt_index: int, sample_index: int, turn: int) -> int | None:
    """A seed per (trajectory, turn) that does not depend on batching or scheduling."""
    if base is None:
        return None
    digest = hashlib.blake2b(f"{base}/{prompt_index}/{sample_index}/{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def remaining_budget(prompt_tokens: int, response_tokens: int, max_response_tokens: int,
                     context_tokens: int) -> tuple[int, StopReason]:
    """Tokens a trajectory may still append, and the cap that binds first.

    Two caps apply to every appended token: the response cap (``max_response_tokens``, model and
    observation tokens together) and the context window (prompt + response <= ``context_tokens``).
    Returns ``(min of what both leave, reason)``; ``reason`` is what a trajectory that stops for lack
    of room reports: ``"context"`` only when the window is strictly tighter, ``"length"`` otherwise
    (at a tie the configured response cap binds as well, and it is the one the user chose).
    """
    response_left = max_response_tokens - response_tokens
    context_left = context_tokens - prompt_tokens - response_tokens
    return min(response_left, context_left), ("context" if context_left < response_left else "length")


def expand_groups(n_prompts: int, n_samples: int, batch_tag: str | None = None) -> list[tuple[int, int, str]]:
    """(prompt_index, sample_index, group_id) for each trajectory, prompt-major.

    Group ids are unique per prompt *and* per call (Search-R1's row-index ids collide
    across datasets, ALGORITHM.md §4.6).
    """
    tag = batch_tag or uuid.uuid4().hex[:12]
    return [(i, k, f"{tag}-{i}") for i in range(n_prompts) for k in range(n_samples)]


# ---------------------------------------------------------------------------- loop


class _Loop:
    """State shared by both drivers: budgets, action handling, observations."""

    def __init__(self, engine: Engine, retriever, config: RolloutConfig) -> None:
        self.engine, self.retriever, self.cfg = engine, retriever, config
        self.task: Task = get_task(config.task)
        self.tok = engine.tokenizer
        # rollout.format=tool_calls: prompts, turn reading and tool messages come from the chat template.
        self.tools = None
        if config.tools and self.task.searches and config.format == "tool_calls":
            from agent.tools import toolbox_for

            self.tools = toolbox_for(config)
        self.fmt = ToolCallFormat(self.tok, config, self.tools) if self.task.searches and config.format == "tool_calls" else None
        self.tool_results: dict[str, list] = {}  # uid -> the MCP results of its turn's calls, until the observation
        self.ctx_limit = config.max_context_tokens or engine.info.max_model_len
        if config.max_prompt_tokens >= self.ctx_limit:
            log.warning(
                "max_prompt_tokens=%d leaves no room to generate in a %d-token context; long prompts will stop "
                "with stop_reason='context'", config.max_prompt_tokens, self.ctx_limit,
            )
        self.stats = RolloutStats()

    # --- budgets
    def room(self, t: Trajectory) -> tuple[int, StopReason]:
        """:func:`remaining_budget` of ``t`` under this loop's caps."""
        return remaining_budget(len(t.prompt_ids), len(t.response_ids), self.cfg.max_response_tokens, self.ctx_limit)

    def turn_budget(self, t: Trajectory) -> tuple[int, StopReason | None]:
        """Tokens the next turn may generate, or (0, reason) when none fit."""
        left, binding = self.room(t)
        cap = self.cfg.max_tokens_per_turn if self.task.searches else self.cfg.max_response_tokens
        budget = min(cap, left)
        if budget >= 1:
            return budget, None
        return 0, binding

    def params(self, t: Trajectory, budget: int) -> SamplingParams:
        cfg = self.cfg
        return SamplingParams(
            temperature=cfg.temperature,
            top_p=cfg.top_p if cfg.temperature > 0 else 1.0,
            top_k=cfg.top_k if cfg.temperature > 0 else -1,
            max_tokens=budget,
            stop=STOP_STRINGS if self.task.searches and self.fmt is None else (),
            seed=_derive_seed(cfg.seed, t.prompt_index, t.sample_index, t.num_turns),
            allowed_token_ids=tuple(cfg.allowed_token_ids) if cfg.allowed_token_ids else None,
        )

    def is_final_turn(self, t: Trajectory) -> bool:
        # Turns so far = searches + invalid actions; the (max_turns + 1)-th turn is final.
        return t.num_turns >= self.cfg.max_turns

    # --- one finished model turn
    def on_generation(self, t: Trajectory, out: GenerationOutput, budget: int) -> Action | None:
        """Append the turn and decide what happens next; returns a search action to run, or None."""
        final = self.is_final_turn(t)
        if not self.task.searches:  # one turn, its whole text the answer
            t.append_model(out, "answer")
            t.stop_reason = "answer" if out.finish_reason == "stop" else self._cap_reason(t)
            return None
        # Text is decoded only to read the action; the ids appended are the sampled ones.
        text = self.tok.decode(out.token_ids, skip_special_tokens=True)
        if self.fmt is not None:
            action = self.fmt.read_turn(text, out.finish_reason)
        else:
            action = parse_action(text, max_query_chars=self.cfg.max_query_chars)
        t.append_model(out, action.kind)
        if action.kind == "answer":
            t.final_answer = action.content
            t.stop_reason = "answer"
            return None
        if final:
            t.stop_reason = "max_turns"
            return None
        if out.finish_reason == "length" and budget < self.cfg.max_tokens_per_turn:
            t.stop_reason = self._cap_reason(t)  # a total cap, not the per-turn cap, ended it
            return None
        if action.kind == "search":
            return action
        t.invalid_actions += 1
        if self.fmt is not None:
            ids, truncated = self.fmt.after_turn_ids(t.response_ids[-1] if t.response_ids else None,
                                                     self.fmt.invalid_messages(action), self.cfg.max_obs_tokens)
        else:
            ids, truncated = observation_ids(self.tok, INVALID_ACTION_MESSAGE, self.cfg.max_obs_tokens, "cut")
        self.add_observation(t, ids, "invalid", truncated)
        return None

    def _cap_reason(self, t: Trajectory) -> StopReason:
        """Which total cap ended a turn early: the response cap or the context window."""
        return self.room(t)[1]

    def add_observation(self, t: Trajectory, ids: list[int], kind: str, truncated: bool) -> None:
        """Append an observation if it and at least one more model token fit; else stop."""
        left, binding = self.room(t)
        if len(ids) + 1 > left:
            t.stop_reason = binding
            return
        t.append_observation(ids, kind)
        t.obs_truncations += int(truncated)

    # --- retrieval and tools
    def execute(self, searches: list[tuple[Trajectory, Any]]) -> tuple[list[list[dict]] | None, str | None]:
        """One round's tool work: the MCP calls of every turn (concurrently, on the toolbox's loop, kept in
        ``tool_results`` for :meth:`on_search_result`) while the built-in searches go to the retriever in one batch."""
        calls = [(t, c) for t, a in searches for c in getattr(a, "calls", ()) if self.tools is not None and self.tools.offers(c.name)]
        pending = None
        if calls:
            import asyncio

            pending = asyncio.run_coroutine_threadsafe(self.tools._call_all([(c.name, c.arguments) for _, c in calls]), self.tools._loop)
        queries = [q for _, a in searches for q in _queries(a)]
        hits, error = self.retrieve(queries) if queries else ([], None)
        if pending is not None:
            from concurrent.futures import TimeoutError as FutureTimeout

            from agent.tools import ToolResult

            try:
                results = pending.result(self.tools.timeout_s + 5.0)
            except FutureTimeout:
                pending.cancel()
                results = [ToolResult(f"Error: the tool {c.name} did not answer within {self.tools.timeout_s:g} s.", "timeout") for _, c in calls]
            for (t, _), r in zip(calls, results):
                self.tool_results.setdefault(t.uid, []).append(r)
        return hits, error

    def retrieve(self, queries: list[str]) -> tuple[list[list[dict]] | None, str | None]:
        """One batched retrieval; (hits per query, None) or (None, error message)."""
        try:
            hits = self.retriever.retrieve(queries, topk=self.cfg.topk)
            if len(hits) != len(queries):
                raise RuntimeError(f"retriever returned {len(hits)} results for {len(queries)} queries")
            return hits, None
        except Exception as e:  # timeouts, 5xx, refused connections: all become failed searches
            log.warning("retrieval of %d queries failed: %s: %s", len(queries), type(e).__name__, e)
            return None, f"{type(e).__name__}: {e}"

    def on_search_result(self, t: Trajectory, action: Any, hits: list[list[dict]] | None,
                         error: str | None) -> None:
        """Record the turn's searches (``hits``: one list per query, None when the retrieval failed) and append
        the observation: one ``<information>`` block (tags), or one tool message per call (tool_calls; the
        MCP calls' results are in ``tool_results``)."""
        queries = _queries(action)
        mcp_results = self.tool_results.pop(t.uid, [])
        for call, r in zip([c for c in getattr(action, "calls", ()) if self.tools is not None and self.tools.offers(c.name)], mcp_results):
            t.tool_calls[call.name] = t.tool_calls.get(call.name, 0) + 1
            if r.error is not None:
                t.tool_failures += 1
                t.tool_errors.append(f"{call.name}: {r.error}")
        if not queries:  # MCP calls only
            messages = self.fmt.results_messages(None, 0, "", calls=getattr(action, "calls", ()), tool_results=mcp_results)
            ids, truncated = self.fmt.after_turn_ids(t.response_ids[-1] if t.response_ids else None, messages,
                                                     self.cfg.max_obs_tokens)
            self.add_observation(t, ids, "tool", truncated)
            return
        t.num_searches += len(queries)
        t.queries.extend(queries)
        if hits is None:
            t.search_failures += len(queries)
            t.retrieved_ids.extend([] for _ in queries)
            t.search_errors.extend([error or "unknown error"] * len(queries))
            kind = "failed"
        else:
            t.retrieved_ids.extend([str(h.get("id", "")) for h in hs] for hs in hits)
            kind = "information"
        if self.fmt is not None:
            messages = self.fmt.results_messages(hits, len(queries), self.cfg.search_failure_message,
                                                 calls=getattr(action, "calls", ()), tool_results=mcp_results)
            ids, truncated = self.fmt.after_turn_ids(t.response_ids[-1] if t.response_ids else None, messages,
                                                     self.cfg.max_obs_tokens)
        else:
            body = self.cfg.search_failure_message if hits is None else format_passages(hits[0])
            ids, truncated = observation_ids(self.tok, information_text(body), self.cfg.max_obs_tokens,
                                             self.cfg.obs_truncation)
        self.add_observation(t, ids, kind, truncated)

    @staticmethod
    def fail(t: Trajectory, exc: BaseException) -> None:
        t.stop_reason = "error"
        t.error = f"{type(exc).__name__}: {exc}"
        log.warning("trajectory %s failed: %s", t.uid, t.error)


def _generate_isolated(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationOutput | BaseException]:
    """One batched call; if it fails, retry one by one so a bad input fails only its own trajectory."""
    try:
        return list(engine.generate(prompts, params))
    except Exception:
        results: list[GenerationOutput | BaseException] = []
        for p, sp in zip(prompts, params):
            try:
                results.append(engine.generate([p], [sp])[0])
            except Exception as e:
                results.append(e)
        return results


def _init_trajectories(engine: Engine, prompts: Sequence[Any], config: RolloutConfig, batch_tag: str | None,
                       fmt: ToolCallFormat | None = None) -> list[Trajectory]:
    trajs = []
    built: list[BuiltPrompt | Exception] = []
    for p in prompts:
        try:
            if isinstance(p, BuiltPrompt):
                built.append(p)
            elif fmt is not None:
                built.append(fmt.build_prompt(_prompt_fields(p)[0]))
            else:
                question, _ = _prompt_fields(p)
                built.append(
                    build_prompt(
                        engine.tokenizer, question, config.template_name, max_tokens=config.max_prompt_tokens,
                        truncation=config.prompt_truncation, chat=config.chat,
                    )
                )
        except Exception as e:  # a bad prompt becomes an errored trajectory, not a crashed batch
            built.append(e)
    for i, k, gid in expand_groups(len(prompts), config.n_samples, batch_tag):
        b = built[i]
        ex_id = None if isinstance(prompts[i], (str, BuiltPrompt)) else _prompt_fields(prompts[i])[1]
        if isinstance(b, Exception):
            question = prompts[i] if isinstance(prompts[i], str) else str(getattr(prompts[i], "question", ""))
            t = Trajectory(f"{gid}-{k}", gid, i, k, question, ex_id, [])
            _Loop.fail(t, b)
        else:
            t = Trajectory(f"{gid}-{k}", gid, i, k, b.question, ex_id, list(b.token_ids),
                           prompt_truncated_tokens=b.truncated_question_tokens)
        t.format = "tool_calls" if fmt is not None else "tags"
        trajs.append(t)
    return trajs


def run_rollouts(
    engine: Engine,
    prompts: Sequence[Any],
    retriever=None,
    config: RolloutConfig | None = None,
    *,
    task: str | None = None,
    batch_tag: str | None = None,
) -> list[Trajectory]:
    """Roll out ``config.n_samples`` trajectories per prompt; returns them prompt-major.

    prompts: questions (str), objects with ``.question`` (and optional ``.id``, e.g.
        eval's ``Example``), dicts with "question", or prebuilt :class:`BuiltPrompt`.
    retriever: anything with ``retrieve(queries, topk=...) -> list[list[{"id","contents",...}]]``
        (``retriever.client.RetrieverClient``); required for the search task.
    task: overrides ``config.task`` (any name :func:`tasks.task.get_task` knows: search/qa, math).
    """
    return run_rollouts_with_stats(engine, prompts, retriever, config, task=task, batch_tag=batch_tag)[0]


def run_rollouts_with_stats(
    engine: Engine,
    prompts: Sequence[Any],
    retriever=None,
    config: RolloutConfig | None = None,
    *,
    task: str | None = None,
    batch_tag: str | None = None,
) -> tuple[list[Trajectory], RolloutStats]:
    """:func:`run_rollouts` plus batch-level wall-clock accounting."""
    cfg = config or RolloutConfig()
    if task is not None and get_task(task) is not get_task(cfg.task):
        from dataclasses import replace

        cfg = replace(cfg, task=get_task(task).rollout_name)
    cfg.validate()
    if get_task(cfg.task).searches and (not cfg.tools or "search" in cfg.tools):
        if retriever is None:
            raise ValueError("the search task needs a retriever")
        if inspect.iscoroutinefunction(getattr(retriever, "retrieve", None)):
            # Every search would "fail" with an un-awaited coroutine; say so instead.
            raise TypeError("run_rollouts needs a synchronous retriever (retriever.client.RetrieverClient)")
    loop = _Loop(engine, retriever, cfg)
    start = time.perf_counter()
    if cfg.agent:  # an external agent through the recording OpenAI endpoint (agent/external.py)
        from agent.external import run_external_rollouts

        trajs = [Trajectory(f"{gid}-{k}", gid, i, k, *_prompt_fields(prompts[i]), [], format="external")
                 for i, k, gid in expand_groups(len(prompts), cfg.n_samples, batch_tag)]
        run_external_rollouts(engine, prompts, retriever, cfg, trajs)
    else:
        trajs = _init_trajectories(engine, prompts, cfg, batch_tag, loop.fmt)
        if cfg.mode == "async":
            _drive_async(loop, trajs)
        else:
            _drive_batched(loop, trajs)
    for t in trajs:
        try:
            t.response_text = engine.tokenizer.decode(t.response_ids, skip_special_tokens=True)
            t.model_text = "\n".join(engine.tokenizer.decode(ids, skip_special_tokens=True) for ids in t.span_ids("model"))
        except Exception as e:  # pragma: no cover - decoding valid ids does not fail
            _Loop.fail(t, e)
    loop.stats.wall_s = time.perf_counter() - start
    return trajs, loop.stats


def _queries(action: Any) -> tuple[str, ...]:
    """The built-in searches of a turn: an :class:`Action`'s ``queries`` (a bare tuple of queries is taken as is)."""
    return action if isinstance(action, tuple) else action.queries


def _per_search(searches: list[tuple[Trajectory, Any]],
                hits: list[list[dict]] | None) -> list[list[list[dict]] | None]:
    """Each turn's share of one batched retrieval (its queries' hit lists, in order; None when it failed)."""
    if hits is None:
        return [None] * len(searches)
    out, at = [], 0
    for _, action in searches:
        n = len(_queries(action))
        out.append(hits[at : at + n])
        at += n
    return out


def _drive_batched(loop: _Loop, trajs: list[Trajectory]) -> None:
    cfg = loop.cfg
    max_rounds = cfg.max_turns + 1 if loop.task.searches else 1
    for _ in range(max_rounds):
        active, budgets = [], []
        for t in trajs:
            if t.done:
                continue
            budget, reason = loop.turn_budget(t)
            if reason is not None:
                t.stop_reason = reason
                continue
            active.append(t)
            budgets.append(budget)
        if not active:
            break
        t0 = time.perf_counter()
        outs = _generate_isolated(
            loop.engine, [t.prompt_ids + t.response_ids for t in active],
            [loop.params(t, b) for t, b in zip(active, budgets)],
        )
        dt = time.perf_counter() - t0
        loop.stats.generation_s += dt
        loop.stats.engine_calls += 1
        searches: list[tuple[Trajectory, tuple[str, ...]]] = []
        for t, out, budget in zip(active, outs, budgets):
            t.timings["generation_s"] += dt
            try:
                if isinstance(out, BaseException):
                    raise out
                action = loop.on_generation(t, out, budget)
                if action is not None:
                    searches.append((t, action))
            except Exception as e:
                _Loop.fail(t, e)
        if not searches:
            continue
        t0 = time.perf_counter()
        hits, error = loop.execute(searches)
        dt = time.perf_counter() - t0
        loop.stats.retrieval_wait_s += dt
        loop.stats.retrieval_calls += 1
        for (t, action), own_hits in zip(searches, _per_search(searches, hits)):
            t.timings["retrieval_s"] += dt
            try:
                loop.on_search_result(t, action, own_hits, error)
            except Exception as e:
                _Loop.fail(t, e)
    for t in trajs:  # only reachable if every round left someone active (cannot happen for search)
        if not t.done:
            t.stop_reason = "max_turns"


def _drive_async(loop: _Loop, trajs: list[Trajectory]) -> None:
    engine = loop.engine
    by_id: dict[str, Trajectory] = {}
    budgets: dict[str, int] = {}
    submitted_at: dict[str, float] = {}
    counter = 0

    def submit(t: Trajectory) -> None:
        nonlocal counter
        budget, reason = loop.turn_budget(t)
        if reason is not None:
            t.stop_reason = reason
            return
        counter += 1
        rid = f"{t.uid}#{counter}"
        try:
            engine.submit(rid, t.prompt_ids + t.response_ids, loop.params(t, budget))
        except Exception as e:
            _Loop.fail(t, e)
            return
        by_id[rid], budgets[rid], submitted_at[rid] = t, budget, time.perf_counter()

    for t in trajs:
        if not t.done:
            submit(t)
    pending: dict[cf.Future, tuple[list[tuple[Trajectory, str]], float]] = {}
    with cf.ThreadPoolExecutor(max_workers=loop.cfg.retrieval_workers, thread_name_prefix="emapg-retrieve") as pool:
        while engine.has_unfinished() or pending:
            searches: list[tuple[Trajectory, tuple[str, ...]]] = []
            if engine.has_unfinished():
                t0 = time.perf_counter()
                try:
                    finished = engine.step()
                except Exception as e:  # the engine itself broke: fail everything it was running
                    for rid in list(by_id):
                        _Loop.fail(by_id.pop(rid), e)
                    finished = []
                now = time.perf_counter()
                loop.stats.generation_s += now - t0
                loop.stats.engine_calls += 1
                for rid, out in finished:
                    t = by_id.pop(rid)
                    t.timings["generation_s"] += now - submitted_at.pop(rid)
                    try:
                        action = loop.on_generation(t, out, budgets.pop(rid))
                        if action is not None:
                            searches.append((t, action))
                        elif not t.done:
                            submit(t)  # invalid action: the corrective message is in, go again
                    except Exception as e:
                        _Loop.fail(t, e)
                if searches:
                    pending[pool.submit(loop.execute, searches)] = (searches, time.perf_counter())
                    loop.stats.retrieval_calls += 1
                ready = [f for f in pending if f.done()]
            else:
                # Nothing to generate: the driver is blocked on the retriever.
                t0 = time.perf_counter()
                done, _ = cf.wait(list(pending), return_when=cf.FIRST_COMPLETED)
                loop.stats.retrieval_wait_s += time.perf_counter() - t0
                ready = list(done)
            for fut in ready:
                batch, sent = pending.pop(fut)
                hits, error = fut.result()
                dt = time.perf_counter() - sent
                for (t, action), own_hits in zip(batch, _per_search(batch, hits)):
                    t.timings["retrieval_s"] += dt
                    try:
                        loop.on_search_result(t, action, own_hits, error)
                        if not t.done:
                            submit(t)
                    except Exception as e:
                        _Loop.fail(t, e)
    for t in trajs:
        if not t.done:  # pragma: no cover - every path above sets a stop reason
            t.stop_reason = "error"
            t.error = "rollout ended without a stop reason"


def summarize(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Scalar metrics of a batch of trajectories (for logs)."""
    n = max(len(trajs), 1)
    reasons = Counter(t.stop_reason for t in trajs)
    out: dict[str, float] = {
        "rollout/num_trajectories": float(len(trajs)),
        "rollout/mean_searches": sum(t.num_searches for t in trajs) / n,
        "rollout/search_failures": float(sum(t.search_failures for t in trajs)),
        "rollout/invalid_actions": float(sum(t.invalid_actions for t in trajs)),
        "rollout/mean_response_tokens": sum(len(t.response_ids) for t in trajs) / n,
        "rollout/mean_model_tokens": sum(t.num_model_tokens for t in trajs) / n,
        "rollout/obs_truncations": float(sum(t.obs_truncations for t in trajs)),
    }
    tool_calls: Counter = Counter()
    for t in trajs:
        tool_calls.update(t.tool_calls)
    if tool_calls:  # rollout.tools: MCP tool calls by tool, and failures
        out["rollout/tool_failures"] = float(sum(t.tool_failures for t in trajs))
        out.update({f"rollout/tool_calls/{name}": float(n) for name, n in sorted(tool_calls.items())})
    for reason in ("answer", "max_turns", "length", "context", "error"):
        out[f"rollout/stop_{reason}"] = reasons.get(reason, 0) / n
    return out
