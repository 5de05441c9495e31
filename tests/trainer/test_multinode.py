"""Multi-node on one machine, and preemption.

Two torchrun agents (``--nnodes 2``, one per "node", a c10d rendezvous on 127.0.0.1, gloo) train the toy
search task against one shared, real retriever server: each node runs its own rank and its own engine;
only global rank 0 writes metrics and the checkpoint's shared files; each agent's output goes to its own
log; then one plain process resumes the run with ``--resume`` (the issue's contract). Then SIGTERM to one rank of a 2-rank run mid-step: every rank finishes the step, they agree on it,
one checkpoint of that step is written and all exit cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from emapg import CLI_MODULE
from emapg.paths import CONFIG_DIR, REPO_ROOT
from tests.fixtures.spawn import free_port, rank_env
from tests.fixtures.torchrun import agent_failure, run_agents
from tests.fixtures.trainer import toy_overrides
from tests.trainer.test_distributed import _cfg

pytestmark = pytest.mark.slow


def test_two_torchrun_agents_train_two_steps_then_one_process_resumes(tmp_path, tiny_model_dir, toy_task, toy_server):
    from trainer.checkpoint import list_checkpoints, verify_checkpoint

    run = tmp_path / "run"
    overrides = toy_overrides(toy_task, toy_server.url, run, **{
        "model.policy": str(tiny_model_dir), "run.total_steps": 2, "run.save_every": 0, "logging.progress": "false",
        "logging.tensorboard": "false", "data.prompts_per_step": 2, "rollout.n_samples": 2,
        "algorithm.mini_batch_size": 4, "algorithm.micro_batch_size": 2})
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    codes = run_agents(CONFIG_DIR / "search_tiny_cpu.yaml", overrides, logs, nproc_per_node=1, port=free_port(),
                       rdzv_id="two-node-test", timeout_s=900)
    assert codes == [0, 0], agent_failure(codes, logs)

    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]  # rank 0 only
    (ckpt,) = list_checkpoints(run)
    assert ckpt.name == "step_2" and verify_checkpoint(ckpt).intact
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["data"]["consumed"] == 4
    assert {p.name for p in ckpt.glob("rng_rank*.pt")} == {"rng_rank0.pt", "rng_rank1.pt"}
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in (ckpt / "state").iterdir()}
    assert all(p.stat().st_size > 0 for p in logs)

    # The contract: the same config, one plain process, `--resume` continues the 2-rank run (step 3).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", CLI_MODULE, "train", "--config", str(CONFIG_DIR / "search_tiny_cpu.yaml"),
                           *overrides, "run.total_steps=3", "--resume"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    step_3 = run / "step_3"
    assert verify_checkpoint(step_3).intact and json.loads((step_3 / "trainer_state.json").read_text())["world_size"] == 1
    assert json.loads((step_3 / "trainer_state.json").read_text())["data"]["consumed"] == 6  # 2 prompts more, none repeated


def _sigterm_worker(rank: int, world: int, port: int, out: str, model_dir: str) -> None:
    rank_env(rank, world, port)
    from trainer import distributed as D
    from trainer.loop import Trainer

    trainer = Trainer(_cfg(f"{out}/run", model_dir, "run.total_steps=4", "run.save_every=0")).setup()
    try:
        if rank == 1:  # preempted in the middle of step 2 (during its rollouts), on one rank only
            sample_batch = trainer.sample_batch

            def preempted(prompts):
                if trainer.step == 1:
                    os.kill(os.getpid(), signal.SIGTERM)
                return sample_batch(prompts)

            trainer.sample_batch = preempted
        history = trainer.train()
    finally:
        trainer.close()
    Path(f"{out}/rank{rank}.json").write_text(json.dumps({"steps": len(history), "step": trainer.step}))
    D.destroy()


def test_sigterm_to_one_rank_mid_step_writes_one_consistent_checkpoint(tmp_path, tiny_model_dir):
    from trainer.checkpoint import MANIFEST, list_checkpoints, verify_checkpoint

    mp.spawn(_sigterm_worker, args=(2, free_port(), str(tmp_path), str(tiny_model_dir)), nprocs=2, join=True)  # exit 0
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks == [{"steps": 2, "step": 2}] * 2  # both finished step 2, then stopped together
    (ckpt,) = list_checkpoints(tmp_path / "run")
    assert ckpt.name == "step_2" and verify_checkpoint(ckpt).intact
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 2
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert manifest["step"] == 2 and manifest["world_size"] == 2
    assert {"rng_rank0.pt", "rng_rank1.pt", "state/__0_0.distcp", "state/__1_0.distcp"} <= set(manifest["files"])
