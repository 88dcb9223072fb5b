"""The sidecar's own HTTP endpoints: /healthz, /metrics, /incidents, /report.

Metrics are prometheus-client objects made from the table in kvdoctor/sidecar/exported.py, on a
registry of our own (so tests and several agents in one process do not collide).
"""
from __future__ import annotations

import asyncio
import hmac
from typing import Any, Callable

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .exported import METRICS


class Metrics:
    """kvdoctor_* metrics by name: ``metrics["kvdoctor_ttft_seconds"].labels(quantile="0.99").set(x)``."""

    def __init__(self) -> None:
        disable_created_metrics()  # *_created series only confuse dashboards of a sidecar
        self.registry = CollectorRegistry()
        self._m: dict[str, Any] = {}
        for m in METRICS:
            cls = Counter if m.kind == "counter" else Gauge
            name = m.name.removesuffix("_total") if m.kind == "counter" else m.name
            self._m[m.name] = cls(name, m.doc, labelnames=m.labels, registry=self.registry)

    def __getitem__(self, name: str) -> Any:
        return self._m[name]

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


#: /report's page goes out in slices of this size (one memcpy into the socket ~20 us each)
REPORT_SLICE_BYTES = 256 << 10


def bearer_auth(token: str | None):
    """Middleware: with a token, every path but /healthz needs ``Authorization: Bearer TOKEN``
    (the sidecar's endpoints and `kvdoctor oncall`'s)."""
    @web.middleware
    async def auth(request: web.Request, handler):
        if token and request.path != "/healthz":
            scheme, _, got = request.headers.get("Authorization", "").strip().partition(" ")
            # the scheme is case-insensitive (RFC 9110 11.1); the token compared in constant time
            ok = scheme.lower() == "bearer" and hmac.compare_digest(got.strip().encode("utf-8", "replace"), token.encode())
            if not ok:
                return web.json_response({"error": "missing or wrong bearer token"}, status=401,
                                         headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)
    return auth


def make_app(metrics: Metrics, incidents: Callable[[], list[dict[str, Any]]], health: Callable[[], dict[str, Any]],
             report_page: Callable[[], Any] | None = None, token: str | None = None) -> web.Application:

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response(health(), dumps=lambda o: orjson.dumps(o).decode())

    async def metrics_handler(_request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def incidents_handler(_request: web.Request) -> web.Response:
        return web.json_response({"incidents": incidents()}, dumps=lambda o: orjson.dumps(o).decode())

    async def report_handler(request: web.Request) -> web.Response:
        # loading, diagnosing and rendering a capture takes seconds: never on the loop the proxy
        # relays on; the page comes as bytes (gzipped too), so the loop only writes it out
        page = await asyncio.get_running_loop().run_in_executor(None, report_page) if report_page else None
        if page is None:
            return web.Response(status=503, text="no report yet: the sidecar has not captured enough to report\n")
        headers = {"Content-Type": "text/html; charset=utf-8", "Vary": "Accept-Encoding"}
        body = page.html_utf8
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            body, headers["Content-Encoding"] = page.html_gzip, "gzip"
        # written in slices, each once the last has drained: the page is ~5 MB uncompressed, and
        # one write of it is one copy of 5 MB into the socket on the loop the proxy relays on
        resp = web.StreamResponse(headers=headers)
        resp.content_length = len(body)
        await resp.prepare(request)
        view = memoryview(body)
        for i in range(0, len(body), REPORT_SLICE_BYTES):
            await resp.write(view[i:i + REPORT_SLICE_BYTES])
        await resp.write_eof()
        return resp

    app = web.Application(middlewares=[bearer_auth(token)])
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/incidents", incidents_handler)
    app.router.add_get("/report", report_handler)
    return app
