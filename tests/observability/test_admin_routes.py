"""The admin routes mounted on a plain aiohttp app, as the integrator mounts them on the admin listener."""

from __future__ import annotations

import re

from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.admin import snapshot_json
from proxy.core.inflight import InflightTable
from proxy.core.snapshot import BackendSpec, Health, Snapshot
from proxy.observability.admin_routes import observability_routes
from proxy.observability.config import AccessLogConfig

from tests.observability.helpers import Clock, feed_fleet, make_observer

FLEET = ("gpu-0", "gpu-1", "gpu-2")


def make_app(clock: Clock):
    obs, _ = make_observer(clock, AccessLogConfig(enabled=False), registry=CollectorRegistry())
    snap = Snapshot.initial([BackendSpec(name=n, url=f"http://127.0.0.1:{8001 + i}") for i, n in enumerate(FLEET)])
    snap = snap.replace_backend("gpu-1", health=Health.HEALTHY, load_score=0.42, stale=False)
    inflight = InflightTable()
    app = web.Application()
    app.add_routes(observability_routes(obs, lambda: snapshot_json(snap, inflight)))
    return app, obs


async def test_hotspots_json_and_dashboard_data(aiohttp_client):
    clock = Clock()
    app, obs = make_app(clock)
    feed_fleet(obs, clock, windows=10, backends=FLEET)
    feed_fleet(obs, clock, windows=3, backends=FLEET, stalled="gpu-1", stall_from=0, stall_to=3, seed=4)
    client = await aiohttp_client(app)
    resp = await client.get("/admin/hotspots")
    assert resp.status == 200
    data = await resp.json()
    assert data["backends"]["gpu-1"]["latency_hot_spot"] is True
    assert data["backends"]["gpu-0"]["latency_hot_spot"] is False
    assert [e["backend"] for e in data["events"]] == ["gpu-1"] and data["rules"]["windows"] == 3
    resp = await client.get("/dashboard/data")
    body = await resp.json()
    assert body["heatmap"]["backends"] == list(FLEET) and len(body["heatmap"]["windows"]) == 90
    assert [b["name"] for b in body["fleet"]] == list(FLEET)
    gpu1 = body["fleet"][1]
    assert gpu1["health"] == "healthy" and gpu1["load_score"] == 0.42 and gpu1["stale"] is False
    assert body["heatmap"]["marks"][1][-2] == "hot"


async def test_dashboard_page_is_self_contained(aiohttp_client):
    app, _ = make_app(Clock())
    client = await aiohttp_client(app)
    resp = await client.get("/dashboard")
    assert resp.status == 200 and resp.content_type == "text/html"
    html = await resp.text()
    assert "default-src 'none'" in resp.headers["Content-Security-Policy"]
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "no external resources"
    assert "https://" not in html and "http://" not in html
    assert 'fetch("dashboard/data"' in html and "setTimeout(poll, 2000)" in html
