"""``emapg view RUN_DIR [RUN_DIR ...]``: the viewer's web app (FastAPI) and the command.

Read-only (GET only), bound to 127.0.0.1 by default, every asset from the package: the page and its script from
``app/viewer/static/``, plotly.js from the installed ``plotly`` wheel. The page builds its DOM from the JSON API with
text nodes only; the Content-Security-Policy below also forbids inline scripts, ``eval``, other origins and
framing, so even a rendering mistake could not run what a trajectory contains. The Host header must name this
machine (a DNS-rebinding page elsewhere cannot read the runs).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

from app.viewer.runs import OUTCOMES, Run, compare, filter_items, finite, open_runs
from emapg.config import ConfigError, add_config_arguments, config_from_args, option

STATIC = Path(__file__).resolve().parent / "static"
PAGES = ("/", "/curves", "/samples", "/eval", "/compare")
ASSETS = {"view.js": "text/javascript", "view.css": "text/css"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                    "X-Frame-Options": "DENY", "Cache-Control": "no-store"}
#: How many eval items one page of the table lists.
MAX_ITEMS = 500


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


def _number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return finite(value)


def plan_of(run: Run) -> dict[str, Any]:
    """``emapg plan``'s prediction beside the run's measured peak memory and step time (``{}`` without a plan)."""
    from trainer.plan.compare import plan_beside_measured

    return plan_beside_measured(run.path, run.metrics()) or {}


def create_app(runs: list[Run], *, allowed_hosts: list[str] | None = None):
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import FileResponse, JSONResponse, Response
    from starlette.middleware.trustedhost import TrustedHostMiddleware

    app = FastAPI(title="emapg view", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts or ["127.0.0.1", "localhost", "[::1]", "::1"])
    by_id = {r.id: r for r in runs}
    page = (STATIC / "index.html").read_bytes()
    bundle = plotly_js()

    @app.middleware("http")
    async def headers(request: Request, call_next):
        response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        return response

    def run_of(run_id: str, kind: str | None = None) -> Run:
        run = by_id.get(run_id)
        if run is None or (kind is not None and run.kind != kind):
            raise HTTPException(404, f"no {kind or ''} run {run_id!r}".replace("  ", " "))
        return run

    for path in PAGES:
        app.add_api_route(path, lambda: Response(page, media_type="text/html; charset=utf-8"), methods=["GET"])

    @app.get("/static/plotly.min.js")
    def plotly_bundle():
        return FileResponse(bundle, media_type="text/javascript")

    @app.get("/static/{name}")
    def asset(name: str):
        if name not in ASSETS:
            raise HTTPException(404, "no such asset")
        return FileResponse(STATIC / name, media_type=ASSETS[name])

    @app.get("/api/runs")
    def list_runs():
        return [r.summary() for r in runs]

    @app.get("/api/runs/{run_id}/metrics")
    def metrics(run_id: str, since: int = -1):
        run = run_of(run_id, "train")
        records = run.metrics()
        keys = sorted({k for r in records for k, v in r.items() if k != "step" and _number(v) is not None})
        rows = [{"step": int(r.get("step", 0)), **{k: _number(v) for k, v in r.items() if k != "step"}}
                for r in records if int(r.get("step", 0)) > since]
        guard = [{"step": e.get("step"), "action": str(e.get("action", "")), "reason": str(e.get("reason", ""))}
                 for e in run.guard_events()]
        return JSONResponse({"keys": keys, "records": rows, "guard": guard})

    @app.get("/api/runs/{run_id}/plan")
    def plan(run_id: str):
        return plan_of(run_of(run_id, "train"))

    @app.get("/api/runs/{run_id}/samples")
    def samples(run_id: str, step: int | None = None):
        run = run_of(run_id, "train")
        steps = run.sample_steps()
        if step is None:
            step = steps[-1] if steps else 0
        return {"steps": steps, "step": step, "samples": run.step_samples(step)}

    @app.get("/api/runs/{run_id}/items")
    def items(run_id: str, dataset: str | None = None, outcome: str | None = None, searches: int | None = None):
        run = run_of(run_id, "eval")
        if outcome and outcome not in OUTCOMES:
            raise HTTPException(422, f"outcome must be one of {', '.join(OUTCOMES)}")
        every = run.items()
        kept = filter_items(every, dataset=dataset or None, outcome=outcome or None, searches=searches)
        return {"datasets": run.datasets(), "total": len(every), "matching": len(kept), "items": kept[:MAX_ITEMS],
                "searches": sorted({i["searches"] for i in every})}

    @app.get("/api/runs/{run_id}/items/{dataset}/{item_id}")
    def item(run_id: str, dataset: str, item_id: str):
        found = run_of(run_id, "eval").item(dataset, item_id)
        if found is None:
            raise HTTPException(404, "no such question")
        return found

    @app.get("/api/compare")
    def compare_runs(a: str, b: str):
        return compare(run_of(a, "eval"), run_of(b, "eval"))

    return app


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="emapg view", description="A local, read-only web page over training runs, eval runs "
                                "and demo folders: curves, trajectories, eval items, two evaluations compared.")
    add_config_arguments(p, ViewConfig, positional=("runs",))
    return p


def main(argv: list[str]) -> int:
    import uvicorn

    from emapg.servers import is_loopback

    cfg = config_from_args(ViewConfig, parser().parse_args(argv))
    if not cfg.runs:
        raise ConfigError("give at least one run folder")
    if not is_loopback(cfg.host) and not cfg.insecure:
        raise ConfigError(f"refusing to serve {cfg.host}: the viewer has no authentication; bind 127.0.0.1 or pass --insecure")
    runs = open_runs(cfg.runs)
    hosts = None if is_loopback(cfg.host) else ["*"]
    app = create_app(runs, allowed_hosts=hosts)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    shown = f"[{cfg.host}]" if ":" in cfg.host else cfg.host

    async def announce() -> None:
        import asyncio

        while not server.started:
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else cfg.port
        url = f"http://{shown}:{port}/"
        kinds = ", ".join(f"{r.label} ({r.kind})" for r in runs)
        print(f"emapg view: {url}  -- {kinds}  (Ctrl-C stops)", file=sys.stderr, flush=True)
        if cfg.open_browser:
            import webbrowser

            webbrowser.open(url)

    async def serve() -> None:
        import asyncio

        watcher = asyncio.create_task(announce())
        try:
            await server.serve()
        finally:
            watcher.cancel()

    import asyncio

    asyncio.run(serve())
    return 0 if server.started else 1
