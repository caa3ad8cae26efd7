"""Admin-listener routes: `/admin/hotspots`, `/dashboard` and the JSON it polls, `/dashboard/data`.

Mount with ``admin_app.add_routes(observability_routes(observer, fleet))``. `fleet` is a callable returning
the current routing snapshot in `proxy.admin.snapshot_json` form (``{"version": ..., "backends": [...]}``,
each backend with name, health, routable, load_score, stale, metrics_age_s, inflight_requests), so the page
shows exactly what `/admin/backends` shows. The per-backend hot-spot gauge is not a route: the Observer
registers it on the registry it was given, and `/metrics` serves it.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

from aiohttp import web

from proxy.observability.dashboard_page import PAGE
from proxy.observability.observer import Observer

FleetProvider = Callable[[], Mapping[str, Any]]

# The page may talk to its own origin only: nothing from a CDN could load even if a future edit added it.
_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src data:; base-uri 'none'; form-action 'none'")
_FLEET_KEYS = ("name", "health", "routable", "weight", "load_score", "stale", "metrics_age_s", "inflight_requests",
               "max_inflight")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def observability_routes(observer: Observer, fleet: FleetProvider) -> list[web.RouteDef]:
    page = PAGE.encode()

    async def get_hotspots(request: web.Request) -> web.Response:
        return web.json_response(observer.hotspots(), dumps=lambda o: json.dumps(o, indent=1))

    async def get_dashboard(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html", charset="utf-8",
                            headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-store"})

    async def get_data(request: web.Request) -> web.Response:
        snap = fleet()
        backends = [{k: b.get(k) for k in _FLEET_KEYS} for b in snap.get("backends", ())]
        body = {"version": snap.get("version"), "fleet": backends,
                "heatmap": observer.heatmap(b["name"] for b in backends), "hotspots": observer.hotspots()}
        return web.json_response(body, dumps=_dumps, headers={"Cache-Control": "no-store"})

    return [
        web.get("/admin/hotspots", get_hotspots),
        web.get("/dashboard", get_dashboard),
        web.get("/dashboard/data", get_data),
    ]
