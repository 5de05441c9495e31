"""``emapg view RUN_DIR [RUN_DIR ...]``: the viewer's web app (FastAPI) and the command.

Read-only (GET only), bound to 127.0.0.1 by default, every asset from the package: the page and its script from
``app/viewer/static/``, plotly.js from the installed ``plotly`` wheel. The page builds its DOM from the JSON API with
text nodes only; the Content-Security-Policy below also forbids inline scripts, ``eval``, other origins and
framing, so even a rendering mistake could not run what a trajectory contains. The Host header must name this
machine: ``localhost`` or a loopback address, the one bound included (a DNS-rebinding page elsewhere cannot read the
runs).

Bounded work per request: every API answer is built and encoded in one of :data:`WORKERS` threads (never on the
event loop; at most :data:`MAX_WAITING` more wait, then 503), within a deadline (:data:`DEADLINE_S`, then 503 while
the work finishes in its thread), from files read by :mod:`app.viewer.run_files` (regular files only: nothing can
block a read). A connection's headers must arrive within :data:`HEADER_TIMEOUT_S` (:mod:`emapg.connection_guard`),
and SIGINT/SIGTERM stop the server within :data:`SHUTDOWN_S`. Every answer is JSON that cannot fail to encode:
non-finite numbers are null and bidirectional control characters are shown as their code points
(:func:`app.viewer.trajectory.shown`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

from app.viewer.run_files import int_field
from app.viewer.runs import OUTCOMES, Run, compare, filter_items, finite, open_runs
from app.viewer.summary import NotComparable, pair_summary
from app.viewer.trajectory import shown
from emapg.config import ConfigError, add_config_arguments, config_from_args, option

STATIC = Path(__file__).resolve().parent / "static"
PAGES = ("/", "/curves", "/samples", "/eval", "/compare", "/summary")
ASSETS = {"view.js": "text/javascript", "view.css": "text/css"}
#: Assets are served under their content's digest (``/static/<digest>/<name>``), so a browser keeps them for good
#: and fetches them again only when they change; everything else is ``no-store``.
IMMUTABLE = "public, max-age=31536000, immutable"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                    "X-Frame-Options": "DENY"}
#: How many eval items one page of the table lists.
MAX_ITEMS = 500
#: Threads that build the API's answers, answers that may wait for one (503 beyond), and how long one may take (503).
WORKERS, MAX_WAITING, DEADLINE_S = 4, 64, 30.0
#: Seconds a connection has to send a request's headers; connections kept idle at most; seconds to stop on a signal.
HEADER_TIMEOUT_S, MAX_IDLE_CONNECTIONS, SHUTDOWN_S = 10.0, 64, 3


@dataclass
class ViewConfig:
    """``emapg view``: a local web page over training runs, eval runs and demo folders."""

    runs: list[str] = option(help="run folders: a training run (metrics.jsonl, samples.jsonl), an eval run (items/, run.json) "
                                  "or a folder holding runs (an emapg demo folder)")
    host: str = option("127.0.0.1", help="address to bind; only loopback addresses are served (the viewer has no "
                                         "authentication), another needs --insecure")
    port: int = option(8765, ge=0, le=65535, help="port to bind (0: a free one)")
    insecure: bool = option(False, help="allow a non-loopback --host (anyone who reaches it can read the runs)")
    open_browser: bool = option(False, help="open the page in the default browser once serving")


def plotly_js() -> Path:
    """The plotly.js bundle the ``plotly`` wheel ships."""
    try:
        path = Path(str(files("plotly") / "package_data" / "plotly.min.js"))
    except ModuleNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ConfigError("emapg view needs the plotly package (its plotly.js bundle): pip install plotly")
    return path


def asset_files() -> dict[str, tuple[Path, str]]:
    """Every asset the page loads: name -> (file, media type)."""
    return {"plotly.min.js": (plotly_js(), "text/javascript"), **{name: (STATIC / name, kind) for name, kind in ASSETS.items()}}


def digest_of(path: Path) -> str:
    """The first 16 hex digits of the file's sha256: its URL's version."""
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def hashed_page(assets: dict[str, tuple[Path, str]]) -> tuple[bytes, dict[str, str]]:
    """index.html with each ``/static/<name>`` turned into ``/static/<digest>/<name>``, and the digests."""
    digests = {name: digest_of(path) for name, (path, _) in assets.items()}
    page = (STATIC / "index.html").read_text()
    for name, digest in digests.items():
        page = page.replace(f'"/static/{name}"', f'"/static/{digest}/{name}"')
    return page.encode(), digests


def metric_titles(keys: list[str]) -> dict[str, str]:
    """The curves' titles, the report's own (:data:`trainer.plot.TITLES`: the two reward curves above all)."""
    from trainer.plot import TITLES

    return {k: TITLES[k] for k in keys if k in TITLES}


def constant_keys(rows: list[dict[str, Any]], keys: list[str]) -> dict[str, Any]:
    """Keys whose value is the same at every one of at least 2 logged steps (a flat panel), with that value."""
    out = {}
    for k in keys:
        values = [r[k] for r in rows if r.get(k) is not None]
        if len(values) >= 2 and all(v == values[0] for v in values):
            out[k] = values[0]
    return out


def flat_by_construction(constant: dict[str, Any]) -> dict[str, str]:
    """Of the flat keys, those flat at the value they keep by construction (:data:`trainer.plot.FLAT_BY_CONSTRUCTION`),
    with the reason: the page leaves them out of its default panels; a key merely flat so far stays."""
    from trainer.plot import FLAT_BY_CONSTRUCTION

    return {k: FLAT_BY_CONSTRUCTION[k][1] for k, v in constant.items()
            if k in FLAT_BY_CONSTRUCTION and v == FLAT_BY_CONSTRUCTION[k][0]}


def _number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return finite(value)


def _displayable(value: Any) -> Any:
    """``value`` as the page receives it: non-finite numbers null, bidirectional controls visible (module docstring).
    Records are at most :data:`app.viewer.run_files.MAX_RECORD_DEPTH` deep, so the recursion is bounded."""
    if isinstance(value, str):
        return shown(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {shown(str(k)): _displayable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_displayable(v) for v in value]
    return value


def encode(value: Any) -> bytes:
    """The API's JSON for ``value``: never NaN, never unencodable (a lone surrogate from a file name becomes '?')."""
    return json.dumps(_displayable(value), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8", "replace")


def host_allowed(host_header: str, allowed: list[str] | None) -> bool:
    """Whether a request's ``Host`` names an allowed host: ``allowed`` names (``"*"``: any), or by default
    ``localhost`` and any loopback address (``127.0.0.2`` too, for ``--host 127.0.0.2``)."""
    from emapg.servers import is_loopback

    host = host_header.strip()
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    host = host.lower()
    if allowed is not None:
        return "*" in allowed or host in allowed
    return bool(host) and is_loopback(host)


def plan_of(run: Run) -> dict[str, Any]:
    """``emapg plan``'s prediction beside the run's measured peak memory and step time (``{}`` without a plan)."""
    from trainer.plan.compare import plan_beside_measured

    return plan_beside_measured(run.path, run.metrics()) or {}


def create_app(runs: list[Run], *, allowed_hosts: list[str] | None = None):
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import FileResponse, JSONResponse, Response

    from emapg.request_workers import RequestWorkers
    from emapg.server_input import HTTPError

    app = FastAPI(title="emapg view", docs_url=None, redoc_url=None, openapi_url=None)
    by_id = {r.id: r for r in runs}
    workers = RequestWorkers(WORKERS, MAX_WAITING, name="view")
    assets = asset_files()
    page, digests = hashed_page(assets)

    @app.middleware("http")
    async def headers(request: Request, call_next):
        if not host_allowed(request.headers.get("host", ""), allowed_hosts):
            response = JSONResponse({"detail": "Invalid host header: the viewer answers requests for localhost or a "
                                               "loopback address only"}, status_code=400)
        else:
            response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    async def answer(build, *args) -> Response:
        """``build(*args)`` in a worker thread, encoded there (module docstring); 503 when busy or past the deadline."""
        work = workers.run(lambda: encode(build(*args)))
        try:
            body = await asyncio.wait_for(asyncio.shield(work), DEADLINE_S)
        except asyncio.TimeoutError:
            return JSONResponse({"detail": f"building this answer took more than {DEADLINE_S:g} s; it is still being "
                                           "built, retry shortly"}, status_code=503, headers={"Retry-After": "5"})
        except HTTPError as e:  # the workers' bound
            return JSONResponse({"detail": e.message}, status_code=e.status, headers={"Retry-After": str(e.retry_after or 1)})
        return Response(body, media_type="application/json")

    def run_of(run_id: str, kind: str | None = None) -> Run:
        run = by_id.get(run_id)
        if run is None or (kind is not None and run.kind != kind):
            raise HTTPException(404, f"no {kind or ''} run {run_id!r}".replace("  ", " "))
        return run

    for path in PAGES:
        app.add_api_route(path, lambda: Response(page, media_type="text/html; charset=utf-8"), methods=["GET"])

    @app.get("/static/{digest}/{name}")
    def hashed_asset(digest: str, name: str):
        if name not in assets or digests[name] != digest:
            raise HTTPException(404, "no such asset (or another version of it)")
        path, media_type = assets[name]
        return FileResponse(path, media_type=media_type, headers={"Cache-Control": IMMUTABLE})

    @app.get("/static/{name}")
    def asset(name: str):
        if name not in assets:
            raise HTTPException(404, "no such asset")
        path, media_type = assets[name]
        return FileResponse(path, media_type=media_type)

    @app.get("/api/health")
    async def health():
        """200 at once: the event loop is answering (what a monitor, or a test of a slow request, polls)."""
        return {"status": "ok", "runs": len(runs), "workers": workers.stats()}

    @app.get("/api/runs")
    async def list_runs():
        return await answer(lambda: [r.summary() for r in runs])

    def metrics_of(run: Run, since: int) -> dict[str, Any]:
        records = run.metrics()
        keys = sorted({k for r in records for k, v in r.items() if k != "step" and _number(v) is not None})
        rows = [{"step": int_field(r.get("step")), **{k: _number(v) for k, v in r.items() if k != "step"}}
                for r in records if int_field(r.get("step")) > since]
        guard = [{"step": int_field(e.get("step"), None), "action": str(e.get("action", "")), "reason": str(e.get("reason", ""))}
                 for e in run.guard_events()]
        constant = constant_keys([{k: _number(v) for k, v in r.items()} for r in records], keys)
        return {"keys": keys, "records": rows, "guard": guard, "titles": metric_titles(keys),
                "constant": constant, "by_construction": flat_by_construction(constant)}

    @app.get("/api/runs/{run_id}/metrics")
    async def metrics(run_id: str, since: int = -1):
        return await answer(metrics_of, run_of(run_id, "train"), since)

    @app.get("/api/runs/{run_id}/plan")
    async def plan(run_id: str):
        return await answer(plan_of, run_of(run_id, "train"))

    def samples_of(run: Run, step: int | None) -> dict[str, Any]:
        steps = run.sample_steps()
        if step is None:
            step = steps[-1] if steps else 0
        shown_, skipped = run.step_samples(step)
        return {"steps": steps, "step": step, "samples": shown_, "skipped": skipped}

    @app.get("/api/runs/{run_id}/samples")
    async def samples(run_id: str, step: int | None = None):
        return await answer(samples_of, run_of(run_id, "train"), step)

    def items_of(run: Run, dataset: str | None, outcome: str | None, searches: int | None) -> dict[str, Any]:
        every = run.items()
        kept = filter_items(every, dataset=dataset or None, outcome=outcome or None, searches=searches)
        return {"datasets": run.datasets(), "total": len(every), "matching": len(kept), "items": kept[:MAX_ITEMS],
                "searches": sorted({i["searches"] for i in every})}

    @app.get("/api/runs/{run_id}/items")
    async def items(run_id: str, dataset: str | None = None, outcome: str | None = None, searches: int | None = None):
        run = run_of(run_id, "eval")
        if outcome and outcome not in OUTCOMES:
            raise HTTPException(422, f"outcome must be one of {', '.join(OUTCOMES)}")
        return await answer(items_of, run, dataset, outcome, searches)

    def item_of(run: Run, dataset: str, item_id: str, sample: int) -> dict[str, Any]:
        try:
            found = run.item(dataset, item_id, sample)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError):  # a field of the wrong type
            raise HTTPException(422, "this question's record has fields of the wrong type; it cannot be shown") from None
        if found is None:
            raise HTTPException(404, "no such question or sample")
        return found

    # ``:path``: an id may hold "/" (the page sends it %2F-encoded, which the server decodes before routing)
    @app.get("/api/runs/{run_id}/items/{dataset}/{item_id:path}")
    async def item(run_id: str, dataset: str, item_id: str, sample: int = 0):
        return await answer(item_of, run_of(run_id, "eval"), dataset, item_id, sample)

    @app.get("/api/compare")
    async def compare_runs(a: str, b: str):
        run_a, run_b = run_of(a, "eval"), run_of(b, "eval")
        return await answer(compare_or_409, run_a, run_b)

    def compare_or_409(run_a: Run, run_b: Run) -> dict[str, Any]:
        try:
            return compare(run_a, run_b)
        except NotComparable as e:
            raise HTTPException(409, str(e)) from None

    def summary_of(a: str, b: str, run_a: Run, run_b: Run) -> dict[str, Any]:
        try:
            found = pair_summary(run_a.label, run_a.path, run_b.label, run_b.path)
        except NotComparable as e:
            raise HTTPException(409, str(e)) from None
        return {"a": a, "b": b, "label_a": run_a.label, "label_b": run_b.label, **found}

    @app.get("/api/summary")
    async def summary(a: str, b: str):
        """EM of A and B, B - A and its paired interval, by the report's code (:mod:`app.viewer.summary`)."""
        return await answer(summary_of, a, b, run_of(a, "eval"), run_of(b, "eval"))

    app.state.workers = workers

    return app


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="emapg view", description="A local, read-only web page over training runs, eval runs "
                                "and demo folders: curves, trajectories, eval items, two evaluations compared.")
    add_config_arguments(p, ViewConfig, positional=("runs",))
    return p


