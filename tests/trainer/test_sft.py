"""``emapg sft``: trajectories assembled by the real rollout loop, masks, eval exclusion, the loss going down.

Real parts: the MiniLM index and a live ``emapg serve`` over HTTP (``retriever_server``), the tiny
Qwen2 and a weight-scripted searcher run by the real transformers engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from agent.prompts import build_prompt
from agent.teacher_forcing import ReplayError, ScriptedTrajectory, parse_passages, replay_trajectories
from agent.rollout import RolloutConfig, run_rollouts
from tasks.datasets import Example, load_dataset
from tasks.qa import extract_answer, retrieval_recall

# The tiny tokenizer spends about one token per 1-2 characters: turns and passages need room.
ROLLOUT = RolloutConfig(max_turns=2, max_tokens_per_turn=96, max_obs_tokens=400, max_response_tokens=800,
                        max_prompt_tokens=512, topk=3)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_replay_reproduces_a_real_rollout_token_for_token(searcher_dir, retriever_client, retriever_index):
    """A real engine's rollout, replayed from its model text, gives the same ids, mask and spans: no format drift."""
    from agent.engines.hf_engine import HFEngine

    engine = HFEngine(str(searcher_dir), max_model_len=1400)
    questions = [q["question"] for q in retriever_index.questions[:3]]
    real = run_rollouts(engine, questions, retriever_client, ROLLOUT)
    assert all(t.num_searches == 2 for t in real)  # search, observation, search, observation, final turn
    scripts = [ScriptedTrajectory(t.question, [engine.tokenizer.decode(ids, skip_special_tokens=True)
                                               for ids in t.span_ids("model")]) for t in real]
    replayed = replay_trajectories(engine.tokenizer, scripts, retriever_client, ROLLOUT, max_model_len=1400)
    for a, b in zip(real, replayed):
        assert b.prompt_ids == a.prompt_ids
        assert b.response_ids == a.response_ids
        assert b.loss_mask == a.loss_mask
        assert [(s.start, s.end, s.role, s.action) for s in b.spans] == [(s.start, s.end, s.role, s.action) for s in a.spans]
        assert b.model_text == a.model_text and b.stop_reason == a.stop_reason


def test_constructed_trajectories_mask_only_model_tokens(tokenizer, retriever_client, retriever_index):
    from trainer.sft.data import construct_trajectories, observed_text

    examples = [Example(f"q{i}", q["question"], q["answers"], "nq_gold") for i, q in enumerate(retriever_index.questions[:24])]
    # These are evaluation questions, so the default exclusion would drop them all; here we test masks.
    pairs, report = construct_trajectories({"nq_gold": examples}, tokenizer, retriever_client, ROLLOUT, max_model_len=1400, exclude={})
    assert report.questions == {"nq_gold": 24}
    assert 0 < report.total_kept == len(pairs) <= 24
    assert report.total_kept + report.answer_not_retrieved["nq_gold"] + report.errors["nq_gold"] == 24
    for t, ex in pairs:
        assert t.prompt_ids == build_prompt(tokenizer, ex.question, "search_r1").token_ids
        roles = [s.role for s in t.spans]
        assert roles == ["model", "observation", "model"] and t.spans[1].action == "information"
        for s in t.spans:
            assert t.loss_mask[s.start : s.end] == [int(s.role == "model")] * (s.end - s.start)
        model_ids = [tok for tok, m in zip(t.response_ids, t.loss_mask) if m]
        assert model_ids == t.span_ids("model")[0] + t.span_ids("model")[1]
        assert tokenizer.decode(t.span_ids("model")[0]) == f"<search> {ex.question.strip()} </search>"
        answer = extract_answer(t.model_text)
        assert answer in ex.answers
        assert retrieval_recall([observed_text(tokenizer, t)], [answer]) == 1.0  # the model was shown it
        assert t.queries == [ex.question.strip()] and len(t.retrieved_ids[0]) == 3


