"""Open a retriever for a run: connect to running servers, or launch one on an index and connect.

One function, :func:`open_retriever`, for training, evaluation and the demo:

* ``urls`` given (one server or several replicas) -> a :class:`retriever.client.RetrieverClient`
  over them, load-balanced with failover;
* else ``index_dir`` -> start ``emapg serve`` on it (:class:`retriever.launch.RetrieverServer`, a free
  127.0.0.1 port) and connect to it; the server stops when the retriever is closed.

The API key comes from an environment variable (``api_key_env``), never from a command line (``ps``
shows argv) or a config file. Under ``torchrun`` only one rank should start a server: pass
``launch=False`` on the others and a ``share_url`` callable that hands rank 0's URL to every rank (a
broadcast, which the caller owns); every rank then connects to the same server.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from emapg.errors import ConfigError, UserError

log = logging.getLogger(__name__)

__all__ = ["OpenRetriever", "open_retriever", "api_key_from_env", "batch_invariant_of", "require_batch_invariant"]


def api_key_from_env(env: str | None, *, config_key: str = "retriever.api_key_env") -> str | None:
    """The key held by environment variable ``env`` (None when ``env`` is None); a named but unset
    variable is a :class:`ConfigError` naming ``config_key``."""
    if not env:
        return None
    key = os.environ.get(env)
    if not key:
        raise ConfigError(f"{config_key}: ${env} is not set")
    return key


class OpenRetriever:
    """A connected retriever and, when this process started it, its server.

    Pass it wherever a retriever is expected (``retrieve(queries, topk=...)``); :meth:`close` (or
    leaving the ``with`` block) closes the client and stops a server it launched.
    """

    def __init__(self, client, server=None, description: str = "") -> None:
        self.client = client
        self.server = server
        self.description = description  # "http://..." or "started on <index>", for run records

    @property
    def urls(self) -> list[str]:
        return self.client.urls

    def retrieve(self, queries: list[str], topk: int | None = None) -> list[list[dict]]:
        return self.client.retrieve(queries, topk=topk)

    def health(self) -> dict:
        return self.client.health()

    def fingerprints(self) -> dict[str, dict | None]:
        """The index fingerprint of each server URL (:meth:`retriever.client.RetrieverClient.fingerprints`)."""
        return self.client.fingerprints()

    def wait_ready(self, wait_s: float) -> None:
        """Every server's ``/health`` and a keyed one-query search within ``wait_s`` seconds
        (:meth:`retriever.client.RetrieverClient.wait_ready`; raises its ``RetrievalError``)."""
        self.client.wait_ready(wait_s)

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            if self.server is not None:
                self.server.stop()
                self.server = None

    def __enter__(self) -> OpenRetriever:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_retriever(
    *,
    urls: Sequence[str] = (),
    index_dir: str | Path | None = None,
    topk: int = 3,
    timeout: float = 30.0,
    retries: int = 3,
    api_key_env: str | None = None,
    api_key: str | None = None,
    launch: bool = True,
    share_url: Callable[[str | None], str] | None = None,
    check: bool = True,
    wait_s: float | None = None,
    log_path: str | Path | None = None,
    batch_invariant: bool = False,
) -> OpenRetriever:
    """Connect to ``urls``, or serve ``index_dir`` and connect to it.

    Args:
        urls: base URLs of running servers (several = replicas); takes precedence over ``index_dir``.
        index_dir: a finished index (``meta.json`` present) to serve for the caller's lifetime.
        topk: the launched server's default passages per query.
        timeout, retries: per request, for the client.
        api_key_env: environment variable holding the API key (the launched server requires it too);
            ``api_key`` gives the key itself instead.
        launch: whether *this* process may start the server; False on all but one rank.
        share_url: called with the launched server's URL (None where ``launch`` is False) and returns
            the URL every caller connects to -- a broadcast from the launching rank.
        check: ask ``/health`` before returning, so an unreachable server fails here, readably.
        wait_s: instead of ``check``'s single question, wait up to this many seconds for *every*
            server's ``/health`` and check the API key with a one-query search
            (:meth:`OpenRetriever.wait_ready`); a server that stays down or refuses the key is a
            :class:`UserError` naming its URL.
        log_path: the launched server's log file (default: a temp file).
        batch_invariant: a query's passages must not depend on the queries served beside it: the launched server
            runs ``emapg serve --batch-invariant``; a server at ``urls`` must say so in its ``/health`` (a
            :class:`ConfigError` where it says otherwise, a warning where it does not say).
    """
    if api_key_env:
        api_key = api_key_from_env(api_key_env)
    from retriever.client import RetrieverClient

    server = None
    url_list = [urls] if isinstance(urls, str) else list(urls)
    connecting = bool(url_list)  # to servers started elsewhere
    if connecting:
        description = ", ".join(url_list)
    else:
        if index_dir is None:
            raise ConfigError("a retriever needs server URLs or an index folder to serve")
        index = Path(index_dir).expanduser()
        url = None
        if launch:
            if not (index / "meta.json").is_file():
                raise UserError(f"{index} is not a finished index (no meta.json); build one with `emapg index build`")
            from retriever.launch import RetrieverServer

            server = RetrieverServer(index, topk=topk, api_key=api_key, log_path=log_path,
                                     extra_args=["--batch-invariant"] if batch_invariant else None).start()
            url = server.url
        try:
            url_list = [share_url(url) if share_url is not None else url]
        except BaseException:
            if server is not None:
                server.stop()
            raise
        if url_list[0] is None:
            raise ValueError("launch=False needs a share_url that returns the launching process's URL")
        description = f"started on {index}"
    try:
        client = RetrieverClient(url_list, timeout=timeout, retries=retries, api_key=api_key)
    except ValueError as e:  # a malformed URL
        if server is not None:
            server.stop()
        raise ConfigError(f"retriever URL: {e}") from None
    opened = OpenRetriever(client, server, description)
    if wait_s is not None:
        from retriever.client import RetrievalError

        try:
            opened.wait_ready(wait_s)
        except RetrievalError as e:
            opened.close()
            hint = "check retriever.api_key_env" if e.status in (401, 403) else "start it (`emapg serve`) or raise retriever.wait"
            raise UserError(f"{e}; {hint}") from None
    elif check:
        try:
            client.health()
        except Exception as e:
            opened.close()
            raise UserError(f"retrieval server at {', '.join(url_list)} is not reachable: {e}") from None
    if batch_invariant and connecting:
        try:
            require_batch_invariant(client)
        except ConfigError:
            opened.close()
            raise
    return opened


def batch_invariant_of(health: dict, replica_healths: Callable[[list[str]], dict[str, dict | None]] | None = None) -> bool | None:
    """Whether a retrieval server's ``/health`` says a query's passages never depend on the queries beside it;
    None where it does not say (a server of another project, one that does not answer).

    A server: its ``index.batch_invariant``. A router: its encoder, where it encodes (``encoder_batch_invariant``),
    and every shard replica it names (their own ``/health``, read through ``replica_healths``: URLs -> {URL: body}), since
    each shard searches the query among the others it is sent.
    """
    index = health.get("index")
    if isinstance(index, dict) and isinstance(index.get("batch_invariant"), bool):
        return index["batch_invariant"]
    shards = health.get("shards")
    if not isinstance(shards, list):
        return None
    said: list[bool | None] = []
    if health.get("encoder") == "router":
        value = health.get("encoder_batch_invariant")
        said.append(value if isinstance(value, bool) else None)
    urls = [r.get("url") for s in shards if isinstance(s, dict) for r in s.get("replicas") or [] if isinstance(r, dict)]
    if replica_healths is None or not urls:
        said.append(None)
    else:
        said += [batch_invariant_of(h) if isinstance(h, dict) else None for h in replica_healths([u for u in urls if u]).values()]
    return False if False in said else None if None in said else True


def require_batch_invariant(client, config_key: str = "retriever.batch_invariant") -> None:
    """Every server of ``client`` must be batch-invariant (:func:`batch_invariant_of` its ``/health``, a router's
    shards asked too): a :class:`ConfigError` naming the first that says it is not, a logged warning for each that
    does not say."""
    from retriever.client import read_healths

    for url, health in client.healths().items():
        said = batch_invariant_of(health or {}, read_healths)
        if said is False:
            raise ConfigError(f"{config_key}: the retrieval server at {url} is not batch-invariant; restart it with "
                              "`emapg serve --batch-invariant` (a router: `--batch-invariant` and shards started with it)")
        if said is None:
            log.warning("%s: the retrieval server at %s does not say whether it is batch-invariant; a query's passages "
                        "may depend on the queries served beside it", config_key, url)
