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
- Workers are fresh interpreters (`python -m proxy.multiproc.serve`), not forks of a process that runs an event
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
- What flows back up the channel keeps the control plane single: passive outcome reports (batched per
  event-loop turn) feed the supervisor's one outlier monitor; a data-plane `SnapshotStore.update` (the gRPC
  admin service) is forwarded as per-backend field changes (`WorkerStore`); and a reload's data-plane half
  (routing policy, retries, overload) goes down to every worker as `ApplyConfig`.
- A worker whose supervisor disappears (channel EOF) drains and exits rather than serve a frozen fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import os
import pickle
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from proxy.control.store import SnapshotStore
from proxy.core.decision import Inflight
from proxy.core.snapshot import Snapshot
from proxy.core.inflight import InflightTable
from proxy.listen import reserve_port

log = logging.getLogger("affinity_proxy.workers")

# ------------------------------------------------------------------------------------------ CPU count


def default_worker_count() -> int:
    """CPUs this process may really use: the affinity mask, capped by a cgroup CPU quota.

    `os.cpu_count()` reports the host's cores; in a container limited to 2 CPUs on a 64-core node that would
    start 64 workers fighting over 2 CPUs of quota. Kubernetes expresses CPU limits as a CFS quota, so read
    it (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`/`cpu.cfs_period_us`) and round up.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    try:
        with open(os.path.join(root, "cpu.max"), encoding="ascii") as fh:
            limit, period = fh.read().split()[:2]
        return None if limit == "max" else int(limit) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us"), encoding="ascii") as fh:
            quota = int(fh.read().strip())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us"), encoding="ascii") as fh:
            period = int(fh.read().strip())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------------ listeners


# ------------------------------------------------------------------------------------------ channel

_FRAME = struct.Struct("!I")
# How stale the supervisor's view of the workers' in-flight work may be (admin API, drain completion).
INFLIGHT_REPORT_S = 0.1


def encode_message(message: object) -> bytes:
    """Length-prefixed pickle. Only ever between the supervisor and its own children on a socketpair."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _FRAME.pack(len(data)) + data


def write_message(writer: asyncio.StreamWriter, message: object) -> None:
    writer.write(encode_message(message))


async def read_message(reader: asyncio.StreamReader) -> object:
    (size,) = _FRAME.unpack(await reader.readexactly(_FRAME.size))
    return pickle.loads(await reader.readexactly(size))


@dataclass(frozen=True)
class WorkerInit:
    """The first message to a worker: everything it needs, so it never reads the config file itself (the
    file may have changed since the supervisor validated it)."""

    index: int
    config: Any  # proxy.config.Config
    listeners: dict[str, tuple[str, int]]  # listener name -> (host, resolved port)
    snapshot: Snapshot


@dataclass(frozen=True)
class WorkerReady:
    index: int
    pid: int


@dataclass(frozen=True)
class PublishSnapshot:
    snapshot: Snapshot


@dataclass(frozen=True)
class ApplyConfig:
    """A reloaded, validated configuration: the worker applies its data-plane half (retries, overload,
    routing policy). Backend membership arrives as snapshots, like every other fleet change."""

    config: Any


@dataclass(frozen=True)
class Outcomes:
    """Passive outcome reports (backend name, proxy.core.health.Outcome) from a worker's requests, for the
    supervisor's outlier detection: one monitor sees the whole proxy's traffic, so a backend failing on
    every worker is ejected as fast as in a single process, and ejection is one fleet-wide decision."""

    items: list[tuple[str, Any]]


@dataclass(frozen=True)
class BackendChanges:
    """Per-backend field changes a worker's data plane made with `SnapshotStore.update` (the gRPC admin
    service's weight and drain calls), for the supervisor to apply to the one authoritative snapshot."""

    changes: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class InflightReport:
    """A worker's in-flight requests and tokens per backend, sent when they changed (at most every
    INFLIGHT_REPORT_S). The supervisor keeps their sum in its own InflightTable, which the admin API shows
    and which tells a draining backend's removal when the whole proxy's work on it is done."""

    counts: dict[str, tuple[int, int]]