def test_constructed_set_contains_no_eval_question(tokenizer, retriever_client):
    from tasks.heldout import heldout_questions, question_key
    from trainer.sft.data import construct_trajectories

    evals = heldout_questions()
    nq_train = load_dataset("nq", split="train", limit=20)
    leaked = [Example(f"leak{i}", ex.question.lower() + "?", ex.answers, "nq") for i, ex in enumerate(load_dataset("nq", limit=5))]
    hotpot_train = load_dataset("hotpotqa", split="train")
    # the HotpotQA "train" rows drawn from dev that fall in the held-out split
    flagged = {question_key(ex.question) for ex in load_dataset("hotpotqa", split="heldout") if ex.meta.get("in_bundled_train")}
    assert flagged and all(k in evals for k in flagged)
    pairs, report = construct_trajectories({"nq": nq_train + leaked, "hotpotqa": hotpot_train}, tokenizer, retriever_client,
                                           ROLLOUT, max_model_len=1400)
    assert report.eval_overlap["nq"] >= 5  # the planted test questions (case and "?" differ)
    assert report.eval_overlap["hotpotqa"] >= len(flagged)  # the dev rows bundled as "train"
    built = report.total_constructed
    assert built == 20 + 5 + 400 - report.eval_overlap["nq"] - report.eval_overlap["hotpotqa"] - sum(report.duplicates.values())
    assert not any(question_key(t.question) in evals for t, _ in pairs)


def test_sft_presets_validate_and_the_starter_uses_the_cpu_rl_loop():
    from dataclasses import fields

    from emapg.config import load_config
    from trainer.config import TrainConfig
    from trainer.sft.config import SFTConfig

    presets = sorted((REPO / "configs").glob("sft_*.yaml"))
    assert {p.name for p in presets} >= {"sft_tiny_cpu.yaml", "sft_smollm2_starter.yaml"}
    for p in presets:
        load_config(SFTConfig, p)
    starter = load_config(SFTConfig, REPO / "configs/sft_smollm2_starter.yaml").rollout
    rl = load_config(TrainConfig, REPO / "configs/search_smollm2_cpu.yaml").rollout
    shaping = [f.name for f in fields(RolloutConfig) if f.name not in ("temperature", "top_p", "top_k", "seed", "n_samples")]
    assert {k: getattr(starter, k) for k in shaping} == {k: getattr(rl, k) for k in shaping}  # same tokens in SFT and RL


def test_parse_passages_round_trips_and_rejects_other_text():
    from agent.actions import format_passages

    hits = [{"contents": '"Paris"\nParis is the capital (and largest city) of France.'}, {"contents": '"Lyon"\nA city.'}]
    body = format_passages(hits)
    assert [h["contents"] for h in parse_passages(body)] == [h["contents"] for h in hits]
    with pytest.raises(ReplayError):
        parse_passages("some free text that is not in the passage format")


def _write_config(tmp_path: Path, **sections) -> Path:
    cfg = {"run": {"output_dir": str(tmp_path / "out"), "device": "cpu"}, "model": {"policy": "tiny-qwen2"},
           "rollout": {"max_turns": 2, "max_tokens_per_turn": 96, "max_obs_tokens": 400, "max_response_tokens": 800,
                       "max_prompt_tokens": 512}}
    for k, v in sections.items():
        cfg.setdefault(k, {}).update(v)
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _search_r1_rows(questions: list[dict]) -> list[dict]:
    from agent.actions import format_passages

    rows = []
    for i, q in enumerate(questions):
        passages = format_passages([{"contents": f'"Doc {i}"\n{q["question"]} The answer is {q["answers"][0]}.'}])
        rows.append({"question": q["question"], "response": f"<search> {q['question']} </search>\n\n<information>"
                     f"{passages}</information>\n\n<answer> {q['answers'][0]} </answer>"})
    return rows


