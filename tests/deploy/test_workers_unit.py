"""The pieces of the multi-process proxy that need no running worker: metric merging, the CPU count, the
reuseport listeners and the channel framing."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import socket

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from proxy.core.snapshot import BackendSpec, BackendState, Snapshot
from proxy.multiproc.channel import PublishSnapshot, read_message, write_message
from proxy.multiproc.cpus import _cgroup_cpu_quota, default_worker_count
from proxy.multiproc.metrics_merge import FamilyData, families_of, merge_families, render, retire
from proxy.listen import reserve_port


def _process_registry(requests: int, inflight: int, version: int, routable: float) -> CollectorRegistry:
    r = CollectorRegistry()
    c = Counter("affinity_proxy_requests", "Requests.", ["backend", "status"], registry=r)
    c.labels("gpu-0", "200").inc(requests)
    h = Histogram("affinity_proxy_request_duration_seconds", "Dur.", ["backend"], buckets=(0.1, 1.0), registry=r)
    for _ in range(requests):
        h.labels("gpu-0").observe(0.5)
    Gauge("affinity_proxy_inflight_requests", "In flight.", ["backend"], registry=r).labels("gpu-0").set(inflight)
    Gauge("affinity_proxy_snapshot_version", "Version.", registry=r).set(version)
    Gauge("affinity_proxy_backend_routable", "Routable.", ["backend"], registry=r).labels("gpu-0").set(routable)
    return r


def _values(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_merge_sums_counters_histograms_and_keeps_supervisor_state() -> None:
    # The supervisor reads the workers' in-flight sum from the shared load block, so its value is the proxy's.
    supervisor = families_of(_process_registry(requests=0, inflight=3, version=7, routable=0))
    w1 = families_of(_process_registry(requests=3, inflight=2, version=6, routable=1))
    w2 = families_of(_process_registry(requests=5, inflight=1, version=7, routable=1))
    values = _values(render(merge_families(supervisor, [w1, w2])))
    assert values[("affinity_proxy_requests_total", (("backend", "gpu-0"), ("status", "200")))] == 8
    assert values[("affinity_proxy_request_duration_seconds_count", (("backend", "gpu-0"),))] == 8
    assert values[("affinity_proxy_request_duration_seconds_bucket", (("backend", "gpu-0"), ("le", "1.0")))] == 8
    assert values[("affinity_proxy_request_duration_seconds_bucket", (("backend", "gpu-0"), ("le", "0.1")))] == 0
    assert values[("affinity_proxy_inflight_requests", (("backend", "gpu-0"),))] == 3
    # Shared state is the supervisor's (it owns the snapshot), not the sum or a stale worker's value.
    assert values[("affinity_proxy_snapshot_version", ())] == 7
    assert values[("affinity_proxy_backend_routable", (("backend", "gpu-0"),))] == 0


def test_gauge_without_supervisor_value_takes_the_highest_worker_value() -> None:
    def fam(v: float) -> list[FamilyData]:
        return [FamilyData("x_age_seconds", "gauge", "Age.", "", (("x_age_seconds", (), v),))]

    values = _values(render(merge_families([], [fam(1.0), fam(4.0), fam(2.0)])))
    assert values[("x_age_seconds", ())] == 4.0


def test_dead_worker_counters_are_carried_forward() -> None:
    w1 = families_of(_process_registry(requests=3, inflight=2, version=6, routable=1))
    w2 = families_of(_process_registry(requests=5, inflight=1, version=7, routable=1))
    retired: dict = {}
    retire(w1, retired)  # w1 died; a restarted w1 starts from zero
    restarted = families_of(_process_registry(requests=1, inflight=0, version=7, routable=1))
    values = _values(render(merge_families([], [restarted, w2], retired)))
    assert values[("affinity_proxy_requests_total", (("backend", "gpu-0"), ("status", "200")))] == 9
    assert values[("affinity_proxy_request_duration_seconds_count", (("backend", "gpu-0"),))] == 9
    # Gauges are not carried forward: without a supervisor value, the highest worker's counts.
    assert values[("affinity_proxy_inflight_requests", (("backend", "gpu-0"),))] == 1


def test_reuse_ratio_is_recomputed_from_summed_counts() -> None:
    def fam(requests: float, opened: float, ratio: float) -> list[FamilyData]:
        return [
            FamilyData("affinity_proxy_upstream_requests", "gauge", "", "",
                       (("affinity_proxy_upstream_requests", (), requests),)),
            FamilyData("affinity_proxy_upstream_connections_opened", "gauge", "", "",
                       (("affinity_proxy_upstream_connections_opened", (), opened),)),
            FamilyData("affinity_proxy_upstream_connection_reuse_ratio", "gauge", "", "",
                       (("affinity_proxy_upstream_connection_reuse_ratio", (), ratio),)),
        ]

    values = _values(render(merge_families([], [fam(100, 10, 0.9), fam(300, 150, 0.5)])))
    assert values[("affinity_proxy_upstream_connection_reuse_ratio", ())] == 1 - 160 / 400


def test_cgroup_quota_v2_and_v1(tmp_path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert _cgroup_cpu_quota(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert _cgroup_cpu_quota(str(tmp_path)) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert _cgroup_cpu_quota(str(v1)) == 2.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert _cgroup_cpu_quota(str(v1)) is None
    assert default_worker_count() >= 1


def listening_socket(host: str, port: int) -> socket.socket:
    """What a worker's listener is (aiohttp's TCPSite with reuse_port=True): a member of the reuseport group."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(64)
    return sock


