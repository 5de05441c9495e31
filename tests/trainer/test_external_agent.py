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


def _one_step_config(tmp_path, tool_searcher_dir, retriever_server, agent: str) -> TrainConfig:
    """One training step of 1 prompt (a group of 4 sessions) on the tiny search config, rolled out by the external
    ``agent``."""
    return load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", [
        f"run.output_dir={tmp_path}", f"model.policy={tool_searcher_dir}", f"retriever.urls=[{retriever_server.url}]",
        f"rollout.agent={agent}", "logging.progress=false", "data.prompts_per_step=1", "algorithm.mini_batch_size=4",
        "algorithm.micro_batch_size=2", "rollout.max_tokens_per_turn=24", "rollout.max_response_tokens=2048",
        "run.save_every=0", "run.total_steps=1"])


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


COMPACTING = "examples.search_agent:solve_compacting"


def test_a_session_that_rewrites_its_history_trains_every_segment_token_exact(tool_searcher_dir, retriever_client, retriever_index):
    """examples.search_agent:solve_compacting rewrites its conversation after two tool rounds: its session (4 calls)
    assembles into 2 contexts. Both become the trajectory's rows (the one with the last call, plus one extra segment),
    each token for token the engine's recorded prompt and sampled ids, with the loss mask 1 exactly on sampled ids."""
    import httpx
    import openai

    from agent.external import LocalEndpoint, _call, _fill
    from agent.rollout import Trajectory

    engine = make_engine("hf", tool_searcher_dir, max_model_len=2048)
    question = retriever_index.questions[0]["question"]
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 24}
    with LocalEndpoint(engine) as endpoint:
        client = openai.OpenAI(base_url=endpoint.url + "/v1", api_key=endpoint.api_key, max_retries=0,
                               default_headers={"X-Session-Id": "compacting-1"})
        from agent.external import load_agent

        assert _call(load_agent(COMPACTING), client, {"question": question}, "compacting-1", retriever_client, sampling) is None
        record = httpx.get(f"{endpoint.url}/v1/sessions/compacting-1", headers={"Authorization": f"Bearer {endpoint.api_key}"}).json()
    calls = record["calls"]
    assert record["split"] is True and len(calls) == 4
    assert [s["calls"] for s in record["trajectories"]] == [[0, 1], [2, 3]]
    t = Trajectory("u", "g", 0, 0, question, None, [], format="external")
    _fill(t, record, max_response_tokens=4096)
    assert len(t.extra_segments) == 1 and (t.stop_reason, t.num_turns, t.num_searches) == ("max_turns", 4, 2)
    rows = [(t.extra_segments[0], [0, 1]), (t, [2, 3])]  # in session order: the extra segment, then the final one
    tok = engine.tokenizer
    for row, held in rows:
        first = calls[held[0]]
        assert row.prompt_ids == first["prompt_ids"]  # the engine's exact prompt of the segment's first call
        context = list(row.prompt_ids)
        at = 0
        for k, i in enumerate(held):
            call = calls[i]
            assert call["prompt_ids"][: len(context)] == context  # each later call extends the segment's context
            between = call["prompt_ids"][len(context):]
            assert (k == 0) == (not between)
            assert row.response_ids[at : at + len(between)] == between and row.loss_mask[at : at + len(between)] == [0] * len(between)
            assert row.sampling_logprobs[at : at + len(between)] == [0.0] * len(between)
            at += len(between)
            n = len(call["completion_ids"])
            assert row.response_ids[at : at + n] == call["completion_ids"] and row.loss_mask[at : at + n] == [1] * n
            assert row.sampling_logprobs[at : at + n] == pytest.approx(call["logprobs"])
            at += n
            context = call["prompt_ids"] + call["completion_ids"]
        assert at == len(row.response_ids) == len(row.loss_mask) == len(row.sampling_logprobs)
    assert "What your searches found so far" in tok.decode(t.prompt_ids)  # the rewritten history opens the final segment
    assert "What your searches found so far" not in tok.decode(t.extra_segments[0].prompt_ids)