@dataclass(frozen=True)
class CollectMetrics:
    seq: int


@dataclass(frozen=True)
class MetricsReply:
    seq: int
    families: list[FamilyData]


# ------------------------------------------------------------------------------------------ metrics


@dataclass(frozen=True)
class FamilyData:
    """A metric family as plain, picklable data."""

    name: str
    type: str
    documentation: str
    unit: str
    samples: tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]


def families_of(registry: CollectorRegistry) -> list[FamilyData]:
    out: list[FamilyData] = []
    for metric in registry.collect():
        out.append(
            FamilyData(
                name=metric.name,
                type=metric.type,
                documentation=metric.documentation,
                unit=metric.unit,
                samples=tuple((s.name, tuple(sorted(s.labels.items())), float(s.value)) for s in metric.samples),
            )
        )
    return out


# Gauges whose per-process values add up to the proxy's value (the rest describe shared state and are
# taken from the supervisor, which owns the snapshot and mirrors the workers' in-flight sums). Keep in step
# with proxy/metrics.py.
SUMMED_GAUGES = frozenset(
    {
        "affinity_proxy_upstream_requests",
        "affinity_proxy_upstream_connections_opened",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
    }
)
# Gauges that count up (exposed as gauges because they are read from plain integers at scrape time): like
# counters, a dead worker's last value is carried forward.
MONOTONIC_GAUGES = frozenset({"affinity_proxy_upstream_requests", "affinity_proxy_upstream_connections_opened"})
_MONOTONIC_TYPES = frozenset({"counter", "histogram", "summary", "gaugehistogram"})


def _monotonic(family: FamilyData) -> bool:
    return family.type in _MONOTONIC_TYPES or family.name in MONOTONIC_GAUGES


SampleKey = tuple[str, tuple[tuple[str, str], ...]]


def _is_created(sample_name: str, family: FamilyData) -> bool:
    return family.type != "gauge" and sample_name.endswith("_created")


def merge_families(
    own: Sequence[FamilyData],
    workers: Sequence[Sequence[FamilyData]],
    retired: dict[str, dict[SampleKey, float]] | None = None,
) -> list[Metric]:
    """One exposition for the whole proxy from the supervisor's and every worker's families.

    Counters, histograms and summaries add up (and `retired`, the carried-forward totals of dead workers,
    is added to them); `*_created` takes the earliest. Gauges in SUMMED_GAUGES add up; any other gauge is
    the supervisor's value when it has one (it owns the shared state, such as the snapshot), else the
    highest worker value. The connection reuse ratio is recomputed from the summed counts.
    """
    retired = retired or {}
    meta: dict[str, FamilyData] = {}
    values: dict[str, dict[SampleKey, float]] = {}
    from_own: set[tuple[str, SampleKey]] = set()
    order: list[str] = []

    def add(family: FamilyData, is_own: bool) -> None:
        if family.name not in meta:
            meta[family.name] = family
            values[family.name] = {}
            order.append(family.name)
        acc = values[family.name]
        summed = family.type != "gauge" or family.name in SUMMED_GAUGES
        for name, labels, value in family.samples:
            key = (name, labels)
            if key not in acc:
                acc[key] = value
                if is_own and not summed:
                    from_own.add((family.name, key))
            elif _is_created(name, family):
                acc[key] = min(acc[key], value)
            elif summed:
                acc[key] += value
            elif (family.name, key) not in from_own:
                acc[key] = max(acc[key], value)

    for family in own:
        add(family, True)
    for families in workers:
        for family in families:
            add(family, False)
    for name, carried in retired.items():
        if name not in values:
            continue
        acc = values[name]
        for key, value in carried.items():
            acc[key] = acc.get(key, 0.0) + value

    ratio = "affinity_proxy_upstream_connection_reuse_ratio"
    if ratio in values:
        requests = sum(values.get("affinity_proxy_upstream_requests", {}).values())
        opened = sum(values.get("affinity_proxy_upstream_connections_opened", {}).values())
        values[ratio] = {(ratio, ()): max(0.0, 1.0 - opened / requests) if requests else 0.0}

    out: list[Metric] = []
    for name in order:
        family = meta[name]
        metric = Metric(family.name, family.documentation, family.type, family.unit)
        for (sample_name, labels), value in values[name].items():
            metric.add_sample(sample_name, dict(labels), value)
        out.append(metric)
    return out


