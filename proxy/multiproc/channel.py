"""The supervisor <-> worker channel: length-prefixed pickle frames over a private socketpair, and the
messages that travel on it (down: WorkerInit, PublishSnapshot, ApplyConfig, CollectMetrics, CollectWindows; up:
WorkerReady, Outcomes, BackendChanges, OrcaReports, AdapterDemand, MetricsReply, WindowsReply; both ways:
ResponseHomesLearned). In-flight work is not sent: it lives in the shared
load block (proxy/multiproc/shared_load.py)."""

from __future__ import annotations

import asyncio
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from proxy.core.inflight import SharedLayout
from proxy.core.snapshot import Snapshot
from proxy.dataplane.shared_chunks import ChunkLayout
from proxy.multiproc.metrics_merge import FamilyData

_FRAME = struct.Struct("!I")


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
    shared: SharedLayout  # of the host-wide load block (its descriptor is passed with --shared-fd)
    slots: dict[str, int]  # backend name -> slot in the load block
    chunks: ChunkLayout  # of the host's tokenised prompt chunks (its descriptor is passed with --chunks-fd)


@dataclass(frozen=True)
class WorkerReady:
    index: int
    pid: int


@dataclass(frozen=True)
class PublishSnapshot:
    snapshot: Snapshot
    # The load block's backend name -> slot map, when it changed since this worker's last one (it only
    # changes with the backend set, and arrives with the snapshot that changed it).
    slots: dict[str, int] | None = None


@dataclass(frozen=True)
class ApplyConfig:
    """A reloaded, validated configuration: the worker applies its data-plane half (retries, overload,
    routing policy). Backend membership arrives as snapshots, like every other fleet change."""

    config: Any


@dataclass(frozen=True)
class Outcomes:
    """Passive outcome reports (backend name, proxy.core.decision.Outcome) from a worker's requests, for the
    supervisor's outlier detection: one monitor sees the whole proxy's traffic, so a backend failing on
    every worker is ejected as fast as in a single process, and ejection is one fleet-wide decision."""

    items: list[tuple[str, Any]]


@dataclass(frozen=True)
class BackendChanges:
    """Per-backend field changes a worker's data plane made with `SnapshotStore.update` (the gRPC admin
    service's weight and drain calls), for the supervisor to apply to the one authoritative snapshot."""

    changes: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class OrcaReports:
    """ORCA load reports (backend name, `endpoint-load-metrics` header) from a worker's responses, batched
    per event-loop turn, for the supervisor's telemetry poller: it folds them into the signals of the one
    snapshot every worker routes on (`Poller.observe_orca`), as a single process does."""

    items: list[tuple[str, str]]


@dataclass(frozen=True)
class AdapterDemand:
    """Requests per LoRA adapter a worker routed since its last report (`Router.take_adapter_demand`), sent
    a few times a second while `lora_pool` is on: the supervisor's one adapter pool acts on the host's
    demand (proxy/control/lora_pool.py), and its loads reach the workers as snapshots."""

    counts: dict[str, int]


@dataclass(frozen=True)
class ResponseHomesLearned:
    """Responses API: (response id, backend that stored it) pairs a worker learned from the answers it relayed
    (proxy/dataplane/response_homes.py), batched per event-loop turn; the supervisor passes them on to every
    other worker, so a chain's next turn finds its backend whichever worker accepts it."""

    items: list[tuple[str, str]]


@dataclass(frozen=True)
class CollectMetrics:
    seq: int


@dataclass(frozen=True)
class MetricsReply:
    seq: int
    families: list[FamilyData]


@dataclass(frozen=True)
class CollectWindows:
    """The supervisor's collection round of heat-map windows (every second): each worker answers with the
    windows it closed since the last round, so the supervisor's aggregator judges one merged window per
    index for the whole host (proxy/observability/observer.py, role worker / aggregator)."""

    seq: int


@dataclass(frozen=True)
class WindowsReply:
    seq: int
    windows: list[dict[str, Any]]  # proxy.core.hotspots.Window.to_data() each
