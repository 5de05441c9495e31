"""The rows of a run's ``samples.jsonl``: a few of each step's trajectories, whole, for reading what the policy did.

A row carries what ``emapg view`` shows of a trajectory: the question and its gold answers, the prompt and every
span of the response decoded on its own (model turns and observations, with their token counts and whether the
loss masks them out), the search queries and the ids of the passages they returned, the answer read from the
model's text, the reward and the GRPO advantage the update used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.sampled_batch import SampledBatch


def sample_records(sampled: SampledBatch, n: int, *, tokenizer: Any = None, advantages: Any = None) -> list[dict[str, Any]]:
    """The first ``n`` trajectories of a batch as ``samples.jsonl`` rows.

    ``tokenizer`` (optional) decodes the prompt and each span; ``advantages``: the batch's ``(N,)`` advantages.
    """
    rows = []
    size = max(sampled.group_size, 1)
    for i, (t, g, r) in enumerate(list(zip(sampled.trajectories, sampled.group_ids, sampled.rewards.tolist()))[:n]):
        outcome = sampled.outcomes[i] if i < len(sampled.outcomes) else None
        prompt = sampled.prompts[i // size] if i // size < len(sampled.prompts) else None
        row: dict[str, Any] = {
            "group_id": g, "reward": float(r), "stop_reason": t.stop_reason, "searches": t.num_searches,
            "question": t.question, "response": t.response_text,
            "queries": list(t.queries), "retrieved_ids": [list(ids) for ids in t.retrieved_ids],
            "golds": list(prompt.example.answers) if prompt is not None else [],
            "answer": outcome.answer if outcome is not None else t.final_answer,
            "format": t.format, "prompt_tokens": len(t.prompt_ids), "response_tokens": len(t.response_ids),
            "model_tokens": t.num_model_tokens,
        }
        if advantages is not None:
            row["advantage"] = float(advantages[i])
        if tokenizer is not None:
            row["prompt"] = tokenizer.decode(t.prompt_ids)
            row["segments"] = [
                {"role": s.role, "action": s.action, "tokens": s.end - s.start,
                 "masked": not any(t.loss_mask[s.start:s.end]),
                 "text": tokenizer.decode(t.response_ids[s.start:s.end])}
                for s in t.spans
            ]
        rows.append(row)
    return rows
