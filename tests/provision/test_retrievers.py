"""provision: the retriever opened or launched for a run, and the bundled index reused only when it matches.

Real parts: the session's retrieval server, real ``emapg serve`` processes launched on real indexes,
real index builds of the bundled corpus (its first passages) in a temporary cache.
"""

from __future__ import annotations

import json

import httpx
import pytest

from emapg.errors import ConfigError, UserError
from provision.indexes import bundled_index, ensure_bundled_index, index_mismatches
from provision.retrievers import open_retriever
from retriever.launch import free_port


def test_urls_connect_to_running_servers(retriever_server, retriever_index):
    with open_retriever(urls=[retriever_server.url, retriever_server.url + "/"], timeout=10, retries=1) as r:
        assert r.server is None and r.description.startswith(retriever_server.url)
        q = retriever_index.questions[0]
        assert r.retrieve([q["question"]], topk=2)[0][0]["id"] == q["gold_id"]
    with pytest.raises(UserError, match="not reachable"):
        open_retriever(urls=[f"http://127.0.0.1:{free_port()}"], retries=0)
    with pytest.raises(ConfigError, match="retriever URL"):
        open_retriever(urls=["localhost:8000"])
    with pytest.raises(ConfigError, match="URLs or an index"):
        open_retriever()


def test_an_index_is_launched_shared_and_stopped(retriever_index, tmp_path):
    urls: list[str | None] = []

    def share(url):  # what a broadcast from the launching rank does, here within one process
        urls.append(url)
        return urls[0]

    with open_retriever(index_dir=retriever_index.index_dir, topk=2, share_url=share, log_path=tmp_path / "r.log") as first:
        assert first.server is not None and first.description == f"started on {retriever_index.index_dir}"
        with open_retriever(index_dir=retriever_index.index_dir, launch=False, share_url=share) as second:
            assert second.server is None and second.urls == first.urls
            assert len(second.retrieve(["capital of France"])[0]) == 2  # the launched server's default topk
        url = first.urls[0]
    assert urls == [url, None]
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)
    with pytest.raises(UserError, match="not a finished index"):
        open_retriever(index_dir=tmp_path)
    with pytest.raises(ValueError, match="share_url"):
        open_retriever(index_dir=retriever_index.index_dir, launch=False)


