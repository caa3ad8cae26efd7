"""The supervisor <-> worker channel: length-prefixed pickle frames over a private socketpair, and the
messages that travel on it (down: WorkerInit, PublishSnapshot, ApplyConfig, CollectMetrics; up: WorkerReady,
Outcomes, BackendChanges, InflightReport, MetricsReply)."""

from __future__ import annotations

import asyncio
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from proxy.core.snapshot import Snapshot
from proxy.multiproc.metrics_merge import FamilyData

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
