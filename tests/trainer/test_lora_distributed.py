"""LoRA under FSDP2 on CPU: 2 gloo ranks (base and adapters sharded, the adapters' EMA on local shards) against one process.

The same global batch is trained one PPO update by two ranks (half the batch each) and by one process; the
adapters and their EMA must agree to float tolerance, the base must not move. The two ranks then train a real
step end to end (rollouts per rank through the transformers engine, adapter sync, a peft checkpoint with
per-rank RNG files) and resume from it.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.fixtures.spawn import free_port, rank_env
from tests.trainer.test_distributed import GROUP, N_GROUPS, _cfg, _one_update, resume_one_more_step

pytestmark = pytest.mark.slow

LORA = ("model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=16", "optim.lr=5e-2")


def _worker(rank: int, world: int, port: int, out: str, model_dir: str) -> None:
    rank_env(rank, world, port)
    from trainer import distributed as D
    from trainer.loop import Trainer

    trainer = Trainer(_cfg(f"{out}/run", model_dir, "run.total_steps=1", *LORA)).setup()
    try:
        assert trainer.fsdp and D.is_sharded(trainer.model)
        half = D.shard_slice(N_GROUPS, rank, world)
        metrics = _one_update(trainer, slice(half.start * GROUP, half.stop * GROUP))
        adapters = trainer.policy.adapter_weights()
        anchor = trainer.anchor.full_state_dict()
        base = {k: v for k, v in D.full_state_dict(trainer.policy.forward).items() if "base_layer" in k}
        if rank == 0:
            torch.save({"adapters": adapters, "anchor": anchor, "base": base, "metrics": metrics}, f"{out}/fsdp.pt")
        trainer.train()
    finally:
        trainer.close()
    resume_one_more_step(out, model_dir, *LORA)
    D.destroy()


def test_lora_fsdp2_two_ranks_match_single_process(tmp_path, tiny_model_dir):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path), str(tiny_model_dir)), nprocs=2, join=True)

    from trainer import lora as L
    from trainer.loop import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trainer = Trainer(_cfg(tmp_path / "single", tiny_model_dir, "run.total_steps=1", *LORA)).setup(with_engine=False)
    try:
        assert not trainer.fsdp
        single = _one_update(trainer, slice(0, N_GROUPS * GROUP))
        adapters = trainer.policy.adapter_weights()
        anchor = trainer.anchor.full_state_dict()
        base = {f"lm.{k}": v.detach() for k, v in trainer.model.state_dict().items() if "base_layer" in k}
    finally:
        trainer.close()
        torch.set_num_threads(threads)
    fsdp = torch.load(tmp_path / "fsdp.pt", weights_only=True)
    assert fsdp["adapters"].keys() == adapters.keys() and fsdp["anchor"].keys() == anchor.keys()
    for k, v in fsdp["adapters"].items():
        torch.testing.assert_close(v, adapters[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    for k, v in fsdp["anchor"].items():
        torch.testing.assert_close(v, anchor[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    assert max(float(v.abs().max()) for k, v in adapters.items() if ".lora_B." in k) > 1e-4  # the update was real
    assert all(torch.equal(fsdp["base"][k], base[k]) for k in base)  # the base never moves
    assert fsdp["metrics"]["actor/updates"] == single["actor/updates"] == 1
    assert abs(fsdp["metrics"]["kl/mean"] - single["kl/mean"]) < 1e-6
    run = tmp_path / "run"
    assert (run / "step_1" / "rng_rank1.pt").is_file() and L.is_adapter_folder(run / "step_2" / "policy")
    assert (run / "latest").read_text().strip() == "step_2"
