"""The engine interface: token ids in, token ids (+ the sampling log-probs) out.

Every engine takes *token ids* and returns *token ids*; text never makes a round trip
through the tokenizer, so the rollout can append exactly the tokens that were sampled.

What ``GenerationOutput.logprobs`` means (identical for every engine): for each
generated token, the log-probability of that token under the distribution it was
actually sampled from, i.e.::

    logits -> keep only allowed_token_ids -> / temperature -> top-k -> top-p -> log_softmax

(vLLM's ``logprobs_mode="processed_logprobs"``). With temperature 0 (greedy) the
temperature step is skipped, so the value is the plain log-softmax. At temperature 1
with top_p 1 and top_k -1 it equals the model's own log-softmax, which is what the
trainer recomputes. Tokens outside the top-p nucleus cannot be sampled, so values are
finite. Note the trainer's pi_old is *recomputed* (ALGORITHM.md notation), these are
the sampler's own numbers, kept for diagnostics and importance-sampling corrections.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from collections.abc import Callable
from typing import Literal, Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings shared by all engines (a small subset of vLLM's).

    ``stop`` strings end a sequence as soon as the decoded generated text contains one;
    the token that completes the string is kept (vLLM ``include_stop_str_in_output``)
    and nothing after it is generated. ``seed`` makes each sequence reproducible: the
    i-th prompt of a call is sampled with seed ``seed + i`` independently of the
    others, so a trajectory's sample does not depend on what else is in the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 500
    stop: tuple[str, ...] = ()
    seed: int | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        # Accept lists from callers but store tuples: the dataclass is frozen and hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be None or non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


FinishReason = Literal["stop", "length"]


@dataclass
class GenerationOutput:
    """One generated continuation.

    token_ids: the sampled tokens, in order (an EOS token that ended the sequence is included).
    logprobs: one float per token (see the module docstring for the exact meaning).
    finish_reason: "stop" (EOS, stop token or stop string) or "length" (hit max_tokens).
    stop_reason: the stop string that matched, the stop token id, or None (EOS / length).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stop_reason: str | int | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} log-probs")


@dataclass
class EngineInfo:
    """What an engine can do, for callers that adapt (the trainer, the async driver)."""

    kind: str
    model_path: str
    max_model_len: int
    supports_sleep: bool = False
    continuous_batching: bool = False
    extra: dict = field(default_factory=dict)
    #: LoRA: the engine serves base + adapters (``load_lora``); ``max_lora_rank`` None means any rank.
    serves_lora: bool = False
    max_lora_rank: int | None = None

    def lora_problem(self, rank: int) -> str | None:
        """Why this engine cannot serve LoRA adapters of ``rank`` (None: it can)."""
        if not self.serves_lora:
            return f"the {self.kind} engine was not started with LoRA support"
        if self.max_lora_rank is not None and rank > self.max_lora_rank:
            return f"the {self.kind} engine serves LoRA ranks up to {self.max_lora_rank}, not {rank}"
        return None


#: The most a LoRA adapter config may ask for (rank; target module names) -- bounds what a server accepts.
#: Most top-k log-probabilities per position a scoring request (``score_topk``, ``POST /score``) may ask for.
MAX_SCORE_TOPK = 1024


class ScoreStopped(RuntimeError):
    """A score stopped because its ``should_stop`` said so (the generation server's client went away)."""


@dataclass(frozen=True)
class ScoredTokens:
    """One sequence's scores from :meth:`Engine.score_topk`, for its positions ``t >= start``: ``logprobs[i]``
    is log p(token_t | tokens_<t); ``topk_ids[i]``/``topk_logprobs[i]`` the ``topk`` most likely tokens there and
    their log-probabilities (largest first), all under softmax(logits / temperature) of the raw model."""

    logprobs: list[float]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]


