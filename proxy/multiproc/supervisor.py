"""The supervisor: starts the data-plane workers, feeds them snapshots and configs, hears their reports,
restarts the ones that die and merges their metrics (design notes in proxy/multiproc/serve.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy.control.store import SnapshotStore
from proxy.core.inflight import InflightTable, SharedInflightTable
from proxy.core.snapshot import Snapshot
from proxy.multiproc.channel import (
    AdapterDemand,
    ApplyConfig,
    BackendChanges,
    CollectMetrics,
    CollectWindows,
    MetricsReply,
    OrcaReports,
    Outcomes,
    PublishSnapshot,
    ResponseHomesLearned,
    WorkerInit,
    WindowsReply,
    WorkerReady,
    encode_message,
    read_message,
    write_message,
)
from proxy.multiproc.metrics_merge import FamilyData, SampleKey, families_of, merge_families, render, retire
from proxy.multiproc.shared_load import SharedChunkBlock, SharedLoad, SlotMap

log = logging.getLogger("affinity_proxy.workers")


@dataclass
class _Worker:
    """One worker slot: its process (restarted in place) and its half of the channel."""

    index: int
    proc: asyncio.subprocess.Process | None = None
    writer: asyncio.StreamWriter | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    pending: Snapshot | None = None  # newest snapshot not yet written (coalesced)
    slots_sent: int = -1  # version of the slot map this worker has
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
        reserve_port: Callable[[str, int], socket.socket] | None = None,
        load: SharedLoad | None = None,
        on_orca: Callable[[list[tuple[str, str]]], None] | None = None,
        on_windows: Callable[[list[list[dict[str, Any]]]], None] | None = None,
        windows_interval_s: float = 1.0,
    ) -> None:
        """`on_windows`: every `windows_interval_s`, one collection round of the workers' closed heat-map
        windows (one list per worker that answered), for the supervisor's aggregator (`Observer.ingest`)."""
        # `reserve_port(host, port)` binds (never listens) the socket that fixes and holds each shared
        # listener's port; it is passed in so that one module opens every socket. Required when there
        # are listeners to share.
        if listeners and reserve_port is None:
            raise ValueError("a supervisor that shares listeners needs reserve_port")
        self._reserve_port = reserve_port
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
        self.on_orca = on_orca
        self._adapter_demand: dict[str, int] = {}  # AdapterDemand from the workers, until the pool reads it
        self.on_windows = on_windows
        self.windows_interval_s = windows_interval_s
        self._window_replies: dict[tuple[int, int], asyncio.Future[list[dict[str, Any]]]] = {}
        self._windows_task: asyncio.Task[None] | None = None
        # The host-wide load block: each worker counts its in-flight work into its own row, every worker
        # routes on the sum, and `inflight` (the admin API, drains, metrics) reads the same sum.
        self.load = load if load is not None else SharedLoad.create(workers)
        if self.load.layout.rows != workers:
            raise ValueError(f"the load block has {self.load.layout.rows} rows for {workers} workers")
        self.inflight = inflight if inflight is not None else self.load.table(None)
        self.slot_map = SlotMap(self.load)
        self.slot_map.follow(store.current.names)
        # The prompt chunks the workers' tokenizers share (the precise index): a continuation routed by
        # another worker than its earlier turns is not tokenised again.
        self.chunks = SharedChunkBlock.create(workers)
        self._slots_version = 0
        self._follow_slots()
        self.restarts_total = 0
        # The newest snapshot's frame, pickled once for all workers (pickling a 256-backend snapshot takes
        # ~1 ms here; per worker it would be N of those every telemetry interval).
        self._encoded: tuple[Snapshot, bool, bytes] | None = None
        store.subscribe(self._on_snapshot)

    # -- lifecycle

    async def start(self, ready_timeout_s: float = 60.0) -> None:
        """Reserve the ports, start every worker and wait until all of them listen."""
        for name, (host, port) in self._requested.items():
            assert self._reserve_port is not None  # checked in __init__
            sock = self._reserve_port(host, port)
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
            waited: list[asyncio.Future[Any]] = [all_ready, self._start_failure]
            done, _ = await asyncio.wait(waited, timeout=ready_timeout_s, return_when=asyncio.FIRST_COMPLETED)
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
        if self.on_windows is not None:
            self._windows_task = asyncio.create_task(self._collect_windows_forever(), name="worker-windows")

    async def stop(self) -> None:
        """SIGTERM every worker (each drains its own connections), SIGKILL what outlives the drain."""
        self._stopping = True
        if self._windows_task is not None:
            self._windows_task.cancel()
            self._windows_task = None
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

    def take_adapter_demand(self) -> dict[str, int]:
        """Requests per LoRA adapter every worker routed since the last call: the host's one LoRA pool
        reads this instead of a router of its own (the supervisor routes nothing)."""
        demand, self._adapter_demand = self._adapter_demand, {}
        return demand

    def ready_count(self) -> int:
        return sum(1 for w in self._workers if w.ready.is_set())

    def _follow_slots(self) -> None:
        """The slot map changed (or was just built): the supervisor's own view follows it, and every
        worker gets it with its next snapshot."""
        self._slots_version += 1
        if isinstance(self.inflight, SharedInflightTable):
            self.inflight.assign(self.slot_map.slots)

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
                self._python, "-m", "proxy.multiproc.worker", "--channel-fd", str(child.fileno()),
                "--shared-fd", str(self.load.fd), "--chunks-fd", str(self.chunks.fd), "--index", str(worker.index),
                "--log-level", str(logging.getLogger().getEffectiveLevel()),
                pass_fds=(child.fileno(), self.load.fd, self.chunks.fd),
            )
        finally:
            child.close()
        worker.started_at = time.monotonic()
        worker.ready.clear()
        reader, writer = await asyncio.open_unix_connection(sock=parent)
        worker.writer = writer
        worker.slots_sent = self._slots_version
        write_message(
            writer,
            WorkerInit(
                index=worker.index, config=self.config, listeners=self.listeners, snapshot=self.store.current,
                shared=self.load.layout, slots=dict(self.slot_map.slots), chunks=self.chunks.layout,
            ),
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
                elif isinstance(message, OrcaReports):
                    if self.on_orca is not None:
                        self.on_orca(message.items)
                elif isinstance(message, BackendChanges):
                    self._apply_changes(message.changes)
                elif isinstance(message, ResponseHomesLearned):
                    for other in self._workers:  # every other worker learns where those responses live
                        if other is not worker and other.writer is not None and other.ready.is_set():
                            write_message(other.writer, message)
                elif isinstance(message, AdapterDemand):
                    demand = self._adapter_demand
                    for adapter, n in message.counts.items():
                        demand[adapter] = demand.get(adapter, 0) + n
                elif isinstance(message, Outcomes):
                    if self.on_outcomes is not None:
                        self.on_outcomes(message.items)
                elif isinstance(message, WindowsReply):
                    wfuture = self._window_replies.pop((worker.index, message.seq), None)
                    if wfuture is not None and not wfuture.done():
                        wfuture.set_result(message.windows)
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
                    with_slots = worker.slots_sent != self._slots_version
                    worker.slots_sent = self._slots_version
                    writer.write(self._frame(snapshot, with_slots))
                    await writer.drain()
        except ConnectionError:
            return

    def _frame(self, snapshot: Snapshot, with_slots: bool) -> bytes:
        cached = self._encoded
        if cached is None or cached[0] is not snapshot or cached[1] != with_slots:
            slots = dict(self.slot_map.slots) if with_slots else None
            cached = self._encoded = (snapshot, with_slots, encode_message(PublishSnapshot(snapshot, slots)))
        return cached[2]

    def _queue(self, worker: _Worker, snapshot: Snapshot) -> None:
        worker.pending = snapshot
        worker.wakeup.set()

    def _on_snapshot(self, snapshot: Snapshot) -> None:
        if self.slot_map.follow(snapshot.names):
            self._follow_slots()
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
        self.load.clear_row(worker.index)  # its requests died with it
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

    # -- heat-map windows

    async def collect_windows(self) -> list[list[dict[str, Any]]]:
        """One round: every live worker's windows closed since the last round (plain data)."""
        self._seq += 1
        seq = self._seq
        loop = asyncio.get_running_loop()
        asked: list[asyncio.Future[list[dict[str, Any]]]] = []
        for worker in self._workers:
            if worker.writer is None or not worker.ready.is_set():
                continue
            future: asyncio.Future[list[dict[str, Any]]] = loop.create_future()
            self._window_replies[(worker.index, seq)] = future
            write_message(worker.writer, CollectWindows(seq))
            asked.append(future)
        if asked:
            await asyncio.wait(asked, timeout=self.METRICS_TIMEOUT_S)
        for key in [k for k in self._window_replies if k[1] == seq]:
            self._window_replies.pop(key).cancel()
        return [f.result() for f in asked if f.done() and not f.cancelled()]

    async def _collect_windows_forever(self) -> None:
        assert self.on_windows is not None
        while True:
            await asyncio.sleep(self.windows_interval_s)
            try:
                self.on_windows(await self.collect_windows())
            except Exception:
                log.exception("merging the workers' heat-map windows failed")

    async def exposition(self, own: CollectorRegistry) -> bytes:
        """The proxy's metrics across all processes, in Prometheus text format."""
        workers = await self.collect()
        return render(merge_families(families_of(own), workers, self.retired))


def _signal(proc: asyncio.subprocess.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass
