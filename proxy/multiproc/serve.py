"""All cores: one control plane (supervisor) and N data-plane worker processes sharing the listeners.

Python runs one core per process, so `affinity-proxy run --workers N` starts N data-plane processes that
each bind the same listener addresses with SO_REUSEPORT; the kernel spreads incoming connections over
them. Everything that talks to the fleet on the proxy's own schedule stays ONCE, in the supervisor:
telemetry polling, active health checks, DNS discovery, reload and the admin API. The supervisor publishes
each new versioned `Snapshot` to every worker over a private socketpair (length-prefixed pickle), and the
workers apply it to their own `SnapshotStore`. So a fleet of B backends is scraped B times per interval,
not N x B, and every worker routes on the same snapshot versions.

Why these choices:
- SO_REUSEPORT rather than one inherited listening socket: each worker has its own accept queue, so there
  is no thundering herd and no accept lock, and a worker that dies takes only its own queue with it. The
  supervisor binds each address first WITHOUT listening: that resolves port 0 to one real port for every
  worker and keeps the port reserved across worker restarts, while a socket that never listens is not in
  the kernel's reuseport group and so is never handed a connection it would not accept.
- Workers are fresh interpreters (`python -m proxy.multiproc.worker`), not forks of a process that runs an event
  loop and threads: nothing half-initialised is inherited, and a restarted worker is identical to the
  first one. The channel's file descriptor is the only thing passed down.
- Snapshots are coalesced per worker: a slow worker gets the newest snapshot, never a backlog of stale
  ones (only the latest matters to routing).
- Metrics: the supervisor merges the workers' registries at scrape time (see `merge_families`) instead of
  prometheus_client's multiprocess mode. Multiprocess mode needs PROMETHEUS_MULTIPROC_DIR set before any
  metric exists in every process, a shared writable directory (mmap files that grow with every restarted
  worker), and it cannot serve collector-based metrics, which `ProxyMetrics` uses for in-flight counts and
  snapshot state. Merging on scrape costs one round trip per worker every scrape interval and nothing on
  the request path. Counters of a worker that died are carried forward from its last scrape, so totals do
  not go backwards (what it counted after its last scrape is lost, as with any crashed exporter).
- Same prompt, same backend: every worker runs the same deterministic policy on the same snapshot (see
  deploy/README.md for exactly what is and is not shared between workers).
- One load for the whole host: in-flight requests, tokens and the work ledger's queued prefill live in a
  shared-memory block (proxy/multiproc/shared_load.py), one row per worker, so every worker's policy routes
  on all of the proxy's work (least_request, the bounded-load cap, the cost check, max_inflight limits and
  `limits.max_inflight_total` are proxy-wide, as in one process). A read sums the rows (a few hundred ns).
- What flows back up the channel keeps the control plane single: passive outcome reports (batched per
  event-loop turn) feed the supervisor's one outlier monitor; ORCA load reports (batched likewise) feed its
  telemetry poller, whose snapshots carry them to every worker; a data-plane `SnapshotStore.update` (the gRPC
  admin service) is forwarded as per-backend field changes (`WorkerStore`); and a reload's data-plane half
  (routing policy, retries, overload) goes down to every worker as `ApplyConfig`.
- A worker whose supervisor disappears (channel EOF) drains and exits rather than serve a frozen fleet.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from proxy.control.store import SnapshotStore
from proxy.core.snapshot import Snapshot
from proxy.gcsettings import tune_gc
from proxy.listen import reserve_port
from proxy.multiproc.shared_load import SharedLoad
from proxy.multiproc.supervisor import Supervisor

log = logging.getLogger("affinity_proxy.workers")


# ------------------------------------------------------------------------------------------ entry point


def data_listeners(config: Any) -> dict[str, tuple[str, int]]:
    listeners = {"http": (config.listen.host, config.listen.port)}
    if config.grpc_listen is not None:
        listeners["grpc"] = (config.grpc_listen.host, config.grpc_listen.port)
    return listeners


async def serve(config: Any, workers: int, config_path: str | None = None) -> None:
    """Supervisor + `workers` data-plane processes until SIGTERM/SIGINT, then drain everything."""
    from proxy.app import AffinityProxy, HostHooks

    load = SharedLoad.create(workers)
    inflight = load.table(None)
    store = SnapshotStore(Snapshot.initial(config.backend_specs()))

    # The supervisor and the control-plane proxy each take the other's hooks in their constructors; the
    # calls below reach the proxy through `proxy`, bound once it exists (before anything starts).
    def orca_reports(items: list[tuple[str, str]]) -> None:
        telemetry = proxy.telemetry
        if telemetry is not None:
            for name, header in items:
                telemetry.observe_orca(name, header)

    def outcomes(items: list[tuple[str, Any]]) -> None:
        monitor = proxy.resilience.monitor
        for name, outcome in items:
            if name in store.current:
                monitor.report(name, outcome)

    supervisor = Supervisor(
        config, store, workers, data_listeners(config), drain_s=config.timeouts.drain_s,
        on_outcomes=outcomes, inflight=inflight, reserve_port=reserve_port, load=load,
        on_orca=orca_reports if config.telemetry.enabled and config.telemetry.orca else None,
        # the host's heat map and hot spots: every worker's windows, merged
        on_windows=lambda windows: proxy.observer.ingest(windows),
    )
    proxy = AffinityProxy(
        config, role="control", config_path=config_path, store=store, inflight=inflight,
        host=HostHooks(
            render_metrics=supervisor.exposition, collectors=(supervisor.collect_own,),
            ready_checks=(supervisor.readiness_problems,), on_reload=(supervisor.apply_config,),
            adapter_demand=supervisor.take_adapter_demand,
        ),
    )
    tune_gc()  # the control plane is built: freeze what start-up made (proxy/gcsettings.py)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await supervisor.start()
        await proxy.start()
        urls = ", ".join(f"{name} {host}:{port}" for name, (host, port) in supervisor.listeners.items())
        log.info("affinity-proxy: %d workers serving %s; admin %s", workers, urls, proxy.admin_url)
        await stop.wait()
        log.info("signal received: draining %d workers for up to %.0f s", workers, config.timeouts.drain_s)
    finally:
        # The handlers stay in place while draining: a second SIGTERM (an impatient operator, a process
        # manager repeating itself) must not kill the supervisor and orphan its draining workers.
        await supervisor.stop()
        await proxy.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
