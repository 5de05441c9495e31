"""``emapg sft`` in the tool-call format (rollout.format=tool_calls): constructed trajectories hold the model's
own tool calls and tool messages rendered by the chat template, masks cover only model tokens, the loss drops.

Real parts: tiny-qwen2 with the bundled tool chat template (its own has no tool support), the live retriever
server over HTTP, the real SFT loop.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from agent.formats import ToolCallFormat
from agent.rollout import RolloutConfig
from agent.toolcall_parsers import HermesParser, ToolCall
from emapg.config import ConfigError
from tasks.datasets import Example

ROLLOUT = dict(format="tool_calls", tool_chat_template="chatml_tools", max_turns=2, max_tokens_per_turn=96,
               max_obs_tokens=400, max_response_tokens=800, max_prompt_tokens=768, topk=2)


def test_constructed_tool_call_trajectories(tiny_model_dir, retriever_client, retriever_index):
    from trainer.sft.data import construct_trajectories

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = RolloutConfig(**ROLLOUT)
    examples = [Example(f"q{i}", q["question"], q["answers"], "nq_gold") for i, q in enumerate(retriever_index.questions[:12])]
    pairs, report = construct_trajectories({"nq_gold": examples}, tok, retriever_client, cfg, max_model_len=2048, exclude={})
    assert 0 < report.total_kept == len(pairs)
    fmt = ToolCallFormat(tok, cfg)
    for t, ex in pairs:
        assert t.format == "tool_calls" and t.prompt_ids == fmt.build_prompt(ex.question).token_ids
        assert [s.role for s in t.spans] == ["model", "observation", "model"] and t.stop_reason == "answer"
        for s in t.spans:
            assert t.loss_mask[s.start : s.end] == [int(s.role == "model")] * (s.end - s.start)
        call, answer = (tok.decode(ids) for ids in t.span_ids("model"))
        assert HermesParser().parse(call).calls == (ToolCall("search", {"query": ex.question.strip()}),)
        assert call.endswith("</tool_call><|im_end|>") and answer == f"{t.final_answer}<|im_end|>"
        assert t.final_answer in ex.answers and "<tool_response>" in tok.decode(t.span_ids("observation")[0])


def _config(tmp_path: Path, data: Path, out: Path) -> Path:
    cfg = {"run": {"output_dir": str(out), "device": "cpu"}, "model": {"policy": "tiny-qwen2"},
           "data": {"source": "file", "path": str(data), "exclude_eval_questions": False, "heldout_fraction": 0.25},
           "optim": {"lr": 1e-3, "epochs": 2, "batch_size": 4}, "rollout": ROLLOUT}
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_sft_in_the_tool_call_format_lowers_the_heldout_loss(tmp_path, retriever_index, retriever_server):
    from emapg.config import load_config
    from trainer.sft.train import run_sft
    from trainer.sft.config import SFTConfig

    render = HermesParser().render
    rows = [{"question": q["question"], "turns": [render(ToolCall("search", {"query": q["question"]})), q["answers"][0]]}
            for q in retriever_index.questions[:24]]
    data = tmp_path / "trajs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    cfg = load_config(SFTConfig, _config(tmp_path, data, out), [f"retriever.urls=[{retriever_server.url}]"])
    result = run_sft(cfg)
    assert result.heldout_loss_after < result.heldout_loss_before - 0.3, (result.heldout_loss_before, result.heldout_loss_after)
    saved = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(saved) == 24 and all("<tool_call>" in s["model_text"] for s in saved)
    # a Search-R1 text row cannot be a tool-call trajectory: one error naming the file and line
    data.write_text(json.dumps({"question": "q", "response": "<answer> x </answer>"}) + "\n")
    with pytest.raises(ConfigError, match=r"trajs.jsonl:1: a Search-R1 'response' row is in the tags format"):
        run_sft(cfg)
