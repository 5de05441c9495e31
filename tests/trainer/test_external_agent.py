"""``rollout.agent=module:function``: an agent written against the OpenAI API, trained through the recording endpoint.

Real parts: examples/search_agent.py (the openai client, function calling, the retriever), the scripted tiny
tool-call searcher as the policy on the transformers engine behind a loopback generation server
(agent/external.py ``LocalEndpoint``), the real retriever server, the real trainer.
"""

from __future__ import annotations

import pytest
import torch

from agent.engines import make_engine
from agent.rollout import RolloutConfig, run_rollouts
from emapg.config import ConfigError, load_config
from emapg.paths import CONFIG_DIR
from trainer.config import TrainConfig
from trainer.loop import Trainer

AGENT = "examples.search_agent:solve"


def test_the_agent_option_is_checked():
    for spec, needle in [("no_colon", "not module:function"), ("no_such_module:f", "cannot import"),
                         ("examples.search_agent:nope", "has no function 'nope'")]:
        with pytest.raises(ConfigError, match=f"rollout.agent: .*{needle}"):
            RolloutConfig(agent=spec).validate()
    with pytest.raises(ConfigError, match="rollout.task=search"):
        RolloutConfig(agent=AGENT, task="math").validate()


def test_external_rollouts_are_token_exact_sessions(tool_searcher_dir, retriever_client, retriever_index):
    engine = make_engine("hf", tool_searcher_dir, max_model_len=2048)
    questions = [q["question"] for q in retriever_index.questions[:2]]
    trajs = run_rollouts(engine, questions, retriever_client, RolloutConfig(agent=AGENT, n_samples=2, max_tokens_per_turn=24,
                                                                  max_response_tokens=4096))
    tok = engine.tokenizer
    assert len(trajs) == 4 and len({t.group_id for t in trajs}) == 2
    for t in trajs:
        assert t.error is None and t.format == "external"
        # the scripted model calls search on every turn: max_turns rounds, then the final call (no answer)
        assert (t.stop_reason, t.num_turns, t.num_searches, t.final_answer, t.scored_text) == ("max_turns", 3, 2, None, "")
        assert tok.decode(t.prompt_ids).count('"name": "search"') == 1 and "Question: " + t.question in tok.decode(t.prompt_ids)
        for s in t.spans:
            ids = t.response_ids[s.start : s.end]
            assert t.loss_mask[s.start : s.end] == [int(s.role == "model")] * len(ids)
            if s.role == "model":
                assert tok.decode(ids) == '<tool_call>{"name": "search", "arguments": {"query": "capital of France"}}</tool_call><|im_end|>'
                assert all(lp <= 0 for lp in t.sampling_logprobs[s.start : s.end])
            else:
                assert "<tool_response>\nDoc 1: " in tok.decode(ids)  # the example agent's own tool output, masked


def test_one_training_step_with_the_example_agent(tmp_path, tool_searcher_dir, retriever_server):
    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", [
        f"run.output_dir={tmp_path}", f"model.policy={tool_searcher_dir}", f"retriever.urls=[{retriever_server.url}]",
        f"rollout.agent={AGENT}", "logging.progress=false", "data.prompts_per_step=2", "algorithm.mini_batch_size=4",
        "algorithm.micro_batch_size=2", "rollout.max_tokens_per_turn=24", "rollout.max_response_tokens=2048",
        "run.save_every=0", "run.total_steps=1"])
    trainer = Trainer(cfg).setup()
    try:
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        m = trainer.train_step()
        assert m["reward/rollout_errors"] == 0 and m["actor/updates"] == 2 and m["search/per_traj"] == 2
        after = trainer.model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)
        assert trainer.provenance["protocol_card"]["settings"]["agent"] == AGENT
    finally:
        trainer.close()


def test_a_user_reward_function_replaces_the_qa_metrics():
    from agent.rollout import Trajectory
    from tasks.datasets import Example
    from trainer.data import SampledPrompt
    from trainer.sampled_batch import grade

    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml",
                      ["rollout.n_samples=2", "rollout.agent_reward=examples.search_agent:contains_gold"])
    prompts = [SampledPrompt(Example("1", "capital of france?", ["Paris"], "nq"), "g")]
    trajs = [Trajectory("a", "g", 0, 0, "q", "1", [1], final_answer="It is Paris.", stop_reason="answer", format="external"),
             Trajectory("b", "g", 0, 1, "q", "1", [1], final_answer="Lyon", stop_reason="answer", format="external")]
    assert [o.reward for o in grade(trajs, prompts, cfg)] == [1.0, 0.0]
    cfg.rollout.agent_reward = None  # the QA metrics: exact match of the final answer
    assert [o.reward for o in grade(trajs, prompts, cfg)] == [0.0, 0.0]
    with pytest.raises(ConfigError, match="rollout.agent_reward"):
        RolloutConfig(agent_reward="examples.search_agent:missing").validate()
