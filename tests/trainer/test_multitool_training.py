"""A multi-tool environment end to end: `emapg train` with rollout.tools=[search, calculator] on the year-arithmetic
task (tasks/year_arithmetic.py), a few steps on a tiny model.

Real parts: the tiny Qwen2 weight-scripted to call the search tool and the calculator in every turn
(tests/fixtures/toolcalls.py ``search_calc_caller_dir``), the real retriever server (built-in search, batched), the
bundled calculator as a stdio MCP server (agent/calculator.py), the real trainer.
"""

from __future__ import annotations

import math

import torch

from emapg.config import load_config
from emapg.paths import CONFIG_DIR
from tasks.year_arithmetic import write_year_arithmetic
from trainer.config import TrainConfig
from trainer.loop import Trainer

FAST = ["logging.progress=false", "data.prompts_per_step=2", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2",
        "rollout.max_tokens_per_turn=40", "rollout.max_obs_tokens=200", "rollout.max_response_tokens=700",
        "rollout.max_prompt_tokens=1300", "run.save_every=0", "run.total_steps=2"]


def test_training_steps_with_search_and_the_calculator(tmp_path, search_calc_caller_dir, retriever_server):
    task = write_year_arithmetic(tmp_path / "year_arithmetic.jsonl", scan=200)
    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", [
        f"run.output_dir={tmp_path / 'run'}", f"model.policy={search_calc_caller_dir}", f"retriever.urls=[{retriever_server.url}]",
        f"data.train={task}", "rollout.format=tool_calls", "rollout.tools=[search, calculator]", *FAST])
    trainer = Trainer(cfg).setup()
    batches = []
    sample = trainer.sample_batch
    trainer.sample_batch = lambda prompts: batches.append(sample(prompts)) or batches[-1]
    try:
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        steps = [trainer.train_step() for _ in range(2)]
        trajs = [t for b in batches for t in b.trajectories]
        assert len(trajs) == 2 * 2 * cfg.rollout.n_samples
        for t in trajs:
            assert t.error is None and t.stop_reason == "max_turns"
            assert t.num_searches == 2 and t.search_failures == 0  # the built-in search, through the retriever
            assert t.tool_calls == {"calculate": 2} and t.tool_failures == 0  # the calculator, over MCP
            assert "<tool_response>\n56\n</tool_response>" in t.response_text
            assert "How many years before 2025 was it" in t.question
        for m in steps:
            assert m["search/failures"] == 0 and m["reward/rollout_errors"] == 0 and m["actor/updates"] == 2
            assert all(math.isfinite(v) for v in m.values() if isinstance(v, float))
        after = trainer.model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)
        print({"calculate_calls": sum(t.tool_calls.get("calculate", 0) for t in trajs), "searches": sum(t.num_searches for t in trajs),
               "tool_failures": sum(t.tool_failures for t in trajs), "reward_mean": [m.get("reward/mean") for m in steps]})
    finally:
        trainer.close()
