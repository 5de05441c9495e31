"""Teacher-forced trajectories through the real rollout loop (warm-start data for ``emapg sft``).

A supervised trajectory must be tokenised exactly as a rollout of the same text would be:
the same prompt template and chat template, the same observation formatting, truncation
and budgets, the same token-in/token-out assembly. Rather than re-implementing any of that,
:func:`replay_trajectories` runs :func:`agent.rollout.run_rollouts` itself with a
:class:`ReplayEngine` in place of a sampling engine: where a real engine would sample a turn,
the replay engine returns the token ids of the given turn text (each turn tokenised once, on
its own, as a model emitting that text would most plausibly have produced it). Everything
else -- action parsing, retrieval over the caller's retriever (a live server over HTTP, or a
:class:`ReplayRetriever` that hands back recorded passages), observation ids, ``loss_mask``,
``spans``, ``model_text`` -- is the rollout loop's own output.

Engine semantics are kept: a turn longer than the loop's per-turn budget is cut and reported
with ``finish_reason="length"``, as a sampling engine would; a turn that goes on after a stop
string (``</search>``/``</answer>``) is rejected, because no engine could have produced it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from agent.actions import format_passages
from agent.engines.base import EngineInfo, GenerationOutput, SamplingParams, per_prompt_params
from agent.formats import ToolCallFormat
from agent.prompts import build_prompt
from agent.rollout import RolloutConfig, Trajectory, run_rollouts


class ReplayError(ValueError):
    """A scripted trajectory that no engine could have produced (or that the loop asked more turns of)."""


@dataclass
class ScriptedTrajectory:
    """What a teacher says for one question: its model turns, in order (observations come from the retriever)."""

    question: str
    turns: list[str]
    id: str | None = None


class ReplayEngine:
    """An :class:`agent.engines.base.Engine` whose generations are given turn texts.

    ``scripts`` maps each trajectory's prompt ids (as the rollout loop builds them) to its
    turns; the engine recognises a context by its prompt prefix and returns the next turn.
    Prompts must therefore be distinct (one trajectory per prompt, ``n_samples=1``).
    """

    def __init__(self, tokenizer, scripts: dict[tuple[int, ...], list[str]], *, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.info = EngineInfo("replay", "replay", max_model_len)
        self._turn_ids = {key: [self._encode(text) for text in turns] for key, turns in scripts.items()}
        self._served = dict.fromkeys(scripts, 0)
        self._prompt_lens = sorted({len(k) for k in scripts})
        self._queue: list[tuple[str, list[int], SamplingParams]] = []

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _key(self, context: list[int]) -> tuple[int, ...]:
        for n in self._prompt_lens:
            key = tuple(context[:n])
            if key in self._served:
                return key
        raise ReplayError("a context that starts with none of the scripted prompts")

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[GenerationOutput]:
        return [self._next_turn(ctx, p) for ctx, p in zip(prompt_ids, per_prompt_params(params, len(prompt_ids)))]

    def _next_turn(self, context: list[int], params: SamplingParams) -> GenerationOutput:
        key = self._key(context)
        turn = self._served[key]
        if turn >= len(self._turn_ids[key]):
            raise ReplayError(f"the rollout loop asked for turn {turn + 1} but the script has {turn}")
        self._served[key] = turn + 1
        ids = self._turn_ids[key][turn]
        if not ids:
            raise ReplayError(f"turn {turn + 1} is empty")
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stop = _first_stop(text, params.stop)
        if stop is not None and not text.rstrip().endswith(stop):
            raise ReplayError(f"turn {turn + 1} continues after {stop!r}; a model's generation would have stopped there")
        if len(ids) > params.max_tokens:  # the per-turn (or total) budget cuts it, as it would cut a sample
            return GenerationOutput(ids[: params.max_tokens], [0.0] * params.max_tokens, "length", None)
        return GenerationOutput(ids, [0.0] * len(ids), "stop", stop)

    # The async driver's interface: everything queued is answered in one step.
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self._queue.append((request_id, prompt_ids, params))

    def step(self) -> list[tuple[str, GenerationOutput]]:
        queued, self._queue = self._queue, []
        return [(rid, self._next_turn(ids, p)) for rid, ids, p in queued]

    def has_unfinished(self) -> bool:
        return bool(self._queue)

    def score(self, token_ids: list[list[int]], start: list[int]) -> list[list[float]]:
        raise NotImplementedError("a replay engine has no model to score with")

    def load_weights(self, state_dict: dict) -> None:
        raise NotImplementedError("a replay engine has no weights")

    def sleep(self) -> bool:
        return False

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass


def _first_stop(text: str, stops: Sequence[str]) -> str | None:
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found)[1] if found else None


class ReplayRetriever:
    """Hands back recorded search results in order (one trajectory's searches), whatever the query."""

    def __init__(self, results: list[list[dict]]) -> None:
        self._results = list(results)

    def retrieve(self, queries: list[str], topk: int | None = None) -> list[list[dict]]:
        if len(queries) > len(self._results):
            raise ReplayError(f"{len(queries)} searches but {len(self._results)} recorded results left")
        out, self._results = self._results[: len(queries)], self._results[len(queries) :]
        return out


def replay_trajectories(
    tokenizer, scripts: Sequence[ScriptedTrajectory], retriever, config: RolloutConfig, *, max_model_len: int
) -> list[Trajectory]:
    """Run the rollout loop over ``scripts`` with the given turns in place of sampling.

    Returns one :class:`Trajectory` per script, in order; a script the loop could not follow
    (a replay error, a failed build of its prompt) comes back with ``stop_reason="error"``.
    Scripts whose prompts coincide are rejected (the engine could not tell them apart).
    """
    if config.n_samples != 1:
        raise ValueError("replayed trajectories need n_samples=1")
    keys: dict[tuple[int, ...], list[str]] = {}
    fmt = ToolCallFormat(tokenizer, config) if config.format == "tool_calls" else None
    for s in scripts:
        built = fmt.build_prompt(s.question) if fmt is not None else build_prompt(
            tokenizer, s.question, config.template_name, max_tokens=config.max_prompt_tokens,
            truncation=config.prompt_truncation, chat=config.chat)
        key = tuple(built.token_ids)
        if key in keys:
            raise ReplayError(f"two scripted trajectories share the prompt of question {s.question!r}")
        keys[key] = list(s.turns)
    engine = ReplayEngine(tokenizer, keys, max_model_len=max_model_len)
    prompts = [{"question": s.question, "id": s.id} for s in scripts]
    return run_rollouts(engine, prompts, retriever, config)


_DOC_RE = re.compile(r"Doc (\d+)\(Title: ")


def parse_passages(body: str) -> list[dict]:
    """Invert :func:`agent.actions.format_passages`: ``Doc i(Title: T) text`` blocks back into hits.

    Raises :class:`ReplayError` unless formatting the parsed hits reproduces ``body`` exactly
    (after stripping), so a recorded observation is replayed byte for byte or not at all.
    """
    text = body.strip()
    starts = [m for m in _DOC_RE.finditer(text) if m.start() == 0 or text[m.start() - 1] == "\n"]
    hits = []
    for n, m in enumerate(starts):
        end = starts[n + 1].start() if n + 1 < len(starts) else len(text)
        block = text[m.end() : end].rstrip("\n")
        # The title is the first line of `contents`; Search-R1's titles are quoted, so ") " after a
        # closing quote ends it when there is one.
        cut = block.find('") ') + 1 if block.startswith('"') and '") ' in block else block.find(") ")
        if cut < 0:
            title, rest = block.removesuffix(")"), ""
        else:
            title, rest = block[:cut], block[cut + 2 :]
        hits.append({"id": f"recorded-{n + 1}", "contents": f"{title}\n{rest}" if rest else title})
    if not hits or format_passages(hits).strip() != text:
        raise ReplayError("an <information> block is not in Search-R1's passage format (Doc i(Title: ...) ...)")
    return hits

