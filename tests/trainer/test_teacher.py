"""The distillation teacher (trainer/teacher.py): in process and behind a real ``emapg engine serve`` (transformers
engine, tiny Qwen2) scoring the same sampled tokens; a teacher with another tokenizer is refused; the
``POST /score`` top-k request is bounded."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent.engines.launch import EngineServer
from emapg.config import ConfigError
from trainer.batch import build_token_batch
from trainer.config import AlgorithmConfig
from trainer.teacher import LocalTeacher, RemoteTeacher

KEY = "teacher-key"
TEMP = 0.8


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("teacher") / "server.log"
    with EngineServer(tiny_model_dir, engine="hf", api_key=KEY, max_model_len=256, log_path=log,
                      extra_args=["--max-score-values", "2000"]) as s:
        yield s


@pytest.fixture(scope="module")
def other_tokenizer_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with one more token in its tokenizer: same weights, another token -> id map."""
    d = tmp_path_factory.mktemp("teacher") / "other-tok"
    shutil.copytree(tiny_model_dir, d, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(d)
    tok.add_tokens(["<zz_new_token>"])
    tok.save_pretrained(d)
    return d


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 3, 7)]
    responses = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (6, 2, 4)]
    masks = [[1, 1, 0, 0, 1, 1], [1, 1], [1, 0, 1, 1]]  # 0: tool output (scored anyway, never distilled)
    return build_token_batch(prompts, responses, masks, pad_id=0)


def _reference(model_dir, batch, topk):
    """Each row alone through the model: log-softmax(logits / T) at the response positions."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    for i in range(batch.size):
        p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        ids = batch.input_ids[i, batch.prompt_width - p: batch.prompt_width + r]
        with torch.no_grad():
            lp = (model(input_ids=ids[None]).logits[0, p - 1: p + r - 1] / TEMP).log_softmax(-1)
        rows.append((lp.gather(-1, ids[p:, None])[:, 0], torch.topk(lp, topk)))
    return rows


def test_local_teacher_scores_the_sampled_tokens_exactly(tiny_model_dir):
    batch = _batch()
    teacher = LocalTeacher(str(tiny_model_dir), "cpu", policy_tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir))
    out = teacher.score(batch, topk=5, temperature=TEMP, chunk_size=4, alg=AlgorithmConfig(micro_batch_size=2, mini_batch_size=2))
    for i, (lp, top) in enumerate(_reference(tiny_model_dir, batch, 5)):
        r = len(lp)
        torch.testing.assert_close(out["teacher_logp"][i, :r], lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(out["teacher_topk_logp"][i, :r], top.values, rtol=0, atol=1e-5)
        assert torch.equal(out["teacher_topk_indices"][i, :r], top.indices)
        assert out["teacher_logp"][i, r:].abs().sum() == 0  # nothing past the row's response


def test_remote_teacher_scores_equal_the_in_process_teachers(server, tiny_model_dir):
    batch = _batch(1)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    local = LocalTeacher(str(tiny_model_dir), "cpu", policy_tokenizer=tok).score(
        batch, topk=4, temperature=TEMP, chunk_size=1024, alg=AlgorithmConfig(micro_batch_size=4, mini_batch_size=4))
    remote = RemoteTeacher([server.url], policy_model=str(tiny_model_dir), policy_tokenizer=tok, api_key=KEY, rows_per_request=2)
    try:
        got = remote.score(batch, topk=4, temperature=TEMP)
        plain = remote.score(batch, topk=0, temperature=TEMP)
    finally:
        remote.close()
    torch.testing.assert_close(got["teacher_logp"], local["teacher_logp"], rtol=0, atol=1e-5)
    torch.testing.assert_close(got["teacher_topk_logp"], local["teacher_topk_logp"], rtol=0, atol=1e-5)
    assert torch.equal(got["teacher_topk_indices"], local["teacher_topk_indices"])
    torch.testing.assert_close(plain["teacher_logp"], local["teacher_logp"], rtol=0, atol=1e-5)
    assert set(plain) == {"teacher_logp"}


def test_a_teacher_with_another_tokenizer_is_refused(server, tiny_model_dir, other_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"(?s)teacher's tokenizer .*other-tok.*differs from the policy's tokenizer .*tiny-qwen2"):
        LocalTeacher(str(other_tokenizer_dir), "cpu", policy_tokenizer=tok)
    with pytest.raises(ConfigError, match=r"(?s)teacher's tokenizer .*tiny-qwen2.*served by.*differs from the policy's tokenizer .*other-tok"):
        RemoteTeacher([server.url], policy_model=str(other_tokenizer_dir),
                      policy_tokenizer=AutoTokenizer.from_pretrained(other_tokenizer_dir), api_key=KEY)


def test_score_topk_requests_are_bounded(server):
    def post(body):
        return httpx.post(server.url + "/score", content=json.dumps(body).encode(), timeout=60,
                          headers={"X-API-Key": KEY, "content-type": "application/json"})

    ok = post({"token_ids": [[5, 6, 7, 8]], "start": [1], "topk": 3, "temperature": 0.5})
    assert ok.status_code == 200
    d = ok.json()
    assert len(d["logprobs"][0]) == 3 and len(d["topk_ids"][0]) == 3 and all(len(r) == 3 for r in d["topk_logprobs"][0])
    assert all(r == sorted(r, reverse=True) for r in d["topk_logprobs"][0])
    for body, status, text in [
        ({"token_ids": [[5, 6]], "start": [1], "topk": 5000}, 422, "topk"),
        ({"token_ids": [[5, 6]], "start": [1], "topk": True}, 422, "topk"),
        ({"token_ids": [[5, 6]], "start": [1], "temperature": 0}, 422, "temperature"),
        ({"token_ids": [[5, 6]], "start": [1], "topk": 2, "extra": 1}, 422, "extra"),
        ({"token_ids": [list(range(3, 103))] * 3, "start": [1] * 3, "topk": 10}, 413, "--max-score-values"),
    ]:
        r = post(body)
        assert r.status_code == status and text in r.text, (body, r.status_code, r.text)
    health = httpx.get(server.url + "/health").json()
    assert health["tokenizer"]["fingerprint"] and health["tokenizer"]["size"] > 0