def test_each_segment_row_carries_its_episodes_advantage():
    """trainer.sampled_batch.training_rows: a trajectory's extra segments follow it as rows of their own; GRPO groups
    are over the trajectories (the group size unchanged) and every segment row gets its episode's advantage; filler
    rows (even ranks out) get 0 and train nothing."""
    from agent.rollout import TrainingSegment, Trajectory
    from trainer.algo.grpo import broadcast_advantages, grpo_advantages
    from trainer.batch import trajectory_batch
    from trainer.sampled_batch import session_counts, training_rows

    def traj(uid: str, group: str, extra: int) -> Trajectory:
        t = Trajectory(uid, group, 0, 0, "q", None, [5, 6], response_ids=[7, 8, 9], loss_mask=[1, 0, 1],
                       sampling_logprobs=[-0.5, 0.0, -0.25], format="external")
        t.extra_segments = [TrainingSegment([5, 6 + k], [10 + k, 11], [1, 1], [-1.0, -2.0], num_turns=1) for k in range(extra)]
        return t

    trajs = [traj("a", "g1", 2), traj("b", "g1", 0), traj("c", "g2", 1), traj("d", "g2", 0)]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    rows = training_rows(trajs, pad_id=0, at_least=9)
    assert rows.episode == [0, 0, 0, 1, 2, 2, 3, -1, -1] and rows.extra == 5
    adv = grpo_advantages(rewards, [t.group_id for t in trajs])  # over the 4 episodes, groups of 2
    row_adv = rows.per_row(adv)
    assert row_adv.tolist() == [adv[0]] * 3 + [adv[1]] + [adv[2]] * 2 + [adv[3], 0.0, 0.0]
    batch = trajectory_batch(rows.rows, pad_id=0)
    assert batch.loss_mask.tolist()[1] == [1.0, 1.0, 0.0] and batch.loss_mask.tolist()[0] == [1.0, 0.0, 1.0]
    assert batch.loss_mask[7:].sum() == 0 and batch.stored["behavior_logp"][1].tolist() == [-1.0, -2.0, 0.0]
    per_token = broadcast_advantages(row_adv, batch.loss_mask)
    assert torch.equal(per_token[2], torch.tensor([adv[0], adv[0], 0.0]))
    assert session_counts(trajs) == {"rollout/sessions": 4.0, "rollout/session_splits": 2.0, "rollout/session_segments": 7.0}


def test_a_training_step_with_the_example_agent_trains_every_segment_of_split_sessions(tmp_path, tool_searcher_dir,
                                                                                      retriever_server):
    """One training step with an external agent (the example's compacting variant): every session splits, every
    segment's sampled tokens are trained, the weights move and the run's protocol card names the agent. (The plain
    example agent's sessions -- one context each -- are checked token for token above; a step on them trained rows
    this step also trains, so it is not repeated.)"""
    cfg = _one_step_config(tmp_path, tool_searcher_dir, retriever_server, COMPACTING)
    trainer = Trainer(cfg).setup()
    batches = []
    sample = trainer.sample_batch
    trainer.sample_batch = lambda prompts: batches.append(sample(prompts)) or batches[-1]
    try:
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        m = trainer.train_step()
        (sampled,) = batches
        n = len(sampled.trajectories)
        assert n == cfg.rollout.n_samples == 4 and m["reward/rollout_errors"] == 0 and m["search/per_traj"] == 2
        assert all(len(t.extra_segments) == 1 for t in sampled.trajectories)
        assert (m["rollout/session_splits"], m["rollout/segments_per_session"], m["rollout/extra_rows"]) == (n, 2.0, n)
        model_tokens = sum(sum(t.loss_mask) + sum(sum(s.loss_mask) for s in t.extra_segments) for t in sampled.trajectories)
        assert m["response/model_tokens_mean"] * n == pytest.approx(model_tokens)  # every segment's sampled tokens trained
        assert m["actor/updates"] == 2  # 2n rows, 4 per optimizer step
        after = trainer.model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)
        assert trainer.provenance["protocol_card"]["settings"]["agent"] == COMPACTING
    finally:
        trainer.close()
