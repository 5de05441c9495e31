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
