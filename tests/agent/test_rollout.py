"""The multi-turn loop on real engines (transformers here; vLLM in test_vllm.py) and a real retriever.

Behaviour is driven by weight-scripted tiny models (agent/scripted.py): the searcher
always searches, the answerer answers at once, the random model never closes a tag.
"""

import pytest

from agent.actions import INVALID_ACTION_MESSAGE
from agent.engines import make_engine
from agent.rollout import RolloutConfig, run_rollouts, run_rollouts_with_stats, summarize
from agent.scripted import ANSWER_SCRIPT, SEARCH_SCRIPT
from retriever.client import RetrieverClient
from tests.fixtures.agent import Recorder, check_token_exact

FAST = dict(max_tokens_per_turn=24, max_obs_tokens=96, temperature=1.0, top_p=0.95)


@pytest.fixture(scope="module")
def searcher(searcher_dir):
    return make_engine("hf", searcher_dir, max_model_len=2048)


@pytest.fixture(scope="module")
def answerer(answerer_dir):
    return make_engine("hf", answerer_dir, max_model_len=2048)


@pytest.fixture(scope="module")
def noise(untied_tiny_dir):
    return make_engine("hf", untied_tiny_dir, max_model_len=2048)


@pytest.fixture(scope="module")
def questions(retriever_index):
    return [q["question"] for q in retriever_index.questions[:6]]


def test_searcher_runs_max_turns_then_a_final_turn_without_search(searcher, retriever_client, questions):
    rec = Recorder(searcher)
    trajs = run_rollouts(rec, questions, retriever_client, RolloutConfig(**FAST))
    check_token_exact(trajs, rec.calls)
    tok = searcher.tokenizer
    for t in trajs:
        assert t.stop_reason == "max_turns" and t.num_searches == 4 and t.search_failures == 0
        assert [s.role for s in t.spans] == ["model", "observation"] * 4 + ["model"]
        # the 5th turn searched too, but nothing was retrieved and nothing appended after it
        assert [s.action for s in t.spans if s.role == "model"] == ["search"] * 5
        assert t.queries == ["capital of France"] * 4 and len(t.retrieved_ids) == 4
        assert all(len(ids) == 3 and all(ids) for ids in t.retrieved_ids)
        for s in t.spans:
            text = tok.decode(t.response_ids[s.start : s.end])
            if s.role == "model":
                assert text == SEARCH_SCRIPT
            else:
                assert text.startswith("\n\n<information>Doc 1(Title: ") and text.endswith("</information>\n\n")
                assert s.end - s.start <= FAST["max_obs_tokens"]
        assert t.final_answer is None and t.timings["retrieval_s"] > 0
    assert len(rec.calls) == 5 * len(questions)  # one batched call per turn, 5 turns
    assert len({t.group_id for t in trajs}) == len(questions)


def test_answerer_stops_with_the_answer(answerer, retriever_client, questions):
    trajs = run_rollouts(answerer, questions, retriever_client, RolloutConfig(**FAST))
    for t in trajs:
        assert (t.stop_reason, t.final_answer, t.num_searches, t.num_turns) == ("answer", "Paris", 0, 1)
        assert t.response_text == ANSWER_SCRIPT and t.loss_mask == [1] * len(t.response_ids)


def test_invalid_actions_get_the_corrective_message(noise, retriever_client, questions):
    rec = Recorder(noise)
    trajs = run_rollouts(rec, questions[:3], retriever_client, RolloutConfig(**{**FAST, "max_obs_tokens": 128}, max_turns=2))
    check_token_exact(trajs, rec.calls)
    for t in trajs:
        assert t.stop_reason == "max_turns" and t.num_searches == 0 and t.invalid_actions == 2
        obs = [s for s in t.spans if s.role == "observation"]
        assert len(obs) == 2 and all(s.action == "invalid" for s in obs)
        expected = noise.tokenizer(INVALID_ACTION_MESSAGE, add_special_tokens=False)["input_ids"]
        assert all(t.response_ids[s.start : s.end] == expected for s in obs)


def test_response_and_context_caps(searcher, noise, retriever_client, questions):
    trajs = run_rollouts(noise, questions[:2], retriever_client, RolloutConfig(**{**FAST, "max_response_tokens": 60}))
    for t in trajs:
        assert t.stop_reason == "length" and len(t.response_ids) <= 60
    trajs = run_rollouts(searcher, questions[:2], retriever_client, RolloutConfig(**FAST, max_context_tokens=300, max_prompt_tokens=250))
    for t in trajs:
        assert t.stop_reason == "context" and len(t.prompt_ids) + len(t.response_ids) <= 300
        assert t.num_searches <= 1


