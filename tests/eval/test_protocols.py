"""Protocol presets carry the paper's settings; overrides are validated."""

import pytest

from emapg.config import ConfigError
from eval.protocols import PROTOCOLS, get_protocol


def test_paper_presets():
    qa = PROTOCOLS["qa_greedy"]
    assert (qa.n, qa.temperature, qa.top_p, qa.max_turns, qa.retrieval_topk, qa.max_tokens) == (1, 0.0, 1.0, 4, 3, 500)
    assert qa.max_obs_tokens == 500 and qa.max_response_tokens == 4096 and qa.template == "search_r1"
    m = PROTOCOLS["math_paper"]
    assert (m.n, m.temperature, m.top_p, m.max_tokens, m.seed, m.max_prompt_tokens) == (32, 0.8, 0.9, 28000, 429, 2048)
    assert m.template == "math" and m.grader == "mathd_or_math_verify"
    readme = PROTOCOLS["math_benchmark_readme"]
    assert (readme.n, readme.temperature, readme.top_p, readme.max_tokens) == (16, 0.6, 0.95, 32768)
    for p in PROTOCOLS.values():
        p.validate()
        assert p.max_prompt_tokens + (p.max_response_tokens if p.suite == "qa" else p.max_tokens) <= p.max_model_len


def test_overrides_and_errors():
    p = get_protocol("math_paper", n=4, temperature=None, grader="math_verify")
    assert (p.n, p.temperature, p.grader) == (4, 0.8, "math_verify")
    with pytest.raises(ConfigError, match="unknown protocol"):
        get_protocol("nope")
    with pytest.raises(ConfigError, match="unknown protocol field"):
        get_protocol("qa_greedy", temp=1.0)
    with pytest.raises(ConfigError, match="identical"):
        get_protocol("qa_greedy", n=4)  # greedy samples would all be the same
    with pytest.raises(ConfigError, match="top_p"):
        get_protocol("qa_greedy", top_p=0.0)
    with pytest.raises(ConfigError, match="not one of"):
        get_protocol("math_quick", grader="sympy")
