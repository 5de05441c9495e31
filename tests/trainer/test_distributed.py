"""Distributed logic on CPU: 2 gloo processes with FSDP2 (``fully_shard``) against one process.

The same global batch of trajectories (whole GRPO groups per rank) is trained one PPO
update by (a) two FSDP2 ranks, each holding half the batch and half of every parameter,
gradient and Adam state, with the EMA anchor on local shards, and (b) one plain process
with the whole batch. The loss normalisers are summed over ranks and FSDP's gradient
averaging is undone, so the updated policy and anchor must agree to float tolerance.
The two-rank run then trains a real step end to end (rollouts per rank, weight sync,
checkpoint with per-rank RNG files) and resumes from it.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from emapg.config import load_config
from emapg.paths import CONFIG_DIR
from tests.fixtures.spawn import free_port, rank_env

pytestmark = pytest.mark.slow

N_GROUPS, GROUP = 4, 2


def _cfg(out, model_dir, *extra):
    from trainer.config import TrainConfig

    return load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [
        f"run.output_dir={out}", f"model.policy={model_dir}", "logging.progress=false", "logging.tensorboard=false",
        f"data.prompts_per_step={N_GROUPS}", f"rollout.n_samples={GROUP}", f"algorithm.mini_batch_size={N_GROUPS * GROUP}",
        "algorithm.micro_batch_size=2", "rollout.max_tokens_per_turn=8", "rollout.max_response_tokens=8",
        "optim.lr=1e-2", "algorithm.kl.type=k3", "algorithm.kl.coef=0.1", "algorithm.ema.decay=0.5", "run.save_every=1",
        *extra,
    ])


def _global_batch(grouped: bool = False):
    """Deterministic trajectories: random prompts/responses, a loss mask with an observation hole.
    ``grouped``: the rows of groups 0-2 share their group's prompt (group 3's two rows do not)."""
    g = torch.Generator().manual_seed(0)
    prompts, responses, masks, rewards = [], [], [], []
    for i in range(N_GROUPS * GROUP):
        p = int(torch.randint(3, 9, (1,), generator=g))
        r = int(torch.randint(4, 8, (1,), generator=g))
        prompts.append(torch.randint(5, 2000, (p,), generator=g).tolist())
        if grouped and i % GROUP and i // GROUP < N_GROUPS - 1:
            prompts[-1] = prompts[-2]
        responses.append(torch.randint(5, 2000, (r,), generator=g).tolist())
        masks.append([1, 1, 0, 0] + [1] * (r - 4))
        rewards.append(float(i % 3 == 0))
    groups = [f"g{i // GROUP}" for i in range(N_GROUPS * GROUP)]
    return prompts, responses, masks, torch.tensor(rewards), groups


def _one_update(trainer, rows: slice, grouped: bool = False):
    from trainer.batch import build_token_batch
    from trainer.algo.grpo import broadcast_advantages, grpo_advantages

    prompts, responses, masks, rewards, groups = _global_batch(grouped)
    batch = build_token_batch(prompts[rows], responses[rows], masks[rows], pad_id=0)
    trainer.compute_stored_stats(batch)
    adv = grpo_advantages(rewards[rows], groups[rows])
    batch.stored["advantages"] = broadcast_advantages(adv, batch.loss_mask)
    metrics = trainer.update(batch)
    trainer.anchor.update()
    return metrics


def _worker(rank: int, world: int, port: int, out: str, model_dir: str) -> None:
    rank_env(rank, world, port)
    from trainer import distributed as D
    from trainer.loop import Trainer

    trainer = Trainer(_cfg(f"{out}/run", model_dir, "run.total_steps=1")).setup()
    try:
        assert trainer.fsdp and D.is_sharded(trainer.model)
        half = D.shard_slice(N_GROUPS, rank, world)
        rows = slice(half.start * GROUP, half.stop * GROUP)
        metrics = _one_update(trainer, rows)
        policy = trainer.policy.export_weights(all_ranks=True)
        anchor = trainer.anchor.full_state_dict()
        if rank == 0:
            torch.save({"policy": policy, "anchor": anchor, "metrics": metrics}, f"{out}/fsdp.pt")
        # Then a real step end to end on 2 ranks (rollouts per rank, weight sync, checkpoint) ...
        trainer.train()
    finally:
        trainer.close()
    resume_one_more_step(out, model_dir)
    D.destroy()


def resume_one_more_step(out: str, model_dir: str, *extra: str) -> None:
    """Resume the run in ``out/run`` (one step trained) from its checkpoint and train one more step."""
    from trainer.loop import Trainer

    trainer = Trainer(_cfg(f"{out}/run", model_dir, "run.total_steps=2", *extra), resume=f"{out}/run").setup()
    try:
        assert trainer.step == 1
        trainer.train()
    finally:
        trainer.close()


def test_fsdp2_two_ranks_match_single_process(tmp_path, tiny_model_dir):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path), str(tiny_model_dir)), nprocs=2, join=True)

    from trainer.loop import Trainer

    # One intra-op thread, as in the ranks: the kernels then reduce in the same order on both sides
    # (with 2 threads, Adam's normalisation blows float-order noise in near-zero gradients up past 1e-5).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trainer = Trainer(_cfg(tmp_path / "single", tiny_model_dir, "run.total_steps=1")).setup()
    try:
        assert not trainer.fsdp
        single_metrics = _one_update(trainer, slice(0, N_GROUPS * GROUP))
        policy = {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}
        anchor = trainer.anchor.full_state_dict()
    finally:
        trainer.close()
        torch.set_num_threads(threads)
    fsdp = torch.load(tmp_path / "fsdp.pt", weights_only=True)
    moved = 0.0
    for k, v in fsdp["policy"].items():
        torch.testing.assert_close(v, policy[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
        if k in anchor:  # tied lm_head.weight is tracked once, as the embedding
            moved = max(moved, float((v - anchor[k]).abs().max()))
    for k, v in fsdp["anchor"].items():
        torch.testing.assert_close(v, anchor[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    assert moved > 1e-4  # the update was real: the policy and the half-way anchor differ
    assert fsdp["metrics"]["actor/updates"] == single_metrics["actor/updates"] == 1
    assert abs(fsdp["metrics"]["kl/mean"] - single_metrics["kl/mean"]) < 1e-6

    run = tmp_path / "run"
    assert (run / "step_1" / "rng_rank0.pt").is_file() and (run / "step_1" / "rng_rank1.pt").is_file()
    assert (run / "step_2" / "policy" / "model.safetensors").is_file()
    assert (run / "latest").read_text().strip() == "step_2"


def _exact_worker(rank: int, world: int, port: int, out: str, model_dir: str, extra: tuple[str, ...] = (),
                  grouped: bool = False) -> None:
    rank_env(rank, world, port)
    import trainer.model_forward as L
    from trainer import distributed as D
    from trainer.loop import Trainer

    shared: list[bool] = []  # per shared-prompt attempt: did it share (False: the ranks agreed on one pass)
    original = L._shared_prompt_hidden
    L._shared_prompt_hidden = lambda *a: shared.append(original(*a) is not None) or original(*a)
    trainer = Trainer(_cfg(f"{out}/run", model_dir, *EXACT, *extra)).setup(with_engine=False)
    try:
        assert trainer.fsdp and D.is_sharded(trainer.model)
        half = D.shard_slice(N_GROUPS, rank, world)
        metrics = _exact_update(trainer, slice(half.start * GROUP, half.stop * GROUP), grouped)
        policy = trainer.policy.export_weights(all_ranks=True)
        if rank == 0:
            torch.save({"policy": policy, "metrics": metrics, "shared": shared}, f"{out}/fsdp_exact.pt")
    finally:
        trainer.close()
    D.destroy()


# AdamW with lr = eps = 1 steps ≈ 0.1·gradient: float-order noise in near-zero gradients stays noise-sized.
EXACT = ("run.total_steps=1", "algorithm.kl.type=exact_reverse", "optim.lr=1.0", "optim.eps=1.0", "optim.weight_decay=0")


def _exact_update(trainer, rows: slice, grouped: bool = False):
    """One update against an anchor shrunk by 10%, so the exact KL and its gradient are not 0."""
    import torch as T

    with T.no_grad():
        for t in trainer.anchor.tensors.values():  # the same change to every shard as to the full tensors
            t.mul_(0.9)
    return _one_update(trainer, rows, grouped)


def _single_exact_update(tmp_path, model_dir, *extra: str, grouped: bool = False) -> tuple[dict, dict]:
    """:func:`_exact_update` of the whole batch in one plain process (fixed rows): its metrics and weights."""
    from trainer.loop import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trainer = Trainer(_cfg(tmp_path / "single", model_dir, *EXACT, *extra)).setup(with_engine=False)
    try:
        single = _exact_update(trainer, slice(0, N_GROUPS * GROUP), grouped)
        return single, {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}
    finally:
        trainer.close()
        torch.set_num_threads(threads)


def test_fsdp2_exact_kl_from_hidden_states_matches_single_process(tmp_path, tiny_model_dir):
    """The exact KL under FSDP2: the anchor's hidden states from its swapped-in shards, its lm_head
    all-gathered once, the KL computed inside the sharded policy forward; equal to one process."""
    mp.spawn(_exact_worker, args=(2, free_port(), str(tmp_path), str(tiny_model_dir)), nprocs=2, join=True)

    single, policy = _single_exact_update(tmp_path, tiny_model_dir)
    from safetensors.torch import load_file

    fsdp = torch.load(tmp_path / "fsdp_exact.pt", weights_only=True)
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    key = "model.layers.0.mlp.up_proj.weight"
    assert (policy[key] - initial[key]).abs().max() > 1e-4  # the update is real
    assert fsdp["metrics"]["actor/updates"] == single["actor/updates"] == 1
    assert single["kl/mean"] > 1e-3 and abs(fsdp["metrics"]["kl/mean"] - single["kl/mean"]) < 1e-6
    for k, v in fsdp["policy"].items():
        torch.testing.assert_close(v, policy[k], atol=1e-6, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def test_fsdp2_token_budget_micro_batches_match_single_process(tmp_path, tiny_model_dir):
    """Token-budget micro-batches under FSDP2: the ranks' own plans have 3 and 2 micro-batches, so rank 1
    splits one (every sharded forward is collective); the update equals one process's with fixed rows."""
    from trainer.batch import build_token_batch
    from trainer.batch import plan_micro_batches

    prompts, responses, masks, _, _ = _global_batch()
    halves = [build_token_batch(prompts[s], responses[s], masks[s], pad_id=0) for s in (slice(0, 4), slice(4, 8))]
    assert [len(plan_micro_batches(b, range(4), 2, 28)) for b in halves] == [3, 2]  # the case this test is about
    mp.spawn(_exact_worker, args=(2, free_port(), str(tmp_path), str(tiny_model_dir), ("algorithm.micro_batch_tokens=28",)),
             nprocs=2, join=True)

    single, policy = _single_exact_update(tmp_path, tiny_model_dir)
    fsdp = torch.load(tmp_path / "fsdp_exact.pt", weights_only=True)
    assert fsdp["metrics"]["actor/updates"] == single["actor/updates"] == 1
    assert fsdp["metrics"]["perf/padding_frac"] < single["perf/padding_frac"]
    for k, v in fsdp["policy"].items():
        torch.testing.assert_close(v, policy[k], atol=1e-6, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def test_fsdp2_shared_prompt_training_pass_matches_one_pass_single_process(tmp_path, tiny_model_dir):
    """Prompt sharing in the training pass under FSDP2 (each decoder unit runs twice in one forward, its
    gradient reduce-scattered once per use): rank 0's micro-batches are both one shared prompt, rank 1's
    first is and its second has none, so for that micro-batch the ranks agree to run the one-pass forward.
    The update (exact KL, the anchor's hidden states shared alike) equals one plain process's without sharing."""
    mp.spawn(_exact_worker, args=(2, free_port(), str(tmp_path), str(tiny_model_dir), (), True), nprocs=2, join=True)

    single, policy = _single_exact_update(tmp_path, tiny_model_dir, "model.share_prompt=false", grouped=True)
    fsdp = torch.load(tmp_path / "fsdp_exact.pt", weights_only=True)
    # stored anchor pass, then the training pass: micro-batch 1 shared, micro-batch 2 agreed on one pass
    assert fsdp["shared"] == [True, False, True, False], fsdp["shared"]
    assert fsdp["metrics"]["actor/updates"] == single["actor/updates"] == 1
    assert single["kl/mean"] > 1e-3 and abs(fsdp["metrics"]["kl/mean"] - single["kl/mean"]) < 1e-6
    for k, v in fsdp["policy"].items():
        torch.testing.assert_close(v, policy[k], atol=1e-6, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
