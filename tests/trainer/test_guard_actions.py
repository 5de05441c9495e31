"""What the guard's actions do to a real trainer (tiny-qwen2, no engine): lower_lr, reset_to_anchor,
rollback and its fallback, stop, the recovery budget; and the record each trip leaves."""

from __future__ import annotations

import pytest
import torch

from emapg.config import ConfigError, load_config
from emapg.paths import CONFIG_DIR
from tests.trainer.test_guard import HEALTHY
from trainer.config import TrainConfig
from trainer.loop import Trainer, TrainingError
from trainer.recovery import GuardHook, read_guard_events


def make_trainer(tmp_path, model_dir, *overrides: str) -> Trainer:
    cfg = load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [
        f"run.output_dir={tmp_path / 'run'}", f"model.policy={model_dir}", "logging.progress=false",
        "logging.tensorboard=false", "guard.enabled=true", *overrides])
    return Trainer(cfg).setup(with_engine=False)


def healthy_steps(trainer: Trainer, n: int = 3) -> None:
    for _ in range(n):
        trainer.step += 1
        trainer.guard(trainer, HEALTHY)


def trip(trainer: Trainer, **metrics: float) -> None:
    trainer.step += 1
    trainer.guard(trainer, {**HEALTHY, **metrics})


@pytest.fixture
def trainer_factory(tmp_path, tiny_model_dir):
    made: list[Trainer] = []

    def factory(*overrides: str) -> Trainer:
        made.append(make_trainer(tmp_path, tiny_model_dir, *overrides))
        return made[-1]

    yield factory
    for t in made:
        t.close()


def test_guard_hook_runs_first(trainer_factory):
    trainer = trainer_factory()
    assert isinstance(trainer.step_hooks[0], GuardHook) and trainer.step_hooks[0] is trainer.guard


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_lower_lr_survives_the_schedule(trainer_factory):
    trainer = trainer_factory("guard.reward_drop.action=lower_lr", "guard.lr_factor=0.25")
    lr = trainer.policy.optimizer.param_groups[0]["lr"]
    healthy_steps(trainer)
    trip(trainer, **{"reward/mean": 0.0})
    trainer.policy.scheduler.step()
    assert trainer.policy.optimizer.param_groups[0]["lr"] == pytest.approx(lr * 0.25)
    (event,) = read_guard_events(trainer.run_dir)
    assert event["detector"] == "reward_drop" and event["step"] == 4 and event["detail"].startswith("lower_lr: learning rate now")


def test_reset_to_anchor_copies_the_anchor_and_clears_adam(trainer_factory):
    trainer = trainer_factory("guard.kl_spike.action=reset_to_anchor")
    anchor = {k: v.clone() for k, v in trainer.anchor.tensors.items()}
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1.0)  # the policy drifted away from its anchor
    trainer.policy.optimizer.state[next(trainer.model.parameters())]["step"] = torch.tensor(5.0)
    healthy_steps(trainer)
    trip(trainer, **{"kl/mean": 3.0})
    params = dict(trainer.model.named_parameters())
    for name, value in anchor.items():
        if name in params:
            assert torch.equal(params[name].detach(), value), name
    assert not trainer.policy.optimizer.state


def test_rollback_without_a_passing_checkpoint_falls_back_to_the_anchor(trainer_factory):
    trainer = trainer_factory()  # nonfinite: rollback by default
    healthy_steps(trainer)
    trip(trainer, **{"loss/pg": float("nan")})
    (event,) = read_guard_events(trainer.run_dir)
    assert event["detector"] == "nonfinite" and event["metric"] == "loss/pg" and event["value"] == "nan"
    assert event["detail"] == "rollback: no checkpoint passed the guard yet; policy reset to the EMA anchor, optimizer moments cleared"


def test_rollback_restores_weights_but_not_the_data_position(trainer_factory):
    trainer = trainer_factory("guard.grad_norm_spike.action=rollback")
    healthy_steps(trainer, 2)
    saved = trainer.save()  # step 2, passed
    good = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    healthy_steps(trainer, 1)  # step 3 passed: the weights of step 2 were tried
    trainer.sample_prompts()  # the loader moves on
    position = trainer.sampler.state_dict()
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.mul_(3.0)
    trip(trainer, **{"actor/grad_norm": 50.0})
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), good[name]), name
    assert trainer.sampler.state_dict() == position and trainer.step == 4
    (event,) = read_guard_events(trainer.run_dir)
    assert event["detail"] == f"rollback: restored {saved.name} (step 2); batches of steps 3-4 skipped"


def test_a_checkpoint_saved_after_a_rollback_is_the_next_rollback_target(trainer_factory):
    """After a rollback the weights are the restored passing ones: the checkpoint saved from them passes, so a later
    trip rolls back to it even when the checkpoint first restored is gone (pruned by run.keep_last)."""
    import shutil

    from trainer.checkpoint import load_trainer_state

    trainer = trainer_factory("guard.grad_norm_spike.action=rollback")
    healthy_steps(trainer, 2)
    first = trainer.save()  # step 2
    healthy_steps(trainer, 1)
    trip(trainer, **{"actor/grad_norm": 50.0})  # step 4: back to step 2's weights
    resaved = trainer.save()  # step 4, holding step 2's weights
    assert load_trainer_state(resaved)["guard"]["passed"] is True
    shutil.rmtree(first)  # what keep_last would do
    good = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    healthy_steps(trainer, 1)  # step 5 passes: step 4's checkpoint is trusted
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.mul_(3.0)
    trip(trainer, **{"actor/grad_norm": 50.0})  # step 6
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), good[name]), name
    assert read_guard_events(trainer.run_dir)[-1]["detail"] == f"rollback: restored {resaved.name} (step 4); batches of steps 5-6 skipped"


def test_rollback_with_no_target_and_no_anchor_stops_the_run(tmp_path, tiny_model_dir):
    trainer = make_trainer(tmp_path, tiny_model_dir, "algorithm.kl.enabled=false", "guard.grad_norm_spike.action=rollback")
    try:
        healthy_steps(trainer)
        with pytest.raises(TrainingError, match=r"stability guard stopped the run at step 4: step 4: grad_norm_spike"):
            trip(trainer, **{"actor/grad_norm": 50.0})
        (event,) = read_guard_events(trainer.run_dir)  # recorded like any stop, with why
        assert event["detail"].startswith("stop: rollback impossible: no checkpoint in ") and "run.keep_last" in event["detail"]
    finally:
        trainer.close()


def test_stop_and_the_recovery_budget(trainer_factory):
    trainer = trainer_factory("guard.entropy_collapse.action=stop")
    healthy_steps(trainer)
    with pytest.raises(TrainingError, match=r"stability guard stopped the run at step 4: step 4: entropy_collapse"):
        trip(trainer, **{"actor/entropy": 0.01})
    budget = trainer_factory("guard.reward_drop.action=lower_lr", "guard.max_recoveries=1")
    healthy_steps(budget)
    trip(budget, **{"reward/mean": 0.0})
    with pytest.raises(TrainingError, match=r"1 recoveries already|stability guard stopped") as err:
        trip(budget, **{"reward/mean": 0.0})
    assert "stability guard: 2 trip(s) over 2 step(s)" in str(err.value)


def test_reset_to_anchor_needs_an_anchor(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="reset_to_anchor needs the EMA anchor"):
        make_trainer(tmp_path, tiny_model_dir, "algorithm.kl.enabled=false", "guard.kl_spike.action=reset_to_anchor")