def test_api_key_from_the_environment(retriever_index, monkeypatch):
    monkeypatch.delenv("EMAPG_TEST_RETRIEVER_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"retriever.api_key_env: \$EMAPG_TEST_RETRIEVER_KEY is not set"):
        open_retriever(index_dir=retriever_index.index_dir, api_key_env="EMAPG_TEST_RETRIEVER_KEY")
    monkeypatch.setenv("EMAPG_TEST_RETRIEVER_KEY", "s3cret")
    with open_retriever(index_dir=retriever_index.index_dir, api_key_env="EMAPG_TEST_RETRIEVER_KEY") as r:
        assert r.retrieve(["capital of France"], topk=1)
        # the launched server requires the key: a request without it is refused
        assert httpx.post(r.urls[0] + "/retrieve", json={"queries": ["x"]}, timeout=10).status_code == 401


def test_bundled_index_is_built_once_and_reused_only_when_its_settings_match(tmp_path, monkeypatch):
    monkeypatch.setenv("EMAPG_CACHE", str(tmp_path))
    logs: list[str] = []
    path = ensure_bundled_index(16, dtype="float32", log=logs.append)
    assert path == tmp_path / "indexes" / "wiki_mini-minilm-flat-first16" == bundled_index(16).path
    meta = json.loads((path / "meta.json").read_text())
    assert meta["rows"] == 16 and meta["build"]["dtype"] == "float32" and meta["index_type"] == "Flat"
    assert any("building the bundled Wikipedia index" in m for m in logs)

    logs.clear()
    assert ensure_bundled_index(16, dtype="float32", log=logs.append) == path  # reused: nothing built
    assert logs == [f"reusing the bundled index {path} (its settings match)"]
    assert json.loads((path / "meta.json").read_text()) == meta

    # another encoding dtype is another index: rebuilt, not served
    want = bundled_index(16, dtype="bfloat16")
    assert index_mismatches(path, want.build_config(), want.dtype) == ["dtype"]
    ensure_bundled_index(16, dtype="bfloat16", log=logs.append)
    assert any("other settings (dtype)" in m for m in logs)
    assert json.loads((path / "meta.json").read_text())["build"]["dtype"] == "bfloat16"

    # a stale corpus (the bundled file changed since the build) is caught by its checksum
    meta = json.loads((path / "meta.json").read_text())
    meta["corpus"]["checksum"] = "0" * len(meta["corpus"]["checksum"])
    (path / "meta.json").write_text(json.dumps(meta))
    logs.clear()
    ensure_bundled_index(16, dtype="bfloat16", log=logs.append)
    assert any("corpus checksum" in m for m in logs)
    assert json.loads((path / "meta.json").read_text())["corpus"]["checksum"] != "0" * len(meta["corpus"]["checksum"])


def test_batch_invariant_launches_the_server_so_and_checks_servers_given_by_url(retriever_server, retriever_index, tmp_path):
    """retriever.batch_invariant / --retriever-batch-invariant: the launched server runs ``--batch-invariant``; a server
    or router given by URL that says it is not (a router: its encoder or any shard) is refused naming the key."""
    from emapg.config import load_config
    from emapg.paths import REPO_ROOT
    from retriever.launch import RouterServer
    from trainer.config import TrainConfig
    from trainer.distributed import DistInfo
    from trainer.loop import open_run_retriever

    cfg = load_config(TrainConfig, REPO_ROOT / "configs" / "search_tiny_cpu.yaml",
                      ["retriever.urls=[]", f"retriever.index_dir={retriever_index.index_dir}", "retriever.batch_invariant=true"])
    with open_run_retriever(cfg, DistInfo()) as launched:
        assert launched.server is not None and launched.health()["index"]["batch_invariant"] is True
        with open_retriever(urls=launched.urls, batch_invariant=True) as again:  # it says so: accepted
            q = retriever_index.questions[0]
            assert again.retrieve([q["question"]], topk=1)[0][0]["id"] == q["gold_id"]
        refused = r"retriever.batch_invariant: the retrieval server at %s is not batch-invariant"
        with RouterServer([launched.urls], extra_args=["--batch-invariant"]) as router:  # both halves invariant
            with open_retriever(urls=[router.url], batch_invariant=True) as via_router:
                assert via_router.health()["encoder_batch_invariant"] is True
        with RouterServer([launched.urls]) as router:  # its own encoder batches queries
            with pytest.raises(ConfigError, match=refused % router.url):
                open_retriever(urls=[router.url], batch_invariant=True)
        with RouterServer([[retriever_server.url]], extra_args=["--batch-invariant"]) as router:  # its shard batches
            with pytest.raises(ConfigError, match=refused % router.url):
                open_retriever(urls=[router.url], batch_invariant=True)
    with pytest.raises(ConfigError, match=refused % retriever_server.url):
        open_retriever(urls=[retriever_server.url], batch_invariant=True)
    with open_retriever(urls=[retriever_server.url]) as plain:  # not asked for: no check
        assert plain.health()["index"]["batch_invariant"] is False


def test_a_server_that_does_not_say_is_used_with_a_warning(caplog):
    """A server of another project (no ``/health``) does not say whether it is batch-invariant: a warning, no error."""
    import logging
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NoHealth(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server name
            self.send_error(404)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NoHealth)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with caplog.at_level(logging.WARNING, logger="provision.retrievers"), \
                open_retriever(urls=[url], batch_invariant=True, check=False):  # fmt: skip
            said = [rec.getMessage() for rec in caplog.records]
    finally:
        httpd.shutdown()
    assert said == [f"retriever.batch_invariant: the retrieval server at {url} does not say whether it is "
                    "batch-invariant; a query's passages may depend on the queries served beside it"]
