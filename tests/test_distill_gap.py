"""studies/distill_gap.py: the response split into generated text and observations, the part labels, the
per-token statistics against a brute-force sum over the vocabulary, and an end-to-end run on tiny models (a student
equal to its teacher diverges by 0, a perturbed one does not)."""

import json
import math

import pytest
import torch

from agent.actions import INVALID_ACTION_MESSAGE, information_text
from studies.distill_gap import encode, main, part_labels, split_response, token_stats


def test_the_response_splits_into_generated_text_and_observations():
    obs = information_text("Doc 1(Title: x) y")
    text = f"<search> q </search>{obs}hmm{INVALID_ACTION_MESSAGE}<answer> Paris </answer>"
    assert split_response(text) == [("<search> q </search>", True), (obs, False), ("hmm", True),
                                     (INVALID_ACTION_MESSAGE, False), ("<answer> Paris </answer>", True)]
    assert split_response(obs) == [(obs, False)]


def test_tokens_inside_search_and_answer_tags_are_labelled_by_their_tag():
    seg = "ab<search>cd</search>e<answer>fg</answer>"
    offsets = [(0, 2), (2, 10), (10, 12), (12, 21), (21, 22), (22, 30), (30, 32), (32, 41)]
    assert part_labels(seg, offsets) == ["other", "other", "search", "other", "other", "other", "answer", "other"]


def test_token_stats_equal_the_sums_over_the_vocabulary():
    g = torch.Generator().manual_seed(0)
    s_logits, t_logits = torch.randn(3, 7, generator=g) * 2, torch.randn(3, 7, generator=g) * 2
    stats = token_stats(s_logits, t_logits, topk=2)
    for i in range(3):
        ps, pt = torch.softmax(s_logits[i].double(), -1).tolist(), torch.softmax(t_logits[i].double(), -1).tolist()
        head = sorted(range(7), key=lambda v: -pt[v])[:2]
        assert stats["reverse_kl"][i] == pytest.approx(sum(a * math.log(a / b) for a, b in zip(ps, pt)), abs=1e-5)
        assert stats["student_entropy"][i] == pytest.approx(-sum(a * math.log(a) for a in ps), abs=1e-5)
        assert stats["teacher_entropy"][i] == pytest.approx(-sum(b * math.log(b) for b in pt), abs=1e-5)
        assert stats["student_tail_mass"][i] == pytest.approx(1 - sum(ps[v] for v in head), abs=1e-5)
        assert stats["teacher_tail_mass"][i] == pytest.approx(1 - sum(pt[v] for v in head), abs=1e-5)
        assert stats["argmax_agree"][i] == float(max(range(7), key=ps.__getitem__) == max(range(7), key=pt.__getitem__))


def test_a_student_equal_to_its_teacher_diverges_by_zero_and_a_perturbed_one_does_not(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    response = f"<search> capital </search>{information_text('Doc 1(Title: France) Paris')}<answer> Paris </answer>"
    ids, labels, generated = encode(tok, "Question: capital of France?", response)
    assert len(ids) == len(labels) and generated == sum(lab is not None for lab in labels) > 0
    assert {"search", "answer", "other"} <= set(labels)
    items = tmp_path / "eval" / "items"
    items.mkdir(parents=True)
    record = {"id": "q1", "dataset": "nq", "prompt": "Question: capital of France?",
              "samples": [{"response": response, "model_tokens": generated, "scores": {"em": 1.0}},
                          {"response": "<answer> Lyon </answer>", "scores": {"em": 0.0}}]}
    (items / "nq.jsonl").write_text(json.dumps(record) + "\n")
    noisy = tmp_path / "noisy"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * p.abs().mean() * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    model.save_pretrained(noisy)
    tok.save_pretrained(noisy)
    out = tmp_path / "gap.json"
    assert main(["--samples", str(tmp_path / "eval"), "--teacher", str(tiny_model_dir), "--student", f"same={tiny_model_dir}",
                 "--student", f"noisy={noisy}", "--topk", "4", "--out", str(out), "--allow-dirty"]) == 0
    report = json.loads(out.read_text())
    assert report["samples"] == 2 and report["retokenized_count_matches_recorded"] == 1.0
    same, other = report["students"]["same"]["per_part"]["all"], report["students"]["noisy"]["per_part"]["all"]
    assert same["reverse_kl"] == pytest.approx(0.0, abs=1e-6) and same["argmax_agree"] == 1.0
    assert same["student_entropy"] == pytest.approx(same["teacher_entropy"], abs=1e-6)
    assert other["reverse_kl"] > 0.01 and other["tokens"] == same["tokens"] == report["generated_tokens"]
    assert set(report["students"]["same"]["by_sample_outcome"]) == {"right", "wrong"}
