"""Training with no retriever (issue 18): the start-up wait and key check, and the outage guard.

Real parts: ``emapg serve`` processes on real ports over the test index (started late, killed
mid-run, restarted on the same port), the real HTTP client, the weight-scripted tiny searcher
(every turn searches, so every rollout depends on the retriever), the real ``emapg train`` CLI.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Callable

import pytest

from emapg.config import load_config
from emapg.errors import UserError
from emapg.paths import CONFIG_DIR
from provision.retrievers import open_retriever
from retriever.launch import RetrieverServer, free_port
from tests.trainer.test_pipeline import record_weights_versions
from trainer.config import RetrieverConfig, TrainConfig
from trainer.errors import TrainingError
from trainer.loop import Trainer
from trainer.search_health import SearchOutageGuard

FAST = ["logging.progress=false", "logging.tensorboard=false", "data.prompts_per_step=2", "rollout.n_samples=2",
        "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2", "rollout.max_turns=2", "rollout.max_tokens_per_turn=12",
        "rollout.max_obs_tokens=16", "rollout.max_response_tokens=64", "run.save_every=0", "retriever.retries=0",
        "retriever.timeout=5"]


def search_cfg(tmp_path, model_dir, url: str, *extra: str) -> TrainConfig:
    return load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml",
                       [f"run.output_dir={tmp_path / 'run'}", f"model.policy={model_dir}", f"retriever.urls=[{url}]", *FAST, *extra])


def test_cli_with_nothing_listening_exits_naming_the_url(tmp_path, tiny_model_dir):
    """The contract: `emapg train retriever.urls=[http://127.0.0.1:9]` fails within retriever.wait, naming the URL."""
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "train", "--config", str(CONFIG_DIR / "search_tiny_cpu.yaml"),
         f"model.policy={tiny_model_dir}", "retriever.urls=[http://127.0.0.1:9]", "retriever.wait=1",
         f"run.output_dir={tmp_path / 'run'}", "logging.progress=false"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "http://127.0.0.1:9 was not ready within 1 s" in last and "retriever.wait" in last, proc.stderr
    assert "Traceback" not in proc.stderr


def test_guard_drops_batches_pauses_and_stops():
    """Unit-level, against a real client whose URL has nothing listening: the rate threshold is inclusive,
    a batch above it is dropped, the patience-th drop pauses (retriever.wait) and then stops the run."""
    url = f"http://127.0.0.1:{free_port()}"
    warnings: list[str] = []
    with open_retriever(urls=[url], retries=0, check=False) as retriever:
        guard = SearchOutageGuard(retriever, RetrieverConfig(urls=[url], wait=0.3, max_failure_rate=0.5, failure_patience=2),
                                  warn=warnings.append)
        def batch(failures, searches):
            return [SimpleNamespace(search_failures=failures, num_searches=searches)]

        assert guard.accept(batch(1, 2))  # 50% is not above 50%
        assert not guard.accept(batch(2, 3))
        assert guard.step_metrics() == {"search/failure_rate": 0.5, "search/rejected_batches": 1.0, "search/rejected_failures": 2.0}
        assert guard.accept(batch(0, 0)) and guard.streak == 0  # no searches: nothing failed
        assert not guard.accept(batch(3, 3))
        with pytest.raises(TrainingError, match=rf"3 of 3 searches failed .* 2 consecutive rollout batches and retriever {url} was not ready within 0.3 s"):
            guard.accept(batch(3, 3))
    assert any("training paused" in w for w in warnings)


def test_wrong_key_fails_at_start_and_a_killed_retriever_stops_the_run(tmp_path, searcher_dir, retriever_index, monkeypatch):
    with RetrieverServer(retriever_index.index_dir, api_key="right-key", log_path=tmp_path / "retriever.log") as server:
        monkeypatch.setenv("EMAPG_TEST_OUTAGE_KEY", "wrong-key")
        cfg = search_cfg(tmp_path, searcher_dir, server.url, "retriever.api_key_env=EMAPG_TEST_OUTAGE_KEY", "retriever.wait=2",
                         "run.total_steps=4")
        trainer = Trainer(cfg)
        with pytest.raises(UserError, match=rf"retriever {server.url} refused the API key.*check retriever.api_key_env"):
            trainer.setup()
        trainer.close()
        monkeypatch.setenv("EMAPG_TEST_OUTAGE_KEY", "right-key")
        trainer = Trainer(cfg).setup()
        trainer.step_hooks.append(lambda tr, metrics: server.stop())  # killed after the first step
        try:
            with pytest.raises(TrainingError, match=rf"searches failed .* retriever {server.url} was not ready within 2 s"):
                trainer.train()
            assert trainer.step == 1  # nothing was trained on the failed searches
        finally:
            trainer.close()
    (first,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert first["search/per_traj"] > 0 and first["search/failures"] == 0 and first["search/rejected_batches"] == 0


def test_retriever_down_at_start_dies_mid_run_and_comes_back(tmp_path, searcher_dir, retriever_index):
    port = free_port()
    servers: list[RetrieverServer] = []

    def start_after(delay: float) -> None:
        time.sleep(delay)
        servers.append(RetrieverServer(retriever_index.index_dir, port=port, log_path=tmp_path / "retriever.log").start())

    def kill_after_first_step(trainer, metrics) -> None:
        if trainer.step == 1:
            servers[-1].stop()
            threads.append(threading.Thread(target=start_after, args=(2.0,)))
            threads[-1].start()

    threads = [threading.Thread(target=start_after, args=(1.0,))]
    threads[0].start()  # down at start: setup waits for it
    cfg = search_cfg(tmp_path, searcher_dir, f"http://127.0.0.1:{port}", "retriever.wait=120", "run.total_steps=2")
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        trainer.step_hooks.append(kill_after_first_step)
        history = trainer.train()
    finally:
        trainer.close()
        for t in threads:
            t.join()
        for s in servers:
            s.stop()
    assert len(history) == 2 and len(servers) == 2
    assert history[1]["search/rejected_batches"] >= 1 and history[1]["search/rejected_failures"] > 0
    for m in history:  # every trained batch had working searches
        assert m["search/per_traj"] > 0 and m["search/failures"] == 0 and m["search/failure_rate"] == 0.0


@pytest.fixture(scope="module")
def searcher_engine(searcher_dir):
    """A real ``emapg engine serve`` process serving the scripted searcher (for ``rollout.max_staleness >= 1``)."""
    from agent.engines.launch import EngineServer

    with EngineServer(searcher_dir, engine="hf", max_model_len=1024) as server:
        yield server


def async_search_cfg(tmp_path, searcher_dir, retriever_url: str, engine_url: str, *extra: str) -> TrainConfig:
    return search_cfg(tmp_path, searcher_dir, retriever_url, "run.total_steps=2", "rollout.engine=remote",
                      f"rollout.engine_urls=[{engine_url}]", "rollout.max_staleness=1", *extra)


def killing_before_generation(trainer: Trainer, n: int, kill: Callable[[], None]) -> list[int]:
    """Make the producer call ``kill`` just before its ``n``-th generation; returns the list of generations run."""
    produced: list[int] = []
    produce = trainer.produce

    def produce_killing(engine, prompts, seed):
        produced.append(len(produced) + 1)
        if len(produced) == n:
            kill()
        return produce(engine, prompts, seed)

    trainer.produce = produce_killing
    return produced


@pytest.mark.slow  # a generation server, a retriever killed (and restarted)
def test_async_s1_retriever_dies_before_a_batch_and_comes_back(tmp_path, searcher_dir, retriever_index, searcher_engine):
    """``rollout.max_staleness=1`` on a real generation server: the retriever is killed just before the producer
    generates batch 2 (while the trainer trains on batch 1) and restarted on its port once the producer has
    rejected that batch. The producer regenerates batch 2 (same weights version) until the retriever is back
    (pausing on the patience-th rejection); no step trains on failed searches (``max_failure_rate=0``: a batch
    that met the restarted server still loading is rejected too); the rejections are counted."""
    port = free_port()
    servers = [RetrieverServer(retriever_index.index_dir, port=port, log_path=tmp_path / "retriever.log").start()]
    restart = threading.Thread(target=lambda: servers.append(
        RetrieverServer(retriever_index.index_dir, port=port, log_path=tmp_path / "retriever.log").start()))
    trainer = Trainer(async_search_cfg(tmp_path, searcher_dir, f"http://127.0.0.1:{port}", searcher_engine.url, "retriever.wait=120",
                                       "retriever.max_failure_rate=0"))
    # the producer's second generation is batch 2's first (batch 1's came first)
    produced = killing_before_generation(trainer, 2, servers[0].stop)
    seen = record_weights_versions(trainer)
    message = trainer.message

    def restart_after_the_first_rejection(text: str) -> None:
        if "rollout batch dropped" in text and restart.ident is None:
            restart.start()
        message(text)

    trainer.message = restart_after_the_first_rejection
    try:
        trainer.setup()
        history = trainer.train()
    finally:
        trainer.close()
        if restart.ident is not None:
            restart.join()
        for s in servers:
            s.stop()
    assert len(history) == 2 and len(servers) == 2
    assert [m["async/staleness"] for m in history] == [0.0, 1.0]
    rejected = history[1]["search/rejected_batches"]
    assert rejected >= 1 and history[1]["search/rejected_failures"] > 0 and len(produced) == 2 + rejected
    assert history[0]["search/rejected_batches"] == 0.0 and history[0]["async/search_dropped_batches"] == 0.0
    assert history[1]["async/search_dropped_batches"] == rejected and history[1]["async/dropped_batches"] == 0.0
    assert seen == [[0] * 4, [0] * 4]  # batch 2 regenerated with its scheduled weights version v(2) = 0
    for m in history:  # every trained batch had working searches
        assert m["search/per_traj"] > 0 and m["search/failures"] == 0 and m["search/failure_rate"] == 0.0


@pytest.mark.slow  # a generation server, a retriever killed (and restarted)
def test_async_s1_retriever_that_stays_down_stops_the_run(tmp_path, searcher_dir, retriever_index, searcher_engine):
    """The same with no restart: the producer's pause ends after retriever.wait and the run stops with the guard's
    error after step 1; nothing is trained on the failed searches."""
    server = RetrieverServer(retriever_index.index_dir, log_path=tmp_path / "retriever.log").start()
    trainer = Trainer(async_search_cfg(tmp_path, searcher_dir, server.url, searcher_engine.url, "retriever.wait=1"))
    killing_before_generation(trainer, 2, server.stop)
    try:
        trainer.setup()
        with pytest.raises(TrainingError, match=rf"producer failed on step 2: .*searches failed .* retriever {server.url} was not ready within 1 s"):
            trainer.train()
        assert trainer.step == 1
    finally:
        trainer.close()
        server.stop()
    (first,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert first["search/failures"] == 0 and first["search/rejected_batches"] == 0
