"""The admin listener: Prometheus `/metrics`, the routing snapshot, and a liveness probe.

It is a separate aiohttp Application on its own port (loopback by default) so that scraping and operator
calls never queue behind data-plane traffic and are never exposed on the public listener. Write endpoints
(drain, weight, reload: RESILIENCE) are added to `AffinityProxy.admin_app` before the proxy starts, and
should be wrapped with `require_token` so a configured bearer token protects them.
"""

from __future__ import annotations

import hmac
import json
import time
from typing import Any, Awaitable, Callable, Sequence

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.control.store import SnapshotStore
from proxy.core.snapshot import Snapshot
from proxy.core.inflight import InflightTable
from proxy.metrics import ProxyMetrics

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Readiness conditions beyond "this listener answers": each returns the reasons it is not ready (empty when
# ready). proxy/multiproc/serve.py adds "a data-plane worker is serving" in the supervisor.
ReadyCheck = Callable[[], list[str]]
READY_CHECKS = web.AppKey("ready_checks", list)


def snapshot_json(snapshot: Snapshot, inflight: InflightTable, now: float | None = None) -> dict[str, Any]:
    now = time.monotonic() if now is None else now  # signals carry time.monotonic() of their scrape
    backends = []
    for b in snapshot.backends:
        entry = inflight.get(b.name)
        s = b.signals
        backends.append(
            {
                "name": b.name,
                "url": b.spec.url,
                "grpc": b.spec.grpc_address,
                "models": list(b.spec.models),
                "weight": b.effective_weight,
                "health": b.health.value,
                "routable": b.routable,
                "load_score": b.load_score,
                "stale": b.stale,
                "metrics_age_s": None if s is None else round(max(0.0, now - s.scraped_at), 3),
                "inflight_requests": entry.requests if entry else 0,
                "inflight_tokens": entry.tokens if entry else 0,
                "max_inflight": b.spec.max_inflight,
                "signals": None if s is None else {
                    "engine": s.engine,
                    "running": s.running,
                    "waiting": s.waiting,
                    "kv_usage": s.kv_usage,
                    "kernel_queue": s.kernel_queue,
                    "mem_used_bytes": s.mem_used_bytes,
                    "mem_total_bytes": s.mem_total_bytes,
                    "kv_tokens_per_s": s.kv_tokens_per_s,
                    "kv_capacity_tokens": s.kv_capacity_tokens,
                    "latency_ms": s.latency_ms,
                    "qps": s.qps,
                    "gpu_utilization": s.gpu_utilization,
                    "loaded_adapters": sorted(s.loaded_adapters),
                },
            }
        )
    return {"version": snapshot.version, "backends": backends}


def require_token(token: str | None, handler: Handler) -> Handler:
    """Wrap a write endpoint: with a token configured, demand `Authorization: Bearer <token>`."""
    if token is None:
        return handler
    expected = f"Bearer {token}".encode()

    async def guarded(request: web.Request) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return web.json_response(
                {"error": {"message": "missing or wrong bearer token", "type": "authentication_error",
                           "param": None, "code": "unauthorized"}},
                status=401,
            )
        return await handler(request)

    return guarded


def build_admin_app(
    store: SnapshotStore, inflight: InflightTable, metrics: ProxyMetrics,
    ready_checks: Sequence[Callable[[], list[str]]] = (),
) -> web.Application:
    """`ready_checks`: more reasons /readyz may answer 503 (the --workers supervisor: workers not ready)."""
    app = web.Application()
    app[READY_CHECKS] = list(ready_checks)

    async def get_metrics(request: web.Request) -> web.Response:
        return web.Response(body=await metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def get_backends(request: web.Request) -> web.Response:
        return web.json_response(snapshot_json(store.current, inflight), dumps=lambda o: json.dumps(o, indent=1))

    async def get_health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": store.current.version})

    async def get_ready(request: web.Request) -> web.Response:
        # Deliberately not tied to backend health: every replica sees the same fleet, so failing readiness
        # on a fleet outage would pull all of them out of the Service and turn clear 503 answers into
        # refused connections.
        problems = [p for check in request.app[READY_CHECKS] for p in check()]
        snap = store.current
        return web.json_response(
            {"status": "not ready" if problems else "ready", "problems": problems, "version": snap.version,
             "routable_backends": len(snap.routable())},
            status=503 if problems else 200,
        )

    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/admin/backends", get_backends)
    app.router.add_get("/healthz", get_health)
    app.router.add_get("/readyz", get_ready)
    return app