def test_one_bad_prompt_does_not_crash_the_batch(searcher, retriever_client, questions):
    prompts = [questions[0], "", "x" * 20000, questions[1]]
    trajs = run_rollouts(searcher, prompts, retriever_client, RolloutConfig(**FAST, max_turns=1))
    assert [t.stop_reason for t in trajs] == ["max_turns", "error", "error", "max_turns"]
    assert "empty question" in trajs[1].error and "PromptTooLong" in trajs[2].error
    # the same over-long question fits when the policy allows truncating it
    ok = run_rollouts(searcher, ["x " * 3000], retriever_client, RolloutConfig(**FAST, max_turns=1, max_prompt_tokens=1000, prompt_truncation="truncate_question"))[0]
    assert ok.stop_reason == "max_turns" and ok.prompt_truncated_tokens > 0 and len(ok.prompt_ids) <= 1000


@pytest.mark.parametrize("mode", ["500", "slow", "flaky", "down"])
def test_retrieval_failures_become_observations(searcher, questions, fault_proxy, mode):
    if mode == "down":
        url = "http://127.0.0.1:9"  # discard port: nothing listens
    else:
        fault_proxy.mode, url = mode, fault_proxy.url
    client = RetrieverClient(url, timeout=1.0, retries=0)
    cfg = RolloutConfig(**FAST, max_turns=2, mode="async" if mode == "flaky" else "batched")
    trajs = run_rollouts(searcher, questions[:3], client, cfg)
    for t in trajs:
        assert t.stop_reason == "max_turns" and t.num_searches == 2
        for ids in t.retrieved_ids:
            assert ids == [] or len(ids) == 3
        failed = [s for s in t.spans if s.action == "failed"]
        assert len(failed) == t.search_failures
        for s in failed:
            assert "search engine is unavailable" in searcher.tokenizer.decode(t.response_ids[s.start : s.end])
        assert len(t.search_errors) == t.search_failures
    total = sum(t.search_failures for t in trajs)
    if mode == "flaky":
        assert 0 < total < 6  # some requests failed, some went through
    else:
        assert total == 6
    assert summarize(trajs)["rollout/search_failures"] == total


def test_async_driver_gives_the_same_trajectories(searcher, noise, retriever_client, questions):
    for engine in (searcher, noise):
        cfg = RolloutConfig(**FAST, max_turns=2)
        a = run_rollouts(engine, questions[:4], retriever_client, cfg, batch_tag="x")
        b, stats = run_rollouts_with_stats(engine, questions[:4], retriever_client, RolloutConfig(**FAST, max_turns=2, mode="async"), batch_tag="x")
        assert [t.response_ids for t in a] == [t.response_ids for t in b]
        assert [t.stop_reason for t in a] == [t.stop_reason for t in b]
        assert stats.wall_s >= stats.generation_s > 0


def test_group_sampling(noise, retriever_client, questions):
    trajs = run_rollouts(noise, questions[:2], retriever_client, RolloutConfig(**FAST, max_turns=0, n_samples=3))
    assert [(t.prompt_index, t.sample_index) for t in trajs] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert len({t.group_id for t in trajs}) == 2 and len({t.uid for t in trajs}) == 6
    assert len({tuple(t.response_ids) for t in trajs[:3]}) == 3  # different seeds per sample
    again = run_rollouts(noise, questions[:2], retriever_client, RolloutConfig(**FAST, max_turns=0, n_samples=3))
    assert [t.response_ids for t in again] == [t.response_ids for t in trajs]  # seeded
    assert trajs[0].group_id != again[0].group_id  # group ids are unique per call


def test_math_task_is_single_turn(noise):
    trajs = run_rollouts(noise, ["What is 1+1?"], None, RolloutConfig(task="math", max_response_tokens=30, max_prompt_tokens=200))
    (t,) = trajs
    assert t.num_turns == 1 and t.stop_reason in ("answer", "length") and t.loss_mask == [1] * len(t.response_ids)
    with pytest.raises(ValueError, match="needs a retriever"):
        run_rollouts(noise, ["q"], None, RolloutConfig())


class CoroutineRetriever:
    """A caller's asyncio retriever (the agent loop is synchronous and cannot await it)."""

    async def retrieve(self, queries, topk=None):
        return [[] for _ in queries]


def test_async_retriever_is_refused(noise):
    with pytest.raises(TypeError, match="synchronous retriever"):
        run_rollouts(noise, ["q"], CoroutineRetriever(), RolloutConfig())


def test_smollm2_prompted_rollout_is_token_exact(smollm2_dir, retriever_client, questions):
    """A real instruct model, prompted with the Search-R1 template through its own chat template."""
    engine = make_engine("hf", smollm2_dir, max_model_len=2048)
    prompt = engine.tokenizer.decode(run_rollouts(engine, questions[:1], retriever_client, RolloutConfig(max_turns=0, max_tokens_per_turn=1))[0].prompt_ids)
    assert prompt.count("<|im_start|>user\nAnswer the given question.") == 1 and prompt.endswith("<|im_start|>assistant\n")
    rec = Recorder(engine)
    trajs = run_rollouts(rec, questions[:2], retriever_client, RolloutConfig(max_turns=1, max_tokens_per_turn=40, max_obs_tokens=200, temperature=0.0))
    check_token_exact(trajs, rec.calls)
    for t in trajs:
        assert t.stop_reason in ("answer", "max_turns") and t.error is None
