"""Two FSDP2 gloo ranks training against one shared generation server (``rollout.engine=remote``).

Every rank generates on the same ``emapg engine serve`` process; before each rollout with new
weights every rank joins the gather of the full state dict, rank 0 alone pushes it (http
buckets or a gloo collective group with the server), and the other ranks wait at a barrier.
Checked: both ranks finish, the server's ``weights_version`` advanced by exactly one per step
(never once per rank), only rank 0 called the engine's weight/lifecycle methods, and the
server ends up serving exactly the checkpointed policy it was last sent (``step_1/policy``:
the sync happens before a rollout, so the step-2 update is in the checkpoint only).
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch.multiprocessing as mp

from agent.engines import SamplingParams, make_engine
from agent.engines.launch import EngineServer
from agent.engines.remote import RemoteEngine
from emapg.config import load_config
from emapg.paths import CONFIG_DIR
from tests.fixtures.spawn import count_calls, free_port, rank_env

pytestmark = pytest.mark.slow

STEPS = 2
QUESTIONS = ["what is 2 + 3?", "simplify x^2 - x", "a longer question about primes, squares and the number 17"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _cfg(out, model_dir, url, weight_sync):
    from trainer.config import TrainConfig

    return load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [
        f"run.output_dir={out}", f"model.policy={model_dir}", f"run.total_steps={STEPS}", "run.save_every=1",
        "logging.progress=false", "logging.tensorboard=false", "data.prompts_per_step=2", "rollout.n_samples=2",
        "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2", "rollout.max_tokens_per_turn=8",
        "rollout.max_response_tokens=8", "optim.lr=1e-2", "rollout.engine=remote", f"rollout.engine_urls=[{url}]",
        f"rollout.weight_sync={weight_sync}",
    ])  # fmt: skip


def _worker(rank: int, world: int, port: int, out: str, model_dir: str, url: str, weight_sync: str) -> None:
    rank_env(rank, world, port)
    from trainer import distributed as D
    from trainer.loop import Trainer

    # Count this rank's calls that change the server's state (weights, sleep/wake).
    calls = count_calls(RemoteEngine, ["load_weights", "wake", "sleep"])
    trainer = Trainer(_cfg(f"{out}/run", model_dir, url, weight_sync)).setup()
    try:
        assert trainer.fsdp and D.is_sharded(trainer.model) and isinstance(trainer.engine, RemoteEngine)
        history = trainer.train()
    finally:
        trainer.close()
    D.destroy()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"steps": len(history), "step": trainer.step, "calls": calls,
                   "generated": [h["response/length_mean"] for h in history]}, f)


@pytest.fixture(scope="module")
def server(untied_tiny_dir):
    with EngineServer(untied_tiny_dir, engine="hf") as s:
        yield s


@pytest.mark.parametrize("weight_sync", ["http", "collective"])
def test_two_ranks_share_one_server_and_rank0_pushes_once_per_step(tmp_path, untied_tiny_dir, server, weight_sync):
    before = httpx.get(server.url + "/health").json()["weights_version"]
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path), str(untied_tiny_dir), server.url, weight_sync), nprocs=2, join=True)

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["steps"] == r["step"] == STEPS and min(r["generated"]) > 0
    # One sync per step (the servers start on other weights, then after step 1), by rank 0 only.
    assert ranks[1]["calls"] == {"load_weights": 0, "wake": 0, "sleep": 0}
    assert ranks[0]["calls"] == {"load_weights": STEPS, "wake": STEPS, "sleep": 0}  # woken only with a push
    health = httpx.get(server.url + "/health").json()
    assert health["weights_version"] == before + STEPS and health["weights_tag"] == f"step-{STEPS - 1}"

    # The server holds exactly the policy it was last sent: the step-1 checkpoint (HF folder).
    run = tmp_path / "run"
    pushed, final = make_engine("hf", run / "step_1" / "policy"), make_engine("hf", run / "step_2" / "policy")
    remote = RemoteEngine(server.url, model_path=str(untied_tiny_dir))
    try:
        prompts = [pushed.tokenizer(q).input_ids for q in QUESTIONS]
        served, expected = remote.generate(prompts, GREEDY), pushed.generate(prompts, GREEDY)
        for a, b in zip(served, expected, strict=True):
            assert a.token_ids == b.token_ids and len(a.token_ids) > 0
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        seqs = [p + o.token_ids for p, o in zip(prompts, expected)]
        start = [len(p) for p in prompts]
        assert remote.score(seqs, start) == [pytest.approx(x, abs=1e-5) for x in pushed.score(seqs, start)]
        # ... and the step-2 update is real (so the comparison above can tell the checkpoints apart).
        assert max(abs(x - y) for s, t in zip(pushed.score(seqs, start), final.score(seqs, start)) for x, y in zip(s, t)) > 1e-4
    finally:
        remote.close()
        pushed.close()
        final.close()
