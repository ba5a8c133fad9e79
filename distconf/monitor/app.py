"""The Starlette application: the page, its static files, ``/api/v1/state``, ``/api/v1/schema``, ``/metrics``.

Handlers only read `Monitor.snapshot` (never the DHT), so every request answers at once
with the last good data and its age. The page and its scripts, styles and icon are files
of this package; the Content-Security-Policy forbids anything else (no other origin, no
inline script), so a hostile string in a record can never run as code in the browser.
"""

from __future__ import annotations

import json
import time
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from distconf.monitor.metrics import CONTENT_TYPE, render_metrics
from distconf.monitor.refresher import Monitor
from distconf.monitor.state_schema import SwarmStateV1

__all__ = ["DEFAULT_PAGE_SIZE", "LOOPBACK_HOSTS", "MAX_PAGE_SIZE", "STATIC_FILES", "build_app", "state_of"]

DEFAULT_PAGE_SIZE = 50
"""Servers listed per model when a request does not say (``servers_limit``)."""
MAX_PAGE_SIZE = 1000
"""Most servers listed per model in one response."""
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")
"""Host headers accepted when the monitor listens on loopback (a guard against DNS rebinding)."""

STATIC_FILES = {
    "monitor.js": "text/javascript; charset=utf-8",
    "monitor.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
"""Files served under ``/static/`` (nothing else is)."""

_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _asset(name: str) -> bytes:
    return resources.files("distconf.monitor").joinpath("static", name).read_bytes()


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise ValueError(f"{name} must be an integer in {low}..{high}")
    return int(raw)


def state_of(monitor: Monitor, *, model: str | None = None, offset: int = 0, limit: int = DEFAULT_PAGE_SIZE,
             now: float | None = None) -> SwarmStateV1:
    """The snapshot as a `SwarmStateV1`: servers ``offset..offset+limit-1`` of each model (or of ``model`` only)."""
    snap = monitor.snapshot
    now = time.time() if now is None else now
    models = [m.model_copy(update={"servers": m.servers[offset:offset + limit], "servers_offset": offset})
              for prefix, m in snap.models.items() if model is None or prefix == model]
    return SwarmStateV1(
        read_at=snap.read_at, age_seconds=None if snap.read_at is None else max(0.0, now - snap.read_at),
        refresh_seconds=monitor.refresh, refreshing=monitor.refreshing, error=snap.error, models=models,
        models_not_read=snap.models_not_read, skipped_listings=snap.skipped_listings,
    )


def build_app(monitor: Monitor, *, allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS,
              manage: bool = True) -> Starlette:
    """The ASGI app serving ``monitor``'s snapshots.

    :param allowed_hosts: Host headers accepted (None: any, for a monitor bound to a
        public address on purpose).
    :param manage: start the monitor's thread with the app and stop it on shutdown.
    """
    page = _asset("index.html")
    assets = {name: (_asset(name), media) for name, media in STATIC_FILES.items()}
    schema = json.dumps(SwarmStateV1.model_json_schema(), indent=1).encode()

    async def index(_: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_SECURITY_HEADERS)

    async def static(request: Request) -> Response:
        found = assets.get(request.path_params["name"])
        if found is None:
            return PlainTextResponse("not found", status_code=404)
        return Response(found[0], media_type=found[1], headers={**_SECURITY_HEADERS, "Cache-Control": "max-age=60"})

    async def state(request: Request) -> Response:
        try:
            offset = _int_param(request, "servers_offset", 0, 0, 10**9)
            limit = _int_param(request, "servers_limit", DEFAULT_PAGE_SIZE, 0, MAX_PAGE_SIZE)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        body = state_of(monitor, model=request.query_params.get("model"), offset=offset, limit=limit)
        return Response(body.model_dump_json(), media_type="application/json",
                        headers={**_SECURITY_HEADERS, "Cache-Control": "no-store"})

    async def schema_json(_: Request) -> Response:
        return Response(schema, media_type="application/json", headers=_SECURITY_HEADERS)

    async def metrics(_: Request) -> Response:
        return Response(render_metrics(monitor), media_type=CONTENT_TYPE, headers={"Cache-Control": "no-store"})

    @asynccontextmanager
    async def lifespan(_: Any):
        if manage:
            monitor.start()
        try:
            yield
        finally:
            if manage:
                monitor.stop()

    routes = [
        Route("/", index), Route("/static/{name}", static), Route("/api/v1/state", state),
        Route("/api/v1/schema", schema_json), Route("/metrics", metrics),
    ]
    middleware = [] if allowed_hosts is None else [Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))]
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
