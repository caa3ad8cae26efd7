"""One Prometheus exposition for the whole proxy, merged at scrape time from every process's registry.

The supervisor asks each worker for its families (plain, picklable `FamilyData`) and merges them with its
own: counters add up, a dead worker's totals are carried forward (`retire`), shared-state gauges come from
the supervisor. Why not prometheus_client's multiprocess mode: see proxy/multiproc/serve.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest


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
# Gauges that say whether something holds in every worker: the proxy's value is the lowest worker's. Every
# worker runs its own routing.peer_load exchange (each publishes its own part of the host under its own id,
# and reads the other rows for its own policy), so the host routes on the peers' load only while
# every worker's view is fresh: one worker cut off from Redis routes its share of the traffic blind, which
# the highest value would hide. The same for a backend's KV-event view: every worker subscribes to every
# engine on its own, and a worker whose feed went stale routes that backend on its learned index.
MIN_GAUGES = frozenset({"affinity_proxy_peer_load_up", "affinity_proxy_kv_index_fresh"})
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
    highest worker value (the lowest for MIN_GAUGES). The connection reuse ratio is recomputed from the
    summed counts.
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
                acc[key] = min(acc[key], value) if family.name in MIN_GAUGES else max(acc[key], value)

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
    registry.register(_ListCollector(metrics))
    return generate_latest(registry)
