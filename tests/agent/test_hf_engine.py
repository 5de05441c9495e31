"""The transformers engine: token-exact stop strings, per-sequence seeds, processed log-probs, weight load."""

import pytest
import torch

from agent.engines import SamplingParams, make_engine
from agent.engines.sampling import processed_logits
from agent.prompts import build_prompt


@pytest.fixture(scope="module")
def hf(untied_tiny_dir):
    return make_engine("hf", untied_tiny_dir, max_model_len=1024)


@pytest.fixture(scope="module")
def prompts(hf):
    return [build_prompt(hf.tokenizer, q).token_ids for q in ("who wrote hamlet", "capital of france", "a longer question about rivers and mountains")]


def _torch_logprobs(engine, prompt, tokens):
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return logits


def test_stop_string_ends_at_the_completing_token(hf, prompts):
    free = hf.generate(prompts, SamplingParams(temperature=0, max_tokens=40))
    checked = 0
    for p, out in zip(prompts, free):
        # pick a stop string the greedy continuation is known to produce: the text of tokens 3..5
        target = hf.tokenizer.decode(out.token_ids[3:6], skip_special_tokens=True)
        if not target.strip():
            continue
        stopped = hf.generate([p], SamplingParams(temperature=0, max_tokens=40, stop=(target,)))[0]
        n = len(stopped.token_ids)
        assert stopped.token_ids == out.token_ids[:n]  # a prefix of the free run: nothing re-tokenized
        assert target in hf.tokenizer.decode(stopped.token_ids, skip_special_tokens=True)
        assert target not in hf.tokenizer.decode(stopped.token_ids[:-1], skip_special_tokens=True)
        assert (stopped.finish_reason, stopped.stop_reason) == ("stop", target)
        checked += 1
    assert checked >= 2


def test_seeded_sampling_is_independent_of_batch(hf, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12)
    batch = hf.generate(prompts, [params.with_(seed=100 + i) for i in range(len(prompts))])
    alone = hf.generate([prompts[2]], [params.with_(seed=102)])[0]
    assert batch[2].token_ids == alone.token_ids
    assert batch[2].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    other = hf.generate([prompts[2]], [params.with_(seed=7)])[0]
    assert other.token_ids != alone.token_ids


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.9, -1), (1.3, 1.0, 20), (0.0, 1.0, -1)])
def test_logprobs_are_the_processed_sampling_distribution(hf, prompts, temperature, top_p, top_k):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=10, seed=3)
    for p, out in zip(prompts, hf.generate(prompts, params)):
        logits = _torch_logprobs(hf, p, out.token_ids)
        # the transform written out independently of agent.engines.sampling
        z = logits / temperature if temperature > 0 else logits.clone()
        if top_k > 0:
            z[z < z.topk(top_k, dim=-1).values[:, -1:]] = float("-inf")
        if top_p < 1:
            probs = z.softmax(-1)
            sp, si = probs.sort(-1, descending=True)
            outside = (sp.cumsum(-1) - sp) >= top_p  # mass strictly before this token already >= top_p
            z.scatter_(-1, si, torch.where(outside, float("-inf"), z.gather(-1, si)))
        expected = z.log_softmax(-1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert torch.allclose(expected, torch.tensor(out.logprobs), atol=1e-4)
        assert torch.isfinite(expected).all()


def test_allowed_token_ids_and_eos(hf, prompts):
    allowed = (10, 11, 12)
    out = hf.generate(prompts[:1], SamplingParams(temperature=1.0, max_tokens=15, seed=0, allowed_token_ids=allowed))[0]
    assert set(out.token_ids) <= set(allowed)
    proc = processed_logits(_torch_logprobs(hf, prompts[0], out.token_ids), SamplingParams(allowed_token_ids=allowed))
    assert torch.isinf(proc[:, 13]).all()
    eos = hf.tokenizer.eos_token_id
    forced = hf.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=5, allowed_token_ids=(eos,)))[0]
    assert forced.token_ids == [eos] and (forced.finish_reason, forced.stop_reason) == ("stop", None)
    ignored = hf.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=(eos,), ignore_eos=True))[0]
    assert ignored.token_ids == [eos] * 3 and ignored.finish_reason == "length"


def test_bad_inputs_are_rejected(hf, prompts):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        hf.generate([[10**7]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        hf.generate([prompts[0]], SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="empty"):
        hf.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(stop=("",))


def test_load_weights_changes_outputs_and_score_matches_torch(untied_tiny_dir, prompts):
    eng = make_engine("hf", untied_tiny_dir, max_model_len=1024)
    seq = prompts[0] + [40, 41, 42, 43]
    before = eng.score([seq], [len(prompts[0])])[0]
    sd = {k: v + 0.05 * torch.randn_like(v) for k, v in eng.model.state_dict().items()}
    eng.load_weights(sd)
    after = eng.score([seq], [len(prompts[0])])[0]
    assert max(abs(a - b) for a, b in zip(before, after)) > 1e-3
    ref = eng.model.__class__(eng.model.config)
    ref.load_state_dict(sd)
    with torch.no_grad():
        lp = ref(torch.tensor([seq])).logits[0].log_softmax(-1)
    expected = [lp[t - 1, seq[t]].item() for t in range(len(prompts[0]), len(seq))]
    assert after == pytest.approx(expected, abs=1e-4)
    with pytest.raises(ValueError, match="does not match"):
        eng.load_weights({"nonsense.weight": torch.zeros(1)})
    assert eng.sleep() is False  # CPU: nothing to release