def test_reserved_port_is_shared_by_listeners_and_never_accepts() -> None:
    reserved = reserve_port("127.0.0.1", 0)
    port = reserved.getsockname()[1]
    a = listening_socket("127.0.0.1", port)
    b = listening_socket("127.0.0.1", port)
    try:
        accepted = 0
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
        for sock in (a, b):
            sock.setblocking(False)
            while True:
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    break
                conn.close()
                accepted += 1
        # Every connection went to a listening socket; none is stuck on the reserved, non-listening one.
        assert accepted == 20
    finally:
        for sock in (a, b, reserved):
            sock.close()


async def test_channel_round_trips_a_snapshot() -> None:
    snapshot = Snapshot.initial([BackendSpec("gpu-0", "http://127.0.0.1:1"), BackendSpec("gpu-1", "http://127.0.0.1:2")])
    left, right = socket.socketpair()
    _, writer = await asyncio.open_unix_connection(sock=left)
    reader, w2 = await asyncio.open_unix_connection(sock=right)
    write_message(writer, PublishSnapshot(snapshot.replace_backend("gpu-1", weight=3.0)))
    await writer.drain()
    message = await read_message(reader)
    assert isinstance(message, PublishSnapshot)
    assert message.snapshot.version == 2
    assert message.snapshot.get("gpu-1").effective_weight == 3.0
    assert message.snapshot.names == ("gpu-0", "gpu-1")
    writer.close()
    w2.close()
    assert pickle.loads(pickle.dumps(snapshot)).get("gpu-0").spec.url == "http://127.0.0.1:1"


async def test_readiness_holds_while_any_worker_serves() -> None:
    from proxy.control.store import SnapshotStore
    from proxy.multiproc.supervisor import Supervisor

    store = SnapshotStore(Snapshot.initial([BackendSpec("gpu-0", "http://127.0.0.1:1")]))
    supervisor = Supervisor(None, store, 2, {}, drain_s=1.0)
    assert supervisor.readiness_problems() == ["none of 2 workers is serving"]
    supervisor._workers[1].ready.set()
    assert supervisor.readiness_problems() == []
    families = {m.name: m for m in supervisor.collect_own()}
    assert {(s.labels["state"], s.value) for s in families["affinity_proxy_workers"].samples} == {
        ("ready", 1), ("starting", 1)}


def test_supervisor_reads_the_workers_rows_and_clears_a_dead_workers_row() -> None:
    from proxy.control.store import SnapshotStore
    from proxy.multiproc.supervisor import Supervisor

    store = SnapshotStore(Snapshot.initial([BackendSpec("gpu-0", "http://127.0.0.1:1"),
                                            BackendSpec("gpu-1", "http://127.0.0.1:2")]))
    supervisor = Supervisor(None, store, 2, {}, drain_s=1.0)
    # What two workers would write into their rows of the same block.
    w0, w1 = supervisor.load.table(0), supervisor.load.table(1)
    for t in (w0, w1):
        t.assign(supervisor.slot_map.slots)
    w0.acquire("gpu-0", 100)
    w0.acquire("gpu-0", 100)
    w0.acquire("gpu-1", 50)
    for _ in range(3):
        w1.acquire("gpu-0", 100)
    assert (supervisor.inflight["gpu-0"].requests, supervisor.inflight["gpu-0"].tokens) == (5, 500)
    assert supervisor.inflight.total_requests == 6
    supervisor.load.clear_row(0)  # worker 0 died: its requests died with it
    assert supervisor.inflight["gpu-1"].requests == 0 and supervisor.inflight["gpu-0"].requests == 3
    assert supervisor.inflight.total_requests == 3
    # A backend added at run time gets a slot, and the supervisor's view follows it.
    store.update(lambda snap: snap.evolve([*snap.backends, _renamed(snap.backends[0], "gpu-2")]))
    assert "gpu-2" in supervisor.slot_map.slots and "gpu-2" in supervisor.inflight
    assert len(set(supervisor.slot_map.slots.values())) == 3


def _renamed(state: BackendState, name: str) -> BackendState:
    return dataclasses.replace(state, spec=dataclasses.replace(state.spec, name=name))


def test_peer_load_up_is_up_only_while_every_workers_view_is_fresh() -> None:
    """Each worker runs its own routing.peer_load exchange: one cut off from Redis routes its share blind,
    so the proxy's `affinity_proxy_peer_load_up` is the lowest worker's (the highest would say 1)."""
    def fam(name: str, v: float) -> list[FamilyData]:
        return [FamilyData(name, "gauge", "", "", ((name, (), v),))]

    up = "affinity_proxy_peer_load_up"
    assert _values(render(merge_families([], [fam(up, 1.0), fam(up, 0.0)])))[(up, ())] == 0.0
    assert _values(render(merge_families([], [fam(up, 0.0), fam(up, 1.0)])))[(up, ())] == 0.0
    assert _values(render(merge_families([], [fam(up, 1.0), fam(up, 1.0)])))[(up, ())] == 1.0
    assert _values(render(merge_families([], [fam(up, 1.0)])))[(up, ())] == 1.0
    # A backend's KV-event view is fresh for the proxy only while it is in every worker (each subscribes).
    fresh = "affinity_proxy_kv_index_fresh"

    def per_backend(v0: float, v1: float) -> list[FamilyData]:
        return [FamilyData(fresh, "gauge", "", "", ((fresh, (("backend", "b0"),), v0), (fresh, (("backend", "b1"),), v1)))]

    merged = _values(render(merge_families([], [per_backend(1.0, 1.0), per_backend(0.0, 1.0)])))
    assert merged[(fresh, (("backend", "b0"),))] == 0.0 and merged[(fresh, (("backend", "b1"),))] == 1.0
    # Other gauges keep the highest worker's value.
    replicas = "affinity_proxy_peer_load_replicas"
    assert _values(render(merge_families([], [fam(replicas, 2.0), fam(replicas, 1.0)])))[(replicas, ())] == 2.0
