"""One data-plane worker process: `python -m proxy.multiproc.worker --channel-fd FD --index I`, started by
the supervisor (proxy/multiproc/supervisor.py), never by users. It serves the shared listeners with
SO_REUSEPORT, routes on the snapshots the supervisor publishes and reports back up the channel."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
from typing import Any, Callable, Sequence

from proxy.control.store import SnapshotStore
from proxy.core.snapshot import Snapshot
from proxy.dataplane.response_homes import ResponseHomes
from proxy.multiproc.channel import (
    AdapterDemand,
    ApplyConfig,
    BackendChanges,
    CollectMetrics,
    CollectWindows,
    ResponseHomesLearned,
    MetricsReply,
    OrcaReports,
    Outcomes,
    PublishSnapshot,
    WorkerInit,
    WindowsReply,
    WorkerReady,
    read_message,
    write_message,
)
from proxy.multiproc.metrics_merge import families_of
from proxy.multiproc.shared_load import SharedChunkBlock, SharedLoad
from proxy.observability.config import LoggingConfig
from proxy.observability.logs import configure_logging

log = logging.getLogger("affinity_proxy.workers")


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


class _Batch:
    """Reports sent up the channel as one message per event-loop turn, however many requests made them."""

    def __init__(self, writer: asyncio.StreamWriter, message: Callable[[list[Any]], object]) -> None:
        self._writer = writer
        self._message = message
        self._items: list[Any] = []

    def add(self, item: Any) -> None:
        if not self._items:
            asyncio.get_running_loop().call_soon(self._flush)
        self._items.append(item)

    def _flush(self) -> None:
        items, self._items = self._items, []
        write_message(self._writer, self._message(items))


async def _worker(channel_fd: int, shared_fd: int, chunks_fd: int) -> int:
    from proxy.app import AffinityProxy
    from proxy.gcsettings import tune_gc

    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=channel_fd))
    init = await read_message(reader)
    if not isinstance(init, WorkerInit):
        raise RuntimeError(f"expected WorkerInit, got {type(init).__name__}")
    # The configured log format, now that the config is here (the same as the supervisor's), each line
    # naming this worker.
    root = logging.getLogger()
    configure_logging(init.config.logging, logging.getLevelName(root.getEffectiveLevel()).lower(),
                      fields={"worker": init.index})
    store = WorkerStore(init.snapshot, lambda changes: write_message(writer, BackendChanges(changes)))
    # This worker's row of the host-wide load block: its policy routes on every worker's in-flight work.
    inflight = SharedLoad.attach(shared_fd, init.shared).table(init.index)
    inflight.assign(init.slots)
    # Its row of the host's tokenised chunks: its tokenizers read every worker's and write their own.
    chunks = SharedChunkBlock.attach(chunks_fd, init.chunks).view(init.index)
    outcomes = _Batch(writer, Outcomes)
    # The supervisor's poller folds ORCA reports into the snapshot (workers run no poller): the data plane
    # asks backends for them and this forwards what they send (HTTP/1.1 and the HTTP/2 bridge alike).
    telemetry = init.config.telemetry
    orca = _Batch(writer, OrcaReports) if telemetry.enabled and telemetry.orca else None
    # Responses API: where each stored response lives, shared with the other workers through the supervisor.
    learned = _Batch(writer, ResponseHomesLearned)
    homes = ResponseHomes(on_learn=lambda rid, backend: learned.add((rid, backend)))
    proxy = AffinityProxy(
        _with_ports(init.config, init.listeners), reuse_port=True, role="data", store=store, inflight=inflight,
        on_outcome=lambda name, outcome: outcomes.add((name, outcome)),
        load_report=None if orca is None else (lambda name, header: orca.add((name, header))),
        response_homes=homes, shared_chunks=chunks,
    )
    tune_gc()  # the process is built: freeze what start-up made (proxy/gcsettings.py)

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def channel() -> None:
        try:
            while True:
                message = await read_message(reader)
                if isinstance(message, PublishSnapshot):
                    if message.slots is not None:
                        inflight.assign(message.slots)
                    _apply(proxy.store, message.snapshot)
                elif isinstance(message, ResponseHomesLearned):
                    for rid, backend in message.items:
                        homes.adopt(rid, backend)
                elif isinstance(message, ApplyConfig):
                    proxy.resilience.apply_data_config(_with_ports(message.config, init.listeners))
                    if proxy.kv_events is not None:  # this worker's KV-event subscriptions follow the reload
                        proxy.kv_events.reload(message.config)
                    if proxy.peer_load is not None:  # and its routing.peer_load exchange (kept, or restarted)
                        proxy.peer_load.reload(message.config.routing.peer_load)
                elif isinstance(message, CollectMetrics):
                    write_message(writer, MetricsReply(message.seq, families_of(proxy.metrics.registry)))
                elif isinstance(message, CollectWindows):
                    write_message(writer, WindowsReply(message.seq, proxy.observer.take_closed()))
        except (asyncio.IncompleteReadError, ConnectionError):
            # The supervisor is gone: nobody will restart us or feed us snapshots. Drain and leave rather
            # than serve on a frozen view of the fleet.
            log.error("worker %d lost its supervisor: draining", init.index)
            stop.set()

    async def report_adapter_demand(every_s: float) -> None:
        """The supervisor runs the one LoRA pool: it hears this worker's adapter demand a few times a round."""
        while True:
            await asyncio.sleep(every_s)
            counts = proxy.router.take_adapter_demand()
            if counts:
                write_message(writer, AdapterDemand(counts))

    await proxy.start()
    reading = asyncio.create_task(channel(), name="worker-channel")
    pool = init.config.lora_pool
    demand = (asyncio.create_task(report_adapter_demand(min(0.25, pool.interval_s / 4)), name="worker-lora-demand")
              if pool.enabled else None)
    write_message(writer, WorkerReady(init.index, os.getpid()))
    await writer.drain()
    await stop.wait()
    if demand is not None:
        demand.cancel()
    await proxy.stop()
    reading.cancel()
    writer.close()
    return 0


def worker_main(argv: Sequence[str] | None = None) -> int:
    """`python -m proxy.multiproc.worker --channel-fd FD --shared-fd FD --chunks-fd FD --index I`: what the
    supervisor starts, never users."""
    parser = argparse.ArgumentParser(prog="python -m proxy.multiproc.worker")
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--shared-fd", type=int, required=True)
    parser.add_argument("--chunks-fd", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--log-level", type=int, default=logging.INFO)
    args = parser.parse_args(argv)
    # Ctrl-C in a terminal reaches the whole process group; the supervisor turns it into an orderly SIGTERM
    # of every worker, so the workers themselves ignore it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGHUP means "reload" to the supervisor, which forwards the result; a hang-up of the whole process
    # group must not kill the workers (its default action).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # Text until the config arrives (proxy/observability/logs.py; `_worker` then applies `logging.format`).
    configure_logging(LoggingConfig(format="text"), logging.getLevelName(args.log_level).lower(),
                      fields={"worker": args.index})
    import uvloop

    return uvloop.run(_worker(args.channel_fd, args.shared_fd, args.chunks_fd))


if __name__ == "__main__":
    # Run the imported module's copy, not this __main__ one, so that there is one module state in the
    # process (the channel's message classes live in proxy.multiproc.channel either way).
    from proxy.multiproc.worker import worker_main as _worker_main

    sys.exit(_worker_main())
