"""The one response/context budget computation of the agent loop (agent.rollout.remaining_budget)."""

import pytest

from agent.rollout import remaining_budget


@pytest.mark.parametrize(
    "prompt, response, max_response, context, expected",
    [
        (100, 0, 50, 200, (50, "length")),  # the response cap is tighter
        (100, 0, 150, 200, (100, "context")),  # the window is tighter
        (100, 0, 100, 200, (100, "length")),  # a tie: the configured response cap binds too
        (100, 40, 50, 200, (10, "length")),
        (190, 5, 50, 200, (5, "context")),
        (100, 50, 50, 150, (0, "length")),  # both exhausted at once: a tie again
        (150, 10, 100, 150, (-10, "context")),  # over the window
    ],
)
def test_remaining_budget_and_the_binding_cap(prompt, response, max_response, context, expected):
    assert remaining_budget(prompt, response, max_response, context) == expected


def test_a_real_rollout_at_the_tie_stops_for_length(untied_tiny_dir, retriever_client):
    """Response cap and context window run out together ("length"), or the window one token earlier
    ("context"), whichever stop decision ends the trajectory (mid-turn, observation check, turn start)."""
    from agent.engines import make_engine
    from agent.prompts import build_prompt
    from agent.rollout import RolloutConfig, run_rollouts

    engine = make_engine("hf", untied_tiny_dir, max_model_len=1024)
    question = "who wrote hamlet"
    prompt_len = len(build_prompt(engine.tokenizer, question, "search_r1").token_ids)
    for max_response in (30, 47, 64):
        for window, reason in ((prompt_len + max_response, "length"), (prompt_len + max_response - 1, "context")):
            cfg = RolloutConfig(max_turns=6, max_tokens_per_turn=12, max_obs_tokens=40, max_response_tokens=max_response,
                                max_prompt_tokens=prompt_len, max_context_tokens=window, seed=2)
            (t,) = run_rollouts(engine, [question], retriever_client, cfg)
            assert t.stop_reason == reason and len(t.prompt_ids) + len(t.response_ids) <= window
