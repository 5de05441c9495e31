"""``reward.qa_answer``: the training reward of a trajectory whose first answer was cut off inside ``<answer>`` and
whose final answer is right (the "New York City" trajectory of issue #54).

The trajectory is made by the rollout loop itself (:func:`agent.teacher_forcing.replay_trajectories`: the real loop,
its corrective message and its ``model_text``), then graded by the trainer's own :func:`trainer.sampled_batch.grade`.
"""

import pytest
from transformers import AutoTokenizer

from agent.rollout import RolloutConfig
from agent.teacher_forcing import ReplayRetriever, ScriptedTrajectory, replay_trajectories
from emapg.config import ConfigError, load_config
from emapg.paths import CONFIG_DIR
from tasks.datasets import Example
from tasks.qa import extract_answer, joined_answer
from trainer.config import TrainConfig
from trainer.data import SampledPrompt
from trainer.sampled_batch import grade

QUESTION = "which city has the most people in the united states?"
CUT_OFF = "<think>the largest city</think>\n<answer> New Yo"  # the turn's token cap fell inside <answer>
RIGHT = "<answer> New York City</answer>"


@pytest.fixture(scope="module")
def cut_off_trajectory(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = RolloutConfig(max_turns=2, max_tokens_per_turn=64, max_obs_tokens=256)
    (t,) = replay_trajectories(tok, [ScriptedTrajectory(QUESTION, [CUT_OFF, RIGHT])], ReplayRetriever([]), cfg,
                               max_model_len=2048)
    return t


def _grade(t, *overrides):
    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", list(overrides))
    (o,) = grade([t], [SampledPrompt(Example("1", QUESTION, ["New York City", "NYC"], "nq"), "g")], cfg)
    return o


def test_the_loop_ends_on_the_right_answer_after_a_cut_off_one(cut_off_trajectory):
    t = cut_off_trajectory
    assert (t.stop_reason, t.invalid_actions, t.final_answer) == ("answer", 1, "New York City")
    assert "New Yo" in t.model_text and t.model_text.rstrip().endswith(RIGHT)


def test_search_r1_joins_the_cut_off_answer_and_scores_zero(cut_off_trajectory):
    o = _grade(cut_off_trajectory)  # the default: the paper's pattern, as evaluation reads it
    assert o.reward == 0.0
    assert o.answer.startswith("New Yo") and o.answer.endswith("<answer> New York City") and joined_answer(o.answer)


def test_last_complete_reads_the_right_answer(cut_off_trajectory):
    o = _grade(cut_off_trajectory, "reward.qa_answer=last_complete")
    assert (o.reward, o.answer) == (1.0, "New York City") and not joined_answer(o.answer)


def test_the_rules_agree_without_a_cut_off_answer():
    for text in ["<answer>a</answer> then <answer>b</answer>", "<search>x</search>\n<answer> Paris </answer>", "no tag",
                 "<answer> open only"]:
        assert extract_answer(text, rule="last_complete") == extract_answer(text)
    assert extract_answer("<answer><answer>x</answer>") == "<answer>x"
    assert extract_answer("<answer><answer>x</answer>", rule="last_complete") == "x"
    with pytest.raises(ValueError, match="unknown answer rule 'first'"):
        extract_answer("<answer>x</answer>", rule="first")
    with pytest.raises(ConfigError, match="reward.qa_answer"):
        load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", ["reward.qa_answer=first"])