def test_sft_reduces_heldout_loss_and_saves_loadable_policies(tmp_path, retriever_index):
    """Full fine-tuning and LoRA on a user file (Search-R1 text, passages replayed); held-out loss goes down."""
    from transformers import AutoModelForCausalLM

    from emapg.config import load_config
    from emapg.models import resolve_model
    from trainer.config import TrainConfig
    from trainer.sft.train import run_sft
    from trainer.sft.config import SFTConfig

    data = tmp_path / "trajs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _search_r1_rows(retriever_index.questions[:24])))
    for lora in (False, True):
        out = tmp_path / f"out-{lora}"
        path = _write_config(tmp_path, data={"source": "file", "path": str(data), "exclude_eval_questions": False,
                                             "heldout_fraction": 0.25},
                             run={"output_dir": str(out)}, optim={"lr": 3e-3 if lora else 1e-3, "epochs": 2, "batch_size": 4},
                             model={"lora": {"enabled": lora, "rank": 8}})
        result = run_sft(load_config(SFTConfig, path))
        assert result.heldout_loss_after < result.heldout_loss_before - 0.3, (lora, result.heldout_loss_before, result.heldout_loss_after)
        record = json.loads((out / "sft_record.json").read_text())
        assert record["data"]["kept"] == 24 and record["trajectories"] == {**record["trajectories"], "train": 18, "heldout": 6}
        assert resolve_model(str(out)) == str(out / "policy")  # a run folder resolves to its policy, as for RL runs
        AutoModelForCausalLM.from_pretrained(out / "policy")
        train_cfg = load_config(TrainConfig, REPO / "configs/search_tiny_cpu.yaml", [f"model.policy={out}"])
        assert resolve_model(train_cfg.model.policy) == str(out / "policy")
        assert (out / "adapter" / "adapter_config.json").is_file() == lora
        lines = (out / "trajectories.jsonl").read_text().splitlines()
        assert len(lines) == 24 and sum(json.loads(x)["heldout"] for x in lines) == 6
        # the contamination record (tasks.contamination): every trajectory's question, beside each saved policy
        from tasks.contamination import read_trained_questions

        trained = read_trained_questions(out / "policy")
        assert trained.count == 24 and all(trained.contains(q["question"]) for q in retriever_index.questions[:24])
        assert {s["source"]: s["questions"] for s in trained.sources} == {"trajs.jsonl": 18, "trajs.jsonl (held-out loss only)": 6}
        assert record["trained_questions"] == trained.summary()
        assert not lora or read_trained_questions(out / "adapter") == trained




@pytest.mark.parametrize("case, needle", [
    ("unknown_key", "optim.lrr"),
    ("no_path", "data.path"),
    ("bad_line", "trajs.jsonl:2"),
    ("bad_info", "trajs.jsonl:1"),
    ("bad_model", "model.policy"),
    ("no_retriever", "retriever.urls"),
])
def test_sft_bad_inputs_give_one_line_errors(tmp_path, capsys, case, needle):
    from app.cli import main

    data = tmp_path / "trajs.jsonl"
    overrides: list[str] = []
    sections: dict = {"data": {"source": "file", "path": str(data)}}
    data.write_text(json.dumps({"question": "q?", "response": "<answer> a </answer>"}) + "\n")
    if case == "unknown_key":
        overrides = ["optim.lrr=1"]
    elif case == "no_path":
        sections = {"data": {"source": "file"}}
    elif case == "bad_line":
        data.write_text(json.dumps({"question": "q?", "response": "<answer> a </answer>"}) + "\n{not json\n")
    elif case == "bad_info":
        data.write_text(json.dumps({"question": "q?", "response": "<search> q </search><information>free text"
                                    "</information><answer> a </answer>"}) + "\n")
    elif case == "bad_model":
        overrides = ["model.policy=no-such-model-xyz"]
    elif case == "no_retriever":
        sections = {"data": {"source": "construct", "datasets": ["nq"]}}
    rc = main(["sft", "--config", str(_write_config(tmp_path, **sections)), *overrides])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("emapg sft: error: ") and needle in lines[0], err
