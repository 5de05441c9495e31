"""Evaluation protocols: the sampling and scoring settings a number is only valid under.

Presets (``PROTOCOLS``):

* ``qa_greedy`` -- the paper's search evaluation (ALGORITHM.md §4.2, §4.6): the Search-R1
  multi-turn loop, greedy decoding (T = 0, top_p = 1, n = 1), ≤ 4 retrievals of top-3
  passages, 500 tokens per turn, 500-token observations, exact match on the last answer.
* ``qa_quick`` -- the same loop with 2 retrievals and 64 tokens per turn, for CPU smoke runs.
* ``math_paper`` -- the released checkpoint's math protocol (root README of the official
  repo): n = 32 samples, T = 0.8, top_p = 0.9, max_tokens 28,000, seed 429, prompt ≤ 2,048,
  graded by ``mathd_or_math_verify`` (the paper's mathd string check, with math-verify
  standing in for its sympy check; ``--grader math_verify`` for the stricter common choice).
* ``math_benchmark_readme`` -- the other protocol in the official repo's
  ``BENCHMARK_README.md`` (n = 16, T = 0.6, top_p = 0.95, 32,768 tokens); recorded so both
  can be reproduced.
* ``math_quick`` -- n = 4, T = 0.8, top_p = 0.9, 256 tokens, ``math_verify``: a CPU smoke run of the math path.

Every field can be overridden from the command line (``--n``, ``--temperature``, ...); the
protocol actually used is written into ``results.json`` and the report.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from emapg.config import ConfigError, from_dict, option, to_dict
from tasks.math import DEFAULT_GRADER, Grader
from tasks.task import get_task

Suite = Literal["qa", "math"]


@dataclass
class EvalProtocol:
    """Sampling, rollout and scoring settings of one evaluation."""

    name: str = option("qa_greedy", help="protocol label written into the results (a preset name or your own)")
    suite: Suite = option("qa", help="'qa' (multi-turn search agent, exact match) or 'math' (single turn, boxed answer)")
    n: int = option(1, help="samples per question; pass@1 is their mean accuracy, pass@k uses all n")
    temperature: float = option(0.0, ge=0, help="sampling temperature; 0 is greedy")
    top_p: float = option(1.0, gt=0, le=1, help="nucleus sampling mass")
    top_k: int = option(-1, help="top-k sampling (-1: off)")
    max_tokens: int = option(500, help="generation budget: per turn for qa, per response for math")
    max_turns: int = option(4, help="qa: maximum retrievals; one final answer-only turn follows (Search-R1)")
    retrieval_topk: int = option(3, help="qa: passages returned per search")
    max_obs_tokens: int = option(500, help="qa: observation (retrieved passages) budget in tokens")
    max_response_tokens: int = option(
        4096, help="qa: cap on the whole response, model turns + observations (Search-R1 max_response_length)")
    max_prompt_tokens: int = option(2048, help="prompt budget in tokens; longer questions are truncated from the start")
    max_model_len: int = option(4096, help="context length the engine is built with (prompt + all turns)")
    seed: int = option(0, help="sampling seed; sample j of item i uses a seed derived from (seed, item id, j)")
    template: str = option("search_r1", help="prompt template name (agent.prompts) or path to a template file")
    grader: Grader = option(
        DEFAULT_GRADER, help="math: the paper-like MATH string check OR math-verify, or math-verify alone")
    grade_timeout: float = option(5.0, gt=0, help="math: seconds per item before grading counts as a timeout (incorrect)")
    format: Literal["tags", "tool_calls"] = option(
        "tags", help="qa: the agent's format (rollout.format): tags (Search-R1) or tool_calls (the chat template's tool "
        "calls, plain-text answer; the template search_r1 becomes search_tools)")
    tool_parser: str = option("hermes", help="qa, format tool_calls: the tool-call parser (rollout.tool_parser)")
    tool_chat_template: str | None = option(
        None, help="qa, format tool_calls: a chat template with tool support in place of the model's (rollout.tool_chat_template)")

    def validate(self) -> None:
        if self.n < 1:
            raise ConfigError(f"n must be >= 1, got {self.n}")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        for name in ("max_tokens", "max_turns", "retrieval_topk", "max_obs_tokens", "max_response_tokens",
                     "max_prompt_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.format == "tool_calls" and not get_task(self.suite).searches:
            raise ConfigError("format tool_calls is for the qa suite (math has no tools)")
        if self.n > 1 and self.temperature == 0:
            raise ConfigError(f"n={self.n} samples at temperature 0 would all be identical; set temperature > 0")


#: Settings recorded only when the tool-call format is used, so runs from before the option compare (and resume) as before.
TOOL_CALL_FIELDS = ("format", "tool_parser", "tool_chat_template")


def protocol_dict(p: EvalProtocol) -> dict:
    """``p`` as recorded in results, resume fingerprints and protocol cards (:data:`TOOL_CALL_FIELDS` only when used)."""
    data = to_dict(p)
    if p.format == "tags":
        for key in TOOL_CALL_FIELDS:
            data.pop(key)
    return data


PROTOCOLS: dict[str, EvalProtocol] = {
    p.name: p
    for p in (
        EvalProtocol(name="qa_greedy", suite="qa", max_model_len=6144),  # 2,048 prompt + 4,096 response
        EvalProtocol(name="qa_quick", suite="qa", max_turns=2, max_tokens=64, max_obs_tokens=256,
                     max_response_tokens=1024, max_prompt_tokens=1024, max_model_len=2048),
        EvalProtocol(name="math_paper", suite="math", n=32, temperature=0.8, top_p=0.9, max_tokens=28000,
                     seed=429, template="math", max_prompt_tokens=2048, max_model_len=32768,
                     grader="mathd_or_math_verify"),
        EvalProtocol(name="math_benchmark_readme", suite="math", n=16, temperature=0.6, top_p=0.95,
                     max_tokens=32768, seed=429, template="math", max_prompt_tokens=2048, max_model_len=34816,
                     grader="mathd_or_math_verify"),
        EvalProtocol(name="math_quick", suite="math", n=4, temperature=0.8, top_p=0.9, max_tokens=256,
                     seed=429, template="math_boxed", max_prompt_tokens=1024, max_model_len=1536, grader="math_verify"),
    )
}

DEFAULT_PROTOCOL: dict[str, str] = {"qa": "qa_greedy", "math": "math_paper"}


def get_protocol(name: str, **overrides) -> EvalProtocol:
    """A preset with ``overrides`` applied (``None`` values are ignored) and validated."""
    if name not in PROTOCOLS:
        raise ConfigError(f"unknown protocol {name!r}; choose from {', '.join(PROTOCOLS)}")
    data = to_dict(PROTOCOLS[name])
    fields = {f.name for f in dataclasses.fields(EvalProtocol)}
    for key, value in overrides.items():
        if key not in fields:
            raise ConfigError(f"unknown protocol field {key!r}")
        if value is not None:
            data[key] = value
    return from_dict(EvalProtocol, data)
