"""The collapse definition (trainer.collapse) on synthetic reward and gibberish series."""

from __future__ import annotations

import pytest

from trainer.collapse import CollapseDefinition, collapse_step


@pytest.mark.parametrize("rewards, expected", [
    ([0.6, 0.6, 0.5, 0.4, 0.31, 0.29, 0.2, 0.1], 6),  # start 0.6: below 0.3 from step 6 for 3 steps
    ([0.6, 0.6, 0.2, 0.2, 0.5, 0.2, 0.2, 0.2], 6),  # the first dip lasts 2 steps: not a collapse; the second is
    ([0.6, 0.6, 0.2, 0.2], None),  # two steps below, then the run ends
    ([0.6, 0.6, 0.3, 0.3, 0.3], None),  # exactly half is not below half
    ([0.6, 0.2, 0.2, 0.2, 0.2], None),  # start = mean(0.6, 0.2) = 0.4: 0.2 is not below 0.2
    ([0.6, 0.2, 0.19, 0.1, 0.0], 3),  # ... 0.19 is
    ([0.0, 0.0, 0.0, 0.0, 0.0], None),  # a run that starts at 0 cannot fall
    ([0.5], None),  # shorter than the starting window
])
def test_reward_collapse(rewards, expected):
    assert collapse_step(rewards) == expected


def test_gibberish_collapse_and_the_earlier_of_the_two():
    rewards = [0.6, 0.6, 0.6, 0.6, 0.1, 0.1, 0.1]  # reward collapse at 5
    assert collapse_step(rewards, [0.0, 0.1, 0.2, 0.4, 0.6, 0.9, 0.9]) == 5  # non-text above 0.5 first at step 5 too
    assert collapse_step(rewards, [0.0, 0.0, 0.51, 0.0, 0.0, 0.0, 0.0]) == 3  # gibberish first
    assert collapse_step([0.6] * 7, [0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0]) is None  # exactly the level is not above


def test_a_stricter_definition():
    d = CollapseDefinition(reward_fraction=0.8, consecutive=2, start_steps=1, gibberish=1.0)
    assert collapse_step([1.0, 0.9, 0.79, 0.7], [1.0] * 4, d) == 3  # non-text can never exceed 1
    assert "0.8" in d.describe() and "2 consecutive" in d.describe()
    with pytest.raises(ValueError):
        CollapseDefinition(reward_fraction=1.5)