def retire(families: Sequence[FamilyData], into: dict[str, dict[SampleKey, float]]) -> None:
    """Carry a dead worker's monotonic totals forward, so merged counters never go backwards."""
    for family in families:
        if not _monotonic(family):
            continue
        carried = into.setdefault(family.name, {})
        for name, labels, value in family.samples:
            if _is_created(name, family):
                continue
            carried[(name, labels)] = carried.get((name, labels), 0.0) + value


class _ListCollector:
    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self._metrics


def render(metrics: list[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ListCollector(metrics))  # type: ignore[arg-type]
    return generate_latest(registry)


# ------------------------------------------------------------------------------------------ supervisor


@dataclass
class _Worker:
    """One worker slot: its process (restarted in place) and its half of the channel."""

    index: int
    proc: asyncio.subprocess.Process | None = None
    writer: asyncio.StreamWriter | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    pending: Snapshot | None = None  # newest snapshot not yet written (coalesced)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    last_families: list[FamilyData] = field(default_factory=list)
    restarts: int = 0
    started_at: float = 0.0
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)


class Supervisor:
    """Starts, feeds, watches and restarts the data-plane workers of one proxy.

    It owns no request path: the control plane it runs beside (the caller's) publishes snapshots to
    `store`, and the supervisor forwards each one to every worker.
    """

    RESTART_BACKOFF_MIN_S = 0.1
    RESTART_BACKOFF_MAX_S = 5.0
    # A worker that lived this long is healthy again: its next crash restarts at once.
    STABLE_AFTER_S = 30.0
    METRICS_TIMEOUT_S = 2.0

    def __init__(
        self,
        config: Any,
        store: SnapshotStore,
        workers: int,
        listeners: dict[str, tuple[str, int]],
        *,
        drain_s: float,
        python: str = sys.executable,
        on_outcomes: Callable[[list[tuple[str, Any]]], None] | None = None,
        inflight: InflightTable | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.count = workers
        self.drain_s = drain_s
        self._python = python
        self._requested = listeners
        self._reserved: list[socket.socket] = []
        self.listeners: dict[str, tuple[str, int]] = {}
        self._workers = [_Worker(index=i) for i in range(workers)]
        self._stopping = False
        self._starting = False
        self._start_failure: asyncio.Future[None] | None = None
        self._seq = 0
        self._replies: dict[tuple[int, int], asyncio.Future[list[FamilyData]]] = {}
        self.retired: dict[str, dict[SampleKey, float]] = {}
        self.on_outcomes = on_outcomes
        self.inflight = inflight if inflight is not None else InflightTable()
        self._inflight_reports: dict[int, dict[str, tuple[int, int]]] = {}
        self.restarts_total = 0
        # The newest snapshot's frame, pickled once for all workers (pickling a 256-backend snapshot takes
        # ~1 ms here; per worker it would be N of those every telemetry interval).
        self._encoded: tuple[Snapshot, bytes] | None = None
        store.subscribe(self._on_snapshot)

    # -- lifecycle

    async def start(self, ready_timeout_s: float = 60.0) -> None:
        """Reserve the ports, start every worker and wait until all of them listen."""
        for name, (host, port) in self._requested.items():
            sock = reserve_port(host, port)
            self._reserved.append(sock)
            self.listeners[name] = (host, sock.getsockname()[1])
        # A worker that exits before every worker is ready (a port it cannot bind, a broken install) fails
        # the start at once instead of being restarted in a loop.
        self._starting = True
        self._start_failure = asyncio.get_running_loop().create_future()
        for worker in self._workers:
            await self._spawn(worker)
        all_ready = asyncio.ensure_future(asyncio.gather(*(w.ready.wait() for w in self._workers)))
        try:
            done, _ = await asyncio.wait(
                [all_ready, self._start_failure], timeout=ready_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if self._start_failure in done:
                self._start_failure.result()
            if all_ready not in done:
                raise RuntimeError(f"workers not ready after {ready_timeout_s:.0f} s")
        except BaseException:
            all_ready.cancel()
            await self.stop()
            raise
        finally:
            self._starting = False

    async def stop(self) -> None:
        """SIGTERM every worker (each drains its own connections), SIGKILL what outlives the drain."""
        self._stopping = True
        procs = [w.proc for w in self._workers if w.proc is not None and w.proc.returncode is None]
        for proc in procs:
            _signal(proc, signal.SIGTERM)
        if procs:
            done, pending = await asyncio.wait(
                [asyncio.ensure_future(p.wait()) for p in procs], timeout=self.drain_s + 5.0
            )
            for proc in procs:
                if proc.returncode is None:
                    log.warning("worker pid %d outlived the drain deadline: killing it", proc.pid)
                    _signal(proc, signal.SIGKILL)
            if pending:
                await asyncio.wait(pending, timeout=5.0)
        for worker in self._workers:
            for task in worker.tasks:
                task.cancel()
            if worker.writer is not None:
                worker.writer.close()
        for sock in self._reserved:
            sock.close()

    def ready_count(self) -> int:
        return sum(1 for w in self._workers if w.ready.is_set())

    def _sum_inflight(self) -> None:
        totals: dict[str, list[int]] = {}
        for counts in self._inflight_reports.values():
            for name, (requests, tokens) in counts.items():
                acc = totals.setdefault(name, [0, 0])
                acc[0] += requests
                acc[1] += tokens
        table = self.inflight
        for name in list(table):
            if name not in totals:
                entry = table[name]
                entry.requests = entry.tokens = 0
        for name, (requests, tokens) in totals.items():
            entry = table.get(name)
            if entry is None:
                entry = table[name] = Inflight()
            entry.requests, entry.tokens = requests, tokens
        table.total_requests = sum(r for r, _ in totals.values())

    def _apply_changes(self, changes: dict[str, dict[str, Any]]) -> None:
        def change(snapshot: Snapshot) -> Snapshot:
            backends = []
            for b in snapshot.backends:
                fields = changes.get(b.name)
                backends.append(dataclasses.replace(b, **fields) if fields else b)
            return snapshot.evolve(backends)

        if any(name in self.store.current for name in changes):
            self.store.update(change)

    def apply_config(self, config: Any) -> None:
        """Forward a reloaded configuration; workers started later get it in their WorkerInit."""
        self.config = config
        for worker in self._workers:
            if worker.writer is not None and worker.ready.is_set():
                write_message(worker.writer, ApplyConfig(config))

    def readiness_problems(self) -> list[str]:
        """For /readyz: the pod serves while any worker listens. A dead worker's socket leaves the reuseport
        group with it, so new connections only reach live workers; failing readiness while one of N restarts
        would only make the Service's endpoints flap."""
        if self.ready_count() == 0:
            return [f"none of {self.count} workers is serving"]
        return []

    def collect_own(self) -> Iterable[Metric]:
        ready = GaugeMetricFamily("affinity_proxy_workers", "Data-plane worker processes, by state.", labels=["state"])
        ready.add_metric(["ready"], self.ready_count())
        ready.add_metric(["starting"], self.count - self.ready_count())
        yield ready
        restarts = CounterMetricFamily(
            "affinity_proxy_worker_restarts", "Data-plane workers restarted after they died."
        )
        restarts.add_metric([], self.restarts_total)
        yield restarts

    # -- one worker

    async def _spawn(self, worker: _Worker) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            worker.proc = await asyncio.create_subprocess_exec(
                self._python, "-m", "proxy.multiproc.serve", "--channel-fd", str(child.fileno()),
                "--index", str(worker.index), "--log-level", str(logging.getLogger().getEffectiveLevel()),
                pass_fds=(child.fileno(),),
            )
        finally:
            child.close()
        worker.started_at = time.monotonic()
        worker.ready.clear()
        reader, writer = await asyncio.open_unix_connection(sock=parent)
        worker.writer = writer
        write_message(
            writer,
            WorkerInit(index=worker.index, config=self.config, listeners=self.listeners, snapshot=self.store.current),
        )
        worker.tasks = [
            asyncio.create_task(self._read_loop(worker, reader), name=f"worker-{worker.index}-read"),
            asyncio.create_task(self._write_loop(worker, writer), name=f"worker-{worker.index}-write"),
            asyncio.create_task(self._watch(worker, worker.proc), name=f"worker-{worker.index}-watch"),
        ]

    async def _read_loop(self, worker: _Worker, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await read_message(reader)
                if isinstance(message, WorkerReady):
                    log.info("worker %d ready (pid %d)", message.index, message.pid)
                    worker.ready.set()
                    # Whatever was published while it started up.
                    self._queue(worker, self.store.current)
                elif isinstance(message, InflightReport):
                    self._inflight_reports[worker.index] = message.counts
                    self._sum_inflight()
                elif isinstance(message, BackendChanges):
                    self._apply_changes(message.changes)
                elif isinstance(message, Outcomes):
                    if self.on_outcomes is not None:
                        self.on_outcomes(message.items)
                elif isinstance(message, MetricsReply):
                    future = self._replies.pop((worker.index, message.seq), None)
                    if future is not None and not future.done():
                        future.set_result(message.families)
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    async def _write_loop(self, worker: _Worker, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await worker.wakeup.wait()
                worker.wakeup.clear()
                snapshot, worker.pending = worker.pending, None
                if snapshot is not None:
                    writer.write(self._frame(snapshot))
                    await writer.drain()
        except ConnectionError:
            return

    def _frame(self, snapshot: Snapshot) -> bytes:
        if self._encoded is None or self._encoded[0] is not snapshot:
            self._encoded = (snapshot, encode_message(PublishSnapshot(snapshot)))
        return self._encoded[1]

    def _queue(self, worker: _Worker, snapshot: Snapshot) -> None:
        worker.pending = snapshot
        worker.wakeup.set()

    def _on_snapshot(self, snapshot: Snapshot) -> None:
        for worker in self._workers:
            if worker.ready.is_set():
                self._queue(worker, snapshot)

    async def _watch(self, worker: _Worker, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if self._stopping:
            return
        if self._starting:
            if self._start_failure is not None and not self._start_failure.done():
                self._start_failure.set_exception(
                    RuntimeError(f"worker {worker.index} exited with {code} during start-up")
                )
            return
        log.error("worker %d (pid %d) exited with %s: restarting", worker.index, proc.pid, code)
        worker.ready.clear()
        if self._inflight_reports.pop(worker.index, None) is not None:
            self._sum_inflight()  # its requests died with it
        for (index, seq), future in list(self._replies.items()):
            if index == worker.index:  # a scrape waiting on the dead worker need not wait for its timeout
                del self._replies[(index, seq)]
                future.cancel()
        retire(worker.last_families, self.retired)
        worker.last_families = []
        for task in worker.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        if worker.writer is not None:
            worker.writer.close()
        lived = time.monotonic() - worker.started_at
        worker.restarts = 0 if lived >= self.STABLE_AFTER_S else worker.restarts + 1
        delay = 0.0 if worker.restarts == 0 else min(
            self.RESTART_BACKOFF_MAX_S, self.RESTART_BACKOFF_MIN_S * 2 ** (worker.restarts - 1)
        )
        await asyncio.sleep(delay)
        if not self._stopping:
            self.restarts_total += 1
            await self._spawn(worker)

    # -- metrics

    async def collect(self) -> list[list[FamilyData]]:
        """Every live worker's families, fresh; a worker that does not answer in time counts with its last."""
        self._seq += 1
        seq = self._seq
        loop = asyncio.get_running_loop()
        asked: list[tuple[_Worker, asyncio.Future[list[FamilyData]]]] = []
        for worker in self._workers:
            if worker.writer is None or not worker.ready.is_set():
                continue
            future: asyncio.Future[list[FamilyData]] = loop.create_future()
            self._replies[(worker.index, seq)] = future
            write_message(worker.writer, CollectMetrics(seq))
            asked.append((worker, future))
        if asked:
            await asyncio.wait([f for _, f in asked], timeout=self.METRICS_TIMEOUT_S)
        for worker, future in asked:
            self._replies.pop((worker.index, seq), None)
            if future.done() and not future.cancelled() and worker.ready.is_set():
                # (a worker that died meanwhile has had its last families retired already)
                worker.last_families = future.result()
            else:
                future.cancel()
        return [w.last_families for w in self._workers if w.last_families]

    async def exposition(self, own: CollectorRegistry) -> bytes:
        """The proxy's metrics across all processes, in Prometheus text format."""
        workers = await self.collect()
        return render(merge_families(families_of(own), workers, self.retired))


def _signal(proc: asyncio.subprocess.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


# ------------------------------------------------------------------------------------------ worker side


class WorkerStore(SnapshotStore):
    """A worker's store: the supervisor's snapshots come in through `publish`; a data-plane `update` (the
    gRPC admin service setting a weight or draining a backend) applies locally at once, so the caller sees
    its effect, and is forwarded to the supervisor, whose next snapshot carries it to every worker. Without
    the forward, such a write would hold in one worker only until the supervisor's next snapshot."""

    def __init__(self, initial: Snapshot, forward: Callable[[dict[str, dict[str, Any]]], None]) -> None:
        super().__init__(initial)
        self._forward = forward

    def update(self, change: Callable[[Snapshot], Snapshot]) -> Snapshot:
        current = self.current
        proposed = change(current)
        changes: dict[str, dict[str, Any]] = {}
        for b in proposed.backends:
            old = current.get(b.name)
            if old is None or old == b:
                continue
            changes[b.name] = {
                f.name: getattr(b, f.name) for f in dataclasses.fields(b) if getattr(b, f.name) != getattr(old, f.name)
            }
        if set(proposed.names) != set(current.names):
            log.warning("a worker cannot add or remove backends; only the supervisor's membership does")
        if changes:
            self._forward(changes)
        return self.publish(proposed)


def _apply(store: SnapshotStore, snapshot: Snapshot) -> None:
    """Publish the supervisor's snapshot in this worker.

    Versions come from the supervisor and only grow, so the usual case is a plain publish. Equal versions
    are the same snapshot (the initial one, or a resend after a restart). A lower version can only follow a
    local publish in this worker; the supervisor's view wins, re-versioned above the local one so the store
    keeps its "versions only increase" rule.
    """
    current = store.current
    if snapshot.version > current.version:
        store.publish(snapshot)
    elif snapshot.version < current.version:
        store.publish(Snapshot(version=current.version + 1, backends=snapshot.backends))


def _with_ports(config: Any, listeners: dict[str, tuple[str, int]]) -> Any:
    """The worker's config with the ports the supervisor resolved (port 0 becomes the same real port)."""
    changes: dict[str, Any] = {}
    if "http" in listeners:
        changes["listen"] = dataclasses.replace(config.listen, port=listeners["http"][1])
    if "grpc" in listeners and config.grpc_listen is not None:
        changes["grpc_listen"] = dataclasses.replace(config.grpc_listen, port=listeners["grpc"][1])
    return dataclasses.replace(config, **changes)


async def _worker(channel_fd: int) -> int:
    from proxy.app import AffinityProxy

    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=channel_fd))
    init = await read_message(reader)
    if not isinstance(init, WorkerInit):
        raise RuntimeError(f"expected WorkerInit, got {type(init).__name__}")
    store = WorkerStore(init.snapshot, lambda changes: write_message(writer, BackendChanges(changes)))
    proxy = AffinityProxy(_with_ports(init.config, init.listeners), reuse_port=True, role="data", store=store)
    pending: list[tuple[str, Any]] = []
    loop = asyncio.get_running_loop()

    def flush() -> None:
        write_message(writer, Outcomes(pending[:]))
        pending.clear()

    def report(name: str, outcome: Any) -> None:
        # One message per event-loop turn, however many requests finished in it.
        if not pending:
            loop.call_soon(flush)
        pending.append((name, outcome))

    proxy.router.on_outcome = report

    async def report_inflight() -> None:
        sent: dict[str, tuple[int, int]] = {}
        while True:
            counts = {name: (e.requests, e.tokens) for name, e in proxy.inflight.items() if e.requests or e.tokens}
            if counts != sent:
                write_message(writer, InflightReport(counts))
                sent = counts
            await asyncio.sleep(INFLIGHT_REPORT_S)

    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    async def channel() -> None:
        try:
            while True:
                message = await read_message(reader)
                if isinstance(message, PublishSnapshot):
                    _apply(proxy.store, message.snapshot)
                elif isinstance(message, ApplyConfig):
                    proxy.resilience.apply_data_config(_with_ports(message.config, init.listeners))
                elif isinstance(message, CollectMetrics):
                    write_message(writer, MetricsReply(message.seq, families_of(proxy.metrics.registry)))
        except (asyncio.IncompleteReadError, ConnectionError):
            # The supervisor is gone: nobody will restart us or feed us snapshots. Drain and leave rather
            # than serve on a frozen view of the fleet.
            log.error("worker %d lost its supervisor: draining", init.index)
            stop.set()

    await proxy.start()
    reading = asyncio.create_task(channel(), name="worker-channel")
    write_message(writer, WorkerReady(init.index, os.getpid()))
    await writer.drain()
    reporting = asyncio.create_task(report_inflight(), name="worker-inflight")
    await stop.wait()
    await proxy.stop()
    reporting.cancel()
    reading.cancel()
    writer.close()
    return 0


def worker_main(argv: Sequence[str] | None = None) -> int:
    """`python -m proxy.multiproc.serve --channel-fd FD --index I`: what the supervisor starts, never users."""
    parser = argparse.ArgumentParser(prog="python -m proxy.multiproc.serve")
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--log-level", type=int, default=logging.INFO)
    args = parser.parse_args(argv)
    # Ctrl-C in a terminal reaches the whole process group; the supervisor turns it into an orderly SIGTERM
    # of every worker, so the workers themselves ignore it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGHUP means "reload" to the supervisor, which forwards the result; a hang-up of the whole process
    # group must not kill the workers (its default action).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s %(levelname)s %(name)s[worker {args.index}]: %(message)s",
    )
    import uvloop

    return uvloop.run(_worker(args.channel_fd))


# ------------------------------------------------------------------------------------------ entry point


def data_listeners(config: Any) -> dict[str, tuple[str, int]]:
    listeners = {"http": (config.listen.host, config.listen.port)}
    if config.grpc_listen is not None:
        listeners["grpc"] = (config.grpc_listen.host, config.grpc_listen.port)
    return listeners


async def serve(config: Any, workers: int, config_path: str | None = None) -> None:
    """Supervisor + `workers` data-plane processes until SIGTERM/SIGINT, then drain everything."""
    from proxy.admin import READY_CHECKS
    from proxy.app import AffinityProxy

    proxy = AffinityProxy(config, role="control", config_path=config_path)
    monitor = proxy.resilience.monitor

    def outcomes(items: list[tuple[str, Any]]) -> None:
        for name, outcome in items:
            if name in proxy.store.current:
                monitor.report(name, outcome)

    supervisor = Supervisor(
        config, proxy.store, workers, data_listeners(config), drain_s=config.timeouts.drain_s,
        on_outcomes=outcomes, inflight=proxy.inflight,
    )
    proxy.resilience.reload_listeners.append(supervisor.apply_config)
    proxy.metrics.register_collector(supervisor.collect_own)
    own = proxy.metrics.registry

    async def render() -> bytes:
        return await supervisor.exposition(own)

    proxy.metrics.render = render
    proxy.admin_app[READY_CHECKS].append(supervisor.readiness_problems)
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


if __name__ == "__main__":
    # Run the imported module's copy, not this __main__ one: the supervisor pickles `proxy.multiproc.serve.*`
    # messages, and isinstance checks must compare against those very classes.
    from proxy.multiproc.serve import worker_main as _worker_main

    sys.exit(_worker_main())
