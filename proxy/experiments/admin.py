"""GET /admin/experiments: every experiment's arms, weights, window aggregates, totals and action history.

Read-only, like /admin/backends. `?timeline=1` adds the per-evaluation timeline (weights and readings of
every arm at each guardrail pass), which loadtest/guardrail_demo.py turns into its report.
"""

from __future__ import annotations

import json

from aiohttp import web

from proxy.experiments.runtime import ExperimentRuntime


def add_experiment_routes(app: web.Application, runtime: ExperimentRuntime) -> None:
    async def get_experiments(request: web.Request) -> web.Response:
        timeline = request.query.get("timeline", "") not in ("", "0", "false")
        return web.json_response(runtime.as_json(timeline=timeline), dumps=lambda o: json.dumps(o, indent=1))

    app.router.add_get("/admin/experiments", get_experiments)