def tokenizer_fingerprint(tokenizer: object) -> dict:
    """``{"name", "fingerprint", "size"}`` of a tokenizer: its name or path and a SHA-256 of its token -> id map
    (added tokens included) — two tokenizers that map every token to the same id have the same fingerprint.
    On-policy distillation needs the teacher's and the policy's to agree (trainer.teacher)."""
    import hashlib
    import json

    vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
    digest = hashlib.sha256(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode()).hexdigest()
    return {"name": str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__), "fingerprint": digest[:16],
            "size": len(vocab)}


MAX_LORA_RANK = 4096
MAX_LORA_TARGETS = 256


def lora_adapter_config(config: object) -> dict:
    """The LoRA settings an engine needs to serve adapters, checked and normalised (``ValueError`` names what is wrong):
    ``{"r": int >= 1, "lora_alpha": number > 0, "target_modules": [name, ...]}`` (peft's names; peft's
    saved adapter key names go with it, e.g. ``base_model.model.<module>.lora_A.weight``)."""
    if not isinstance(config, dict) or set(config) != {"r", "lora_alpha", "target_modules"}:
        raise ValueError("a LoRA config is an object with exactly 'r', 'lora_alpha' and 'target_modules'")
    r, alpha, targets = config["r"], config["lora_alpha"], config["target_modules"]
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= MAX_LORA_RANK:
        raise ValueError(f"LoRA 'r' must be an integer in [1, {MAX_LORA_RANK}]")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < float("inf"):
        raise ValueError("LoRA 'lora_alpha' must be a positive number")
    if (not isinstance(targets, list) or not 1 <= len(targets) <= MAX_LORA_TARGETS
            or not all(isinstance(t, str) and 0 < len(t) <= 200 for t in targets)):
        raise ValueError(f"LoRA 'target_modules' must be a list of 1 to {MAX_LORA_TARGETS} module names")
    return {"r": r, "lora_alpha": float(alpha), "target_modules": sorted(set(targets))}


@runtime_checkable
class Engine(Protocol):
    """A generation engine (vLLM or transformers). All methods are synchronous.

    An engine whose ``info.serves_lora`` also has ``load_lora(adapters, config)``: serve the base
    with these LoRA adapters (peft saved names; ``config`` as :func:`lora_adapter_config`).

    ``submit``/``step`` are the continuous-batching interface used by the async rollout
    driver: ``submit`` queues one request, each ``step`` advances generation and returns
    the requests that finished during it. An engine without real continuous batching
    may run everything queued in one ``step``.
    """

    tokenizer: object
    info: EngineInfo

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationOutput]: ...

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None: ...

    def step(self) -> list[tuple[str, GenerationOutput]]: ...

    def has_unfinished(self) -> bool: ...

    def score(self, token_ids: list[list[int]], start: list[int]) -> list[list[float]]: ...

    def score_topk(self, token_ids: list[list[int]], start: list[int], *, topk: int,
                   temperature: float = 1.0, should_stop: Callable[[], bool] | None = None) -> list[ScoredTokens]: ...

    def load_weights(self, state_dict: dict) -> None: ...

    def sleep(self) -> bool: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


def per_prompt_params(params: SamplingParams | list[SamplingParams], n: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt.

    A single ``params`` with ``seed=s`` gives prompt i the seed ``s + i``; a list is used
    as is (each entry's seed is that prompt's seed), which lets a caller give every
    sequence its own budget and a seed that does not depend on batch composition.
    """
    if isinstance(params, SamplingParams):
        if params.seed is None:
            return [params] * n
        return [params.with_(seed=params.seed + i) for i in range(n)]
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def check_prompts(prompt_ids: list[list[int]], vocab_size: int, max_model_len: int, max_tokens: int | list[int]) -> None:
    """Reject inputs that would fail deep inside an engine with a confusing error."""
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompt_ids)
    for i, (ids, max_tokens) in enumerate(zip(prompt_ids, budgets)):
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary (size {vocab_size}): {bad[:5]}")
        if len(ids) + max_tokens > max_model_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with max_tokens={max_tokens} it exceeds "
                f"max_model_len={max_model_len}"
            )
