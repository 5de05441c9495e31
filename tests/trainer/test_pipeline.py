"""Asynchronous rollouts (trainer/pipeline.py) against real ``emapg engine serve`` processes.

A tiny-qwen2 math run with ``rollout.max_staleness=1`` on real HTTP generation servers: the
staleness schedule and its metrics, each trajectory's weights version, the servers' weight
versions, resume from a checkpoint (deterministic: two resumes of one checkpoint agree), and a
replica that dies mid-run (its requests go to the other one, the run finishes).
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from agent.engines.launch import EngineServer
from emapg.config import ConfigError, load_config
from emapg.paths import CONFIG_DIR
from trainer.pipeline import batch_version, is_stale

STEPS = 4


def _cfg(out, model_dir, urls, *extra):
    from trainer.config import TrainConfig

    return load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [
        f"run.output_dir={out}", f"model.policy={model_dir}", f"run.total_steps={STEPS}", "run.save_every=2",
        "logging.progress=false", "logging.tensorboard=false", "data.prompts_per_step=2", "rollout.n_samples=2",
        "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2", "rollout.max_tokens_per_turn=6",
        "rollout.max_response_tokens=6", "optim.lr=1e-2", "rollout.engine=remote", f"rollout.engine_urls=[{','.join(urls)}]",
        "rollout.max_staleness=1", "algorithm.behavior_correction=tis", "run.seed=5", *extra,
    ])  # fmt: skip


def _compared(history):
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "perf/", "async/producer", "async/trainer_wait",
                                                             "async/trainer_stage", "async/queue_depth"))} for m in history]


def test_schedule():
    # s = 1 from step 0: batches 1 and 2 on v0, then batch k on v(k−2); resumed at 2: batches 3, 4 on v2
    assert [batch_version(k, 0, 1) for k in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [batch_version(k, 2, 1) for k in range(3, 6)] == [2, 2, 3]
    assert [batch_version(k, 0, 2) for k in range(1, 6)] == [0, 0, 0, 1, 2]
    assert not is_stale(3, 1, 1) and is_stale(3, 0, 1) and not is_stale(1, 0, 0)


def test_staleness_needs_remote_servers():
    from trainer.config import TrainConfig

    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", ["rollout.max_staleness=1"])


@pytest.fixture(scope="module")
def two_servers(tiny_model_dir):
    with EngineServer(tiny_model_dir, engine="hf", max_model_len=512) as a, EngineServer(tiny_model_dir, engine="hf", max_model_len=512) as b:
        yield a, b


def record_weights_versions(trainer) -> list[list[int | None]]:
    """Make ``trainer.learn`` record each trained batch's per-trajectory weights versions; returns the record."""
    seen: list[list[int | None]] = []
    original = trainer.learn

    def recording_learn(ro):
        seen.append([t.weights_version for t in ro.trajectories])
        return original(ro)

    trainer.learn = recording_learn
    return seen


def test_async_run_staleness_resume_and_versions(tmp_path, tiny_model_dir, two_servers):
    from trainer.loop import Trainer, train

    url = two_servers[0].url
    trainer = Trainer(_cfg(tmp_path / "run", tiny_model_dir, [url]))
    seen = record_weights_versions(trainer)
    try:
        trainer.setup()
        history = trainer.train()
    finally:
        trainer.close()
    assert [m["async/staleness"] for m in history] == [0.0, 1.0, 1.0, 1.0]
    assert [m["async/weights_version"] for m in history] == [0.0, 0.0, 1.0, 2.0]
    assert seen == [[0] * 4, [0] * 4, [1] * 4, [2] * 4]  # every trajectory records its weights
    assert history[-1]["async/staleness_count_0"] == 1.0 and history[-1]["async/staleness_count_1"] == 3.0
    assert history[-1]["async/dropped_batches"] == 0.0
    for m in history:
        assert m["mismatch/abs_logp_diff_max"] >= m["mismatch/abs_logp_diff_mean"] >= 0.0
        assert 0.0 <= m["behavior/truncated_frac"] <= 1.0
    # staleness 1 with lr 1e-2: the engine's weights really are older than the trainer's π_old
    assert history[1]["mismatch/abs_logp_diff_mean"] > history[0]["mismatch/abs_logp_diff_mean"]
    # the servers got v0 (batches 1, 2), v1, v2: three syncs; the last weights pushed are step 2's
    assert httpx.get(url + "/health").json()["weights_tag"] == "step-2"

    # resume at step 2 twice: the queue is regenerated from the checkpoint's weights, the same way both times
    resumed = []
    for name in ("r1", "r2"):
        import shutil

        shutil.copytree(tmp_path / "run" / "step_2", tmp_path / name / "step_2")
        resumed.append(train(_cfg(tmp_path / name, tiny_model_dir, [url]), resume=""))
    assert [m["async/staleness"] for m in resumed[0]] == [0.0, 1.0]
    assert [m["async/weights_version"] for m in resumed[0]] == [2.0, 2.0]
    assert _compared(resumed[0]) == _compared(resumed[1])


