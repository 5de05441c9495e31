"""The learning runs' training questions: bundled NQ + HotpotQA train, none of any bundled eval set."""

from provision.training_mix import write_training_mix
from tasks.datasets import load_dataset
from tasks.heldout import evaluation_questions, question_key
from trainer.data import load_prompts


def test_training_mix_holds_out_every_evaluation_question(tmp_path):
    mix = write_training_mix(tmp_path / "train.jsonl")
    # the 300 HotpotQA "train" rows drawn from HotpotQA dev (the bundled eval set) are dropped
    assert mix.dropped["hotpotqa"] == 300 and mix.kept["hotpotqa"] == 100
    assert mix.kept["nq"] > 4900
    examples = load_prompts(str(mix.path), split="train", limit=None, seed=0)
    assert len(examples) == mix.size and {ex.data_source for ex in examples} == {"nq", "hotpotqa"}
    held_out = evaluation_questions()
    assert not any(question_key(ex.question) in held_out for ex in examples)
    assert held_out[question_key(load_dataset("bamboogle")[0].question)] == "bamboogle"