def main(argv: list[str]) -> int:
    import uvicorn

    from emapg.connection_guard import MAX_HEAD_BYTES, guarded_protocol
    from emapg.servers import is_loopback

    cfg = config_from_args(ViewConfig, parser().parse_args(argv))
    if not cfg.runs:
        raise ConfigError("give at least one run folder")
    if not is_loopback(cfg.host) and not cfg.insecure:
        raise ConfigError(f"refusing to serve {cfg.host}: the viewer has no authentication; bind 127.0.0.1 or pass --insecure")
    runs = open_runs(cfg.runs)
    hosts = None if is_loopback(cfg.host) else ["*"]
    app = create_app(runs, allowed_hosts=hosts)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                            http=guarded_protocol(HEADER_TIMEOUT_S, MAX_IDLE_CONNECTIONS), h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                            timeout_graceful_shutdown=SHUTDOWN_S)
    server = uvicorn.Server(config)
    address = f"[{cfg.host}]" if ":" in cfg.host else cfg.host

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else cfg.port
        url = f"http://{address}:{port}/"
        kinds = ", ".join(f"{r.label} ({r.kind})" for r in runs)
        print(f"emapg view: {url}  -- {kinds}  (Ctrl-C stops)", file=sys.stderr, flush=True)
        if cfg.open_browser:
            import webbrowser

            webbrowser.open(url)

    async def serve() -> None:
        watcher = asyncio.create_task(announce())
        try:
            await server.serve()
        finally:
            watcher.cancel()

    asyncio.run(serve())
    code = 0 if server.started else 1
    workers = app.state.workers
    pending = workers.stats()["pending"]
    workers.close()
    if pending:  # answers still being built in threads nobody waits for: do not let them hold the exit
        print(f"emapg view: stopped, abandoning {pending} answer(s) still being built", file=sys.stderr, flush=True)
        os._exit(code)
    return code
