"""``run.flush_denormal``: on while training, and put back when the Trainer closes (process state must not leak into
code that runs after training in the same thread: numpy, hypothesis' float strategies)."""

from __future__ import annotations

import torch

from trainer.config import TrainConfig
from trainer.policy import flush_denormal_on, set_numerics


def test_flush_denormal_is_put_back():
    torch.set_flush_denormal(False)
    assert not flush_denormal_on()
    restore = set_numerics(TrainConfig(), torch.device("cpu"))
    assert flush_denormal_on()  # a subnormal times one is zero while training
    restore()
    assert not flush_denormal_on() and float(torch.tensor([1e-39]) * 1.0) > 0.0


def test_a_flush_that_was_on_stays_on_and_off_means_untouched():
    torch.set_flush_denormal(True)
    try:
        set_numerics(TrainConfig(), torch.device("cpu"))()
        assert flush_denormal_on()
    finally:
        torch.set_flush_denormal(False)
    cfg = TrainConfig()
    cfg.run.flush_denormal = False
    set_numerics(cfg, torch.device("cpu"))()
    assert not flush_denormal_on()