def test_staged_weight_upload_changes_no_batch(tmp_path, tiny_model_dir, two_servers):
    """rollout.stage_weights: the trainer uploads each version while the batch generates and the producer only commits
    it; the run is the same as with the producer uploading (every metric but timings), and the upload moved."""
    from trainer.loop import train

    url = two_servers[0].url
    staged = train(_cfg(tmp_path / "staged", tiny_model_dir, [url]))
    plain = train(_cfg(tmp_path / "plain", tiny_model_dir, [url], "rollout.stage_weights=false"))
    assert _compared(staged) == _compared(plain)
    assert sum(m["async/trainer_stage_s"] for m in staged) > 0.0  # versions 1 and 2 were staged by the trainer
    assert all(m["async/trainer_stage_s"] == 0.0 for m in plain)
    assert httpx.get(url + "/health").json()["weights_tag"] == "step-2"


def test_sigint_with_generations_in_flight(tmp_path, tiny_model_dir, two_servers):
    """A real SIGINT after step 1 while the producer generates batches 2-3: step 1 is checkpointed whole,
    nothing after it is, and the checkpoint resumes."""
    from trainer.checkpoint import load_checkpoint
    from trainer.loop import Trainer, train

    cfg = _cfg(tmp_path / "run", tiny_model_dir, [two_servers[0].url], "run.save_every=0")
    trainer = Trainer(cfg)
    trainer.step_hooks.append(lambda tr, m: os.kill(os.getpid(), signal.SIGINT) if tr.step == 1 else None)
    try:
        trainer.setup()
        history = trainer.train()
    finally:
        trainer.close()
    assert len(history) == 1 and sorted(p.name for p in (tmp_path / "run").glob("step_*")) == ["step_1"]
    assert load_checkpoint(tmp_path / "run" / "step_1").step == 1
    rest = train(_cfg(tmp_path / "run", tiny_model_dir, [two_servers[0].url], "run.save_every=0"), resume="")
    assert len(rest) == STEPS - 1 and [m["async/weights_version"] for m in rest][:2] == [1.0, 1.0]


def test_a_replica_dying_mid_run(tmp_path, tiny_model_dir, two_servers):
    """Runs after the test above (it kills the module's second server)."""
    from trainer.loop import Trainer

    a, b = two_servers
    trainer = Trainer(_cfg(tmp_path / "run", tiny_model_dir, [a.url, b.url], "run.total_steps=3"))

    def kill_b(tr, metrics):
        if tr.step == 1:
            os.killpg(b.proc.pid, signal.SIGKILL)
            b.proc.wait()

    trainer.step_hooks.append(kill_b)
    try:
        trainer.setup()
        history = trainer.train()
    finally:
        trainer.close()
    assert len(history) == 3 and trainer.engine.urls == [a.url]
    assert [m["async/staleness"] for m in history] == [0.0, 1.0, 1.0]
    assert (tmp_path / "run" / "step_3" / "policy").is_dir()


@pytest.mark.parametrize("level", ["geometric", "sequence", "token"])
def test_async_run_masks_stale_sequences_and_counts_them(tmp_path, tiny_model_dir, two_servers, level):
    """The asynchronous pipeline with masked importance sampling at each level (a narrow band: staleness 1 with lr 1e-2
    moves the engine's log-probs out of it): the metrics count the tokens and the sequences dropped; a sequence-level
    mask drops whole sequences only."""
    from trainer.loop import train

    history = train(_cfg(tmp_path / "run", tiny_model_dir, [two_servers[0].url], "algorithm.behavior_correction=mis",
                         f"algorithm.behavior_level={level}", "algorithm.behavior_band=[0.999,1.001]", "run.save_every=0"))
    for m in history:
        for key in ("behavior/masked_frac", "behavior/masked_seq_frac", "behavior/partly_masked_seq_frac"):
            assert 0.0 <= m[key] <= 1.0, key
        assert m["behavior/masked_seq_frac"] <= m["behavior/partly_masked_seq_frac"]
        if level != "token":  # the whole sequence or nothing
            assert m["behavior/masked_seq_frac"] == m["behavior/partly_masked_seq_frac"]
    assert max(m["behavior/partly_masked_seq_frac"] for m in history[1:]) > 0  # stale batches leave the band
