"""The shipped starter search policy (``data/starter/``, built by scripts/build_starter.py) loads and answers in the format."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from agent.rollout import RolloutConfig, run_rollouts
from emapg.config import load_config
from emapg.models import STARTER, STARTER_ADAPTER, resolve_model
from tasks.qa import extract_answer
from trainer.config import TrainConfig

REPO = Path(__file__).resolve().parent.parent


def test_shipped_starter_is_a_small_peft_adapter_with_its_record():
    adapter = STARTER_ADAPTER / "adapter_model.safetensors"
    assert adapter.is_file() and adapter.stat().st_size <= 20 * 2**20
    config = json.loads((STARTER_ADAPTER / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == "smollm2-135m-instruct"
    record = json.loads((STARTER_ADAPTER / "record.json").read_text())
    assert record["data"]["total_kept"] >= record["trajectories"]["train"] + record["trajectories"]["heldout"]
    assert record["heldout_loss_after"] < record["heldout_loss_before"]
    # built from the answerable training pool: what it used is listed, and none of it is held out
    from tasks.contamination import read_trained_questions
    from tasks.datasets import QA_DATASETS, heldout_ids, load_dataset
    from tasks.heldout import heldout_questions, question_key

    assert record["data"]["questions"] == {"qa_pool": 400} and record["data"]["eval_overlap"] == {"qa_pool": 0}
    used = set(record["question_ids"])
    assert len(used) == record["trajectories"]["train"] + record["trajectories"]["heldout"]
    assert not used & {i for name in QA_DATASETS for i in heldout_ids(name)}
    pool = {ex.id: ex for ex in load_dataset("qa_pool", split="train")}
    assert used <= set(pool) and not {question_key(pool[i].question) for i in used} & set(heldout_questions())
    trained = read_trained_questions(STARTER_ADAPTER)
    assert trained.count == len(used) and record["trained_questions"]["digest"] == trained.digest
    # the build's greedy format check ran on held-out questions (the seeded sample inside data/qa/heldout.json)
    assert record["format_check"]["format_rate"] >= 0.9 and record["format_check"]["questions"] == 21


def test_starter_answers_in_the_answer_format(retriever_client, retriever_index):
    """Greedy rollouts of the starter (transformers engine) with the CPU RL preset's loop, live retriever."""
    from agent.engines.hf_engine import HFEngine

    path = resolve_model(STARTER)
    preset = load_config(TrainConfig, REPO / "configs/search_smollm2_cpu.yaml").rollout
    cfg = RolloutConfig(**{f.name: getattr(preset, f.name) for f in fields(RolloutConfig)})
    cfg.temperature = 0.0
    cfg.n_samples = 1  # greedy: a group's samples would be copies of one trajectory
    engine = HFEngine(path, max_model_len=cfg.max_prompt_tokens + cfg.max_response_tokens)
    try:
        questions = [q["question"] for q in retriever_index.questions[:4]]  # bundled NQ test questions
        trajs = run_rollouts(engine, questions, retriever_client, cfg)
    finally:
        engine.close()
    answered = [t for t in trajs if extract_answer(t.model_text) is not None]
    assert len(trajs) == 4 and len(answered) >= 3, [t.model_text for t in trajs]  # 3 of the 4 questions at least
    assert all(t.num_searches >= 1 for t in answered)  # it searched before answering


def test_second_starter_ships_beside_the_first_with_its_searches_by_type():
    """The multi-search starter (issue 53): its record says how many searches its demonstrations made, by question type,
    and none of its questions is held out (the held-out split, the search slice)."""
    from emapg.models import STARTER_ADAPTERS, STARTER_V2
    from tasks.contamination import read_trained_questions
    from tasks.heldout import heldout_questions, question_key

    folder = STARTER_ADAPTERS[STARTER_V2]
    assert (STARTER_ADAPTER / "adapter_model.safetensors").is_file()  # the first one is kept for comparisons
    assert (folder / "adapter_model.safetensors").stat().st_size <= 20 * 2**20
    record = json.loads((folder / "record.json").read_text())
    assert record["config"]["data"]["source"] == "file" and record["config"]["rollout"]["max_turns"] == 3
    assert record["heldout_loss_after"] < record["heldout_loss_before"]
    by_type = record["searches_per_question_by_type"]
    assert sum(t["trajectories"] for t in by_type.values()) == record["trajectories"]["train"] + record["trajectories"]["heldout"]
    assert any(t["mean_searches"] > 1.5 for t in by_type.values()) and any(t["mean_searches"] == 1.0 for t in by_type.values())
    assert 1.2 <= record["mean_searches"] <= 1.8
    demos = {json.loads(line)["id"]: json.loads(line) for line in (REPO / "data/qa/multihop/demonstrations.jsonl").read_text().splitlines()}
    assert set(record["question_ids"]) <= set(demos)
    assert not {question_key(demos[i]["question"]) for i in record["question_ids"]} & set(heldout_questions())
    assert read_trained_questions(folder).count == len(record["question_ids"])


def test_third_starter_ships_beside_the_others_with_its_format_check():
    """The need-conditioned starter (issue 53): think steps before each decision; its record holds the searches of its
    demonstrations by question type and the greedy format check; none of its questions is held out."""
    from emapg.models import STARTER_ADAPTERS, STARTER_V2, STARTER_V3
    from tasks.contamination import read_trained_questions
    from tasks.heldout import heldout_questions, question_key

    folder = STARTER_ADAPTERS[STARTER_V3]
    assert (STARTER_ADAPTERS[STARTER_V2] / "adapter_model.safetensors").is_file()  # the second one is kept for comparisons
    assert (folder / "adapter_model.safetensors").stat().st_size <= 20 * 2**20
    record = json.loads((folder / "record.json").read_text())
    assert record["config"]["data"]["path"].endswith("demonstrations_v3.jsonl")
    assert record["config"]["rollout"]["max_turns"] == 3 and record["config"]["rollout"]["max_tokens_per_turn"] == 64
    assert record["heldout_loss_after"] < record["heldout_loss_before"]
    by_type = record["searches_per_question_by_type"]
    assert sum(t["trajectories"] for t in by_type.values()) == record["trajectories"]["train"] + record["trajectories"]["heldout"]
    assert 1.0 < record["mean_searches"] < 1.5
    check = record["format_check"]
    assert check["questions"] >= 7 and 0.0 <= check["format_rate"] <= 1.0
    demos = {json.loads(line)["id"]: json.loads(line)
             for line in (REPO / "data/qa/multihop/demonstrations_v3.jsonl").read_text().splitlines()}
    assert set(record["question_ids"]) <= set(demos)
    assert not {question_key(demos[i]["question"]) for i in record["question_ids"]} & set(heldout_questions())
    assert read_trained_questions(folder).count == len(record["question_ids"])
