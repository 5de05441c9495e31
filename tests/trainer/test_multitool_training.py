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
from trainer.tracking import format_stats

# 2 steps of 2 groups of 2: every count below is per step, so groups of 2 check what groups of 4 did at half the rows.
FAST = ["logging.progress=false", "data.prompts_per_step=2", "rollout.n_samples=2", "algorithm.mini_batch_size=2",
        "algorithm.micro_batch_size=2",
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
        per_step = len(trajs) // 2
        for m in steps:
            assert m["search/failures"] == 0 and m["reward/rollout_errors"] == 0 and m["actor/updates"] == 2
            assert all(math.isfinite(v) for v in m.values() if isinstance(v, float))
            # per tool, in the step's metrics: calls, failures by kind, the trajectories that used it and their reward
            for tool in ("search", "calculate"):
                assert m[f"tools/{tool}/calls"] == 2 * per_step and m[f"tools/{tool}/trajectories"] == per_step
                assert m[f"tools/{tool}/failures"] == m[f"tools/{tool}/timeouts"] == m[f"tools/{tool}/oversized"] == 0
                assert m[f"tools/{tool}/errors"] == 0 and m[f"tools/{tool}/reward"] == m["reward/mean"]
            assert (m["tools/calls"], m["tools/failures"]) == (4 * per_step, 0)
            assert f"tools={4 * per_step} tfail=0" in format_stats(m)  # the per-step line
        after = trainer.model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)
        print({"per_step": [{k: v for k, v in m.items() if k.startswith("tools/")} for m in steps],
               "reward_mean": [m.get("reward/mean") for m in steps]})
    finally:
        trainer.close()


def test_tool_sums_count_calls_failures_by_kind_and_reward():
    """trainer.sampled_batch.tool_sums on hand-made trajectories: MCP tools from tool_calls/tool_errors, the built-in
    search from its searches and failed searches; every offered tool named (even uncalled: the same sums on every rank)."""
    from agent.rollout import Trajectory
    from trainer.metrics import tool_metrics
    from trainer.sampled_batch import tool_sums

    def traj(calls, errors, searches=0, search_errors=()):
        return Trajectory("u", "g", 0, 0, "q", None, [1], tool_calls=calls, tool_errors=list(errors), tool_failures=len(errors),
                          num_searches=searches, search_failures=len(search_errors), search_errors=list(search_errors))

    trajs = [traj({"calculate": 2}, ["calculate: timeout"], searches=1),
             traj({"calculate": 1}, ["calculate: oversized"], searches=2, search_errors=["ReadTimeout: timed out"]),
             traj({}, [], searches=1, search_errors=["HTTPStatusError: 503"]),
             traj({"calculate": 1, "lookup": 1}, ["lookup: tool error", "calculate: RuntimeError"])]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5])
    m = tool_metrics(tool_sums(trajs, rewards, ["search", "calculate", "lookup", "unused"], builtin_search=True))
    assert {k: m[f"tools/calculate/{k}"] for k in ("calls", "failures", "timeouts", "oversized", "errors", "trajectories", "reward")} == \
        {"calls": 4, "failures": 3, "timeouts": 1, "oversized": 1, "errors": 1, "trajectories": 3, "reward": 0.5}
    assert (m["tools/search/calls"], m["tools/search/failures"], m["tools/search/timeouts"], m["tools/search/errors"]) == (4, 2, 1, 1)
    assert m["tools/search/reward"] == 2.0 / 3
    assert (m["tools/lookup/calls"], m["tools/lookup/errors"], m["tools/lookup/reward"]) == (1, 1, 0.5)
    assert m["tools/unused/calls"] == 0 and math.isnan(m["tools/unused/reward"])
    assert (m["tools/calls"], m["tools/failures"]) == (9, 6)
    # without the built-in search, a tool named "search" is an MCP server's: counted from tool_calls
    mcp = tool_metrics(tool_sums([traj({"search": 3}, ["search: timeout"], searches=0)], torch.tensor([1.0]), ["search"],
                                 builtin_search=False))
    assert (mcp["tools/search/calls"], mcp["tools/search/timeouts"], mcp["tools/search/reward"]) == (3, 1, 1.0)
