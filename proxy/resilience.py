"""The resilience subsystem of one proxy process: one object, one service.

It is given what it works on (the snapshot store, the in-flight table, the `Router` it reconfigures on
reload, the health monitor and overload queue the router was built with, the admin app to add its write
endpoints to, and a function that closes idle upstream connections); it never sees the application.

Control plane (roles "all" and "control"): health monitor + active checker, membership (joins and drains),
DNS discovery, hot reload (SIGHUP and file watch) and the admin write endpoints.
Data plane (roles "all" and "data"): retry controller, overload queue, panic view, in-flight limits and
passive outcome reports, all hooked into the protocol-neutral `Router` (proxy/dataplane/router.py) so every
protocol gets them.

With `--workers N` the data-plane processes get snapshots from the supervisor and cannot publish: they send
their passive outcome reports to the supervisor (batched per event-loop turn over the worker channel), whose
monitor ejects for the whole fleet, and they receive the data-plane half of every reload
(`apply_data_config`); see proxy/multiproc/serve.py.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any, Awaitable, Callable, Sequence, cast

from aiohttp import web

from proxy.config import Config
from proxy.control.checks import HealthChecker, HealthMonitor
from proxy.control.discovery import Discovery, split_services
from proxy.control.membership import Membership
from proxy.control.reload import Reloader
from proxy.control.resilience_metrics import ResilienceMetrics
from proxy.control.store import SnapshotStore
from proxy.core.admin_access import write_refusal
from proxy.core.decision import Policy
from proxy.core.overload import OverloadConfig, PanicView
from proxy.core.inflight import InflightTable
from proxy.core.routing_config import RoutingConfig
from proxy.core.snapshot import BackendSpec
from proxy.dataplane.admission import AdmissionQueue
from proxy.dataplane.retry import RetryController
from proxy.dataplane.router import Router
from proxy.tls import ClientTls

log = logging.getLogger("affinity_proxy.resilience")

# Sections that only take effect at start: a reload that changes them is applied for everything else and
# logs that these need a restart.
RESTART_ONLY = ("listen", "grpc_listen", "admin", "limits", "upstream", "telemetry", "debug_headers")


def restart_only_changes(old: Config, new: Config) -> list[str]:
    """The RESTART_ONLY sections a reload from `old` to `new` changes. The KV-event subscriber follows
    `telemetry.kv_events.backends` and `.tokenizers` at once (`proxy/control/kv_events.py`) while KV
    events stay on, so those two alone are not a telemetry change that waits for a restart."""
    told, tnew = old.telemetry, new.telemetry
    if told.kv_events.enabled and tnew.kv_events.enabled:
        told = replace(told, kv_events=replace(told.kv_events, backends=tnew.kv_events.backends,
                                               tokenizers=tnew.kv_events.tokenizers))
    changed = [name for name in RESTART_ONLY
               if (told != tnew if name == "telemetry" else getattr(old, name) != getattr(new, name))]
    # The precise index keeps eviction ages only when it was built with the placement rule on
    # (proxy/control/kv_events.py `build_precise_routing`): switching the rule on by a reload leaves it
    # abstaining until a restart.
    if (tnew.kv_events.enabled and old.routing.affinity.eviction_band_tokens <= 0 < new.routing.affinity.eviction_band_tokens):
        changed.append("routing.affinity.eviction_band_tokens")
    return changed


def panic_view(overload: OverloadConfig, monitor: HealthMonitor) -> PanicView:
    """Panic routing for the router: below the threshold of healthy backends, route to all of them."""
    return PanicView(overload.panic_threshold_percent, monitor.fleet.joining)


class Resilience:
    def __init__(
        self, config: Config, *, store: SnapshotStore, inflight: InflightTable, router: Router,
        monitor: HealthMonitor, queue: AdmissionQueue, metrics: ResilienceMetrics,
        build_policy: Callable[[RoutingConfig], Policy],
        close_idle: Callable[[BackendSpec], Awaitable[None]],
        control: bool = True, data: bool = True,
        admin_app: web.Application | None = None, admin_token: str | None = None,
        config_path: str | None = None, backend_tls: ClientTls | None = None,
        on_reload: Sequence[Callable[[Config], None]] = (),
    ) -> None:
        """`on_reload`: called with every configuration a reload swapped in (the --workers supervisor forwards
        it to its workers; the supervisor's experiment definitions follow it)."""
        self.config = config  # the configuration in force; a reload replaces it
        self.config_path = config_path
        self.store = store
        self.router = router
        self.metrics = metrics
        self.control = control
        self.data = data
        self._build_policy = build_policy
        cfg = config
        self.monitor = monitor
        self.checker = HealthChecker(store, self.monitor, tls=backend_tls)
        self.membership = Membership(
            store, self.monitor, inflight, drain_timeout_s=cfg.timeouts.drain_s,
            close_idle=close_idle, metrics=self.metrics,
        )
        static, services = split_services(cfg.backend_specs())
        self.discovery: Discovery | None = None
        if cfg.discovery.enabled:
            self.membership.seed("config", static)
            self.discovery = Discovery(self.membership, cfg.discovery, services)
        else:
            self.membership.seed("config", cfg.backend_specs())
        self.reloader: Reloader | None = None
        if config_path is not None:
            self.reloader = Reloader(config_path, self.apply_config, lambda: store.current.version,
                                     metrics=self.metrics)
        self.retries = RetryController(cfg.retries, metrics=self.metrics)
        self.queue = queue
        self._tasks: list[asyncio.Task[None]] = []
        self._on_reload = tuple(on_reload)
        if self.data:
            store.subscribe(lambda _s: self.queue.notify_all())
        if self.control and admin_app is not None:
            self._add_admin_routes(admin_app, admin_token, cfg.admin.host)

    # ------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if not self.control:
            return
        await self.checker.start()
        spawn = asyncio.get_running_loop().create_task
        self._tasks = [spawn(self.monitor.run_expiries(), name="outlier-expiry"),
                       spawn(self.membership.run(), name="drains")]
        if self.discovery is not None:
            self._tasks.append(spawn(self.discovery.run(), name="discovery"))
        if self.reloader is not None:
            self.reloader.install_signal()
            self._tasks.append(spawn(self.reloader.watch(), name="config-watch"))

    async def stop(self) -> None:
        if self.reloader is not None:
            self.reloader.remove_signal()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.control:
            await self.checker.stop()

    # ------------------------------------------------------------------------------------------ reload

    def apply_config(self, new: Config) -> int:
        """Swap in a validated config: backends, health, outliers, retries, overload, routing, discovery."""
        old = self.config
        restart = restart_only_changes(old, new)
        if restart:
            log.warning("reload: %s changed and take effect only after a restart", ", ".join(restart))
        self.monitor.reconfigure(new.health_checks, new.outlier_detection)
        self.apply_data_config(new)
        self.membership.drain_timeout_s = new.timeouts.drain_s
        if new.discovery.enabled:
            static, services = split_services(new.backend_specs())
            if self.discovery is None:
                self.discovery = Discovery(self.membership, new.discovery, services, at_startup=False)
                self._tasks.append(asyncio.get_running_loop().create_task(self.discovery.run(), name="discovery"))
            else:
                self.discovery.set_services(services, new.discovery)
        else:
            static = list(new.backend_specs())
            if self.discovery is not None:
                self.discovery.set_services([], new.discovery)
                self.membership.drop_source("discovery")
        snapshot = self.membership.set_source("config", static)
        self.config = new
        self.checker.refresh()
        for listener in self._on_reload:
            listener(new)
        return snapshot.version

    def apply_data_config(self, new: Config) -> None:
        """The data-plane half of a reload (retries, overload, routing). With --workers N the supervisor
        runs `apply_config` and each worker process this half, sent over its channel (proxy/multiproc/serve.py)."""
        old = self.config
        self.retries.reconfigure(new.retries)
        self.queue.cfg = new.overload
        policy = None
        if new.routing != old.routing:
            policy = self._build_policy(new.routing)
            log.info("reload: routing policy rebuilt (%s)", new.routing.policy)
        self.router.reconfigure(policy=policy, overload=new.overload, panic=panic_view(new.overload, self.monitor))
        if self.router.experiments is not None and new.experiments != old.experiments:
            self.router.experiments.reconfigure(new.experiments)  # unchanged arms keep their state
        self.config = new

    # ------------------------------------------------------------------------------------------ admin API

    def _add_admin_routes(self, app: web.Application, token: str | None, host: str) -> None:
        """POST /admin/backends/{name}/drain | /restore | /weight, POST /admin/reload, GET /admin/reload.

        Protected by the bearer token when one is configured. Without a token they answer only when the
        admin listener is bound to loopback: an exposed admin port must not let anyone drain the fleet.
        """
        def guard(handler: Any) -> Any:
            async def guarded(request: web.Request) -> web.StreamResponse:
                # The one admin rule, shared with the gRPC admin service (proxy/core/admin_access.py).
                refusal = write_refusal(token, host, request.headers.get("Authorization"))
                if refusal is None:
                    return cast(web.StreamResponse, await handler(request))
                if refusal.kind == "forbidden":
                    return _error(403, refusal.message, "forbidden")
                return _error(401, refusal.message, "unauthorized", error_type="authentication_error")

            return guarded

        store = self.store

        async def drain(request: web.Request) -> web.Response:
            name = request.match_info["name"]
            try:
                snap = self.membership.drain(name)
            except KeyError:
                return _error(404, f"no backend named {name!r}", "not_found")
            return web.json_response({"backend": name, "health": snap.get(name).health.value,  # type: ignore[union-attr]  # membership just returned a snapshot that holds it
                                      "version": snap.version})

        async def restore(request: web.Request) -> web.Response:
            name = request.match_info["name"]
            try:
                snap = self.membership.restore(name)
            except KeyError:
                return _error(404, f"no backend named {name!r}", "not_found")
            except ValueError as exc:
                return _error(409, str(exc), "conflict")
            return web.json_response({"backend": name, "health": snap.get(name).health.value,  # type: ignore[union-attr]  # membership just returned a snapshot that holds it
                                      "version": snap.version})

        async def weight(request: web.Request) -> web.Response:
            name = request.match_info["name"]
            try:
                body = await request.json()
            except ValueError:
                return _error(400, 'body must be JSON: {"weight": <number >= 0 or null>}', "invalid_json")
            value = body.get("weight", "missing") if isinstance(body, dict) else "missing"
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                return _error(400, '"weight" must be a number >= 0, or null to go back to the configured one',
                              "invalid_value", "weight")
            try:
                snap = self.membership.set_weight(name, None if value is None else float(value))
            except KeyError:
                return _error(404, f"no backend named {name!r}", "not_found")
            except (ValueError, OverflowError) as exc:  # set_weight applies the shared bound (core/bounds.py)
                return _error(400, str(exc), "invalid_value", "weight")
            b = snap.get(name)
            return web.json_response({"backend": name, "weight": b.effective_weight,  # type: ignore[union-attr]  # membership just returned a snapshot that holds it
                                      "version": snap.version})

        async def reload(request: web.Request) -> web.Response:
            if self.reloader is None:
                return _error(409, "the proxy was not started from a config file; nothing to reload", "no_config_file")
            result = await self.reloader.reload("admin")
            status = 200 if result.ok else 422
            return web.json_response({"ok": result.ok, "version": result.version, "errors": list(result.errors)},
                                     status=status)

        async def reload_status(request: web.Request) -> web.Response:
            r = self.reloader.last_result if self.reloader is not None else None
            return web.json_response({
                "config_path": self.config_path, "version": store.current.version,
                "last": None if r is None else {"ok": r.ok, "reason": r.reason, "version": r.version,
                                                "errors": list(r.errors)},
            })

        app.router.add_post("/admin/backends/{name}/drain", guard(drain))
        app.router.add_post("/admin/backends/{name}/restore", guard(restore))
        app.router.add_post("/admin/backends/{name}/weight", guard(weight))
        app.router.add_post("/admin/reload", guard(reload))
        app.router.add_get("/admin/reload", reload_status)
        app.router.add_get("/admin/health", self._health_report)

    async def _health_report(self, request: web.Request) -> web.Response:
        """Per backend: what the health machines believe and why (read-only, no token needed)."""
        return web.json_response({"version": self.store.current.version,
                                  "backends": self.monitor.fleet.describe(self.monitor.clock()),
                                  "retries": {"retried": self.retries.retried,
                                              "budget_requests": self.retries.budget.requests,
                                              "budget_retries": self.retries.budget.retries},
                                  "draining": sorted(self.membership.removing),
                                  "overload_queue": len(self.queue)})


def _error(status: int, message: str, code: str, param: str | None = None,
           error_type: str | None = None) -> web.Response:
    if error_type is None:
        error_type = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": error_type, "param": param, "code": code}},
                             status=status)


__all__ = ["Resilience", "panic_view"]
