"""routing.peer_load (proxy/control/peer_load.py): replicas publish their per-backend load to a real
redis-server and read each other's; a replica that stops drops out; Redis down makes peers() None and the
affinity policy routes on its own load; reloads keep or restart the exchange."""

from __future__ import annotations

import json
import os
import socket

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from proxy.config import ConfigError, parse_config
from proxy.control.peer_load import PEER_RECENT_MAX, PeerLoadExchange, default_replica_id, merge_rows, own_load
from proxy.core.affinity import AffinityPolicy
from proxy.core.decision import Inflight, Reason
from proxy.core.inflight import InflightTable
from proxy.core.routing_config import PeerLoadConfig, RoutingConfig
from proxy.core.work_ledger import WorkLedger
from tests.core.helpers import fleet, home_order, prompt
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401  # the fixture
from tests.support.wait import until

Load = dict[str, tuple[int, int, float]]


def _cfg(server: RedisServer, **kw: object) -> PeerLoadConfig:
    return PeerLoadConfig(redis_url=server.url, refresh_ms=kw.pop("refresh_ms", 20),  # type: ignore[arg-type]  # test override
                          key_prefix=f"test:{server.port}", **kw)  # type: ignore[arg-type]  # replica_id only


def _exchange(cfg: PeerLoadConfig, load: Load, **kw: object) -> PeerLoadExchange:
    return PeerLoadExchange(cfg, lambda: load, registry=CollectorRegistry(), **kw)  # type: ignore[arg-type]  # worker only


async def test_two_replicas_see_each_others_load_and_not_their_own(redis_server: RedisServer) -> None:
    a_load: Load = {"gpu-0": (3, 900, 1200.0), "gpu-1": (0, 0, 0.0)}
    b_load: Load = {"gpu-0": (1, 100, 50.0), "gpu-1": (2, 400, 800.0)}
    a = _exchange(_cfg(redis_server, replica_id="a"), a_load)
    b = _exchange(_cfg(redis_server, replica_id="b"), b_load)
    assert a.peers() is None  # not started: nothing known
    await a.start()
    await b.start()
    try:
        assert await until(lambda: a.peers() == b_load, timeout=5)
        assert await until(lambda: b.peers() == a_load, timeout=5)
        # A change is seen within a few refreshes.
        a_load["gpu-1"] = (7, 700, 7000.0)
        assert await until(lambda: (b.peers() or {}).get("gpu-1") == (7, 700, 7000.0), timeout=5)
        # A third replica sees the sum of both.
        c = _exchange(_cfg(redis_server, replica_id="c"), {})
        await c.start()
        try:
            assert await until(lambda: (c.peers() or {}).get("gpu-1") == (9, 1100, 7800.0), timeout=5)
            assert c.peers()["gpu-0"] == (4, 1000, 1250.0)  # type: ignore[index]  # not None: checked above
        finally:
            await c.stop()
    finally:
        await a.stop()
        await b.stop()


async def test_a_stopped_replica_leaves_and_a_dead_one_expires_with_its_ttl(redis_server: RedisServer) -> None:
    cfg = _cfg(redis_server, replica_id="alive")
    alive = _exchange(cfg, {})
    gone = _exchange(_cfg(redis_server, replica_id="gone"), {"gpu-0": (5, 50, 5.0)})
    await alive.start()
    await gone.start()
    client = aioredis.from_url(redis_server.url)
    try:
        assert await until(lambda: alive.peers() == {"gpu-0": (5, 50, 5.0)}, timeout=5)
        await gone.stop()  # a clean stop deletes its row at once
        assert await until(lambda: alive.peers() == {}, timeout=5)
        # A replica that dies without stopping: its row (as the script writes it) outlives it by the TTL only.
        await client.set(f"{cfg.key_prefix}:replica:crashed", json.dumps({"gpu-2": [4, 40, 4.0]}), px=cfg.ttl_ms)
        await client.sadd(f"{cfg.key_prefix}:replicas", "crashed")
        assert await until(lambda: alive.peers() == {"gpu-2": (4, 40, 4.0)}, timeout=5)
        assert await until(lambda: alive.peers() == {}, timeout=5)  # expired after ttl_ms (1 s)
        assert await client.sismember(f"{cfg.key_prefix}:replicas", "crashed") == 0  # and pruned from the set
    finally:
        await client.aclose()
        await alive.stop()


async def test_redis_down_makes_peers_none_and_the_policy_still_routes(redis_server: RedisServer) -> None:
    snap = fleet(4)
    p = prompt("a fresh question for the peers " + "q" * 3000)
    home = home_order(p, snap)[0]
    registry = CollectorRegistry()
    me = PeerLoadExchange(_cfg(redis_server, replica_id="me"), lambda: {}, registry=registry)
    other = _exchange(_cfg(redis_server, replica_id="other"), {home: (3, 9000, 30000.0)})
    policy = AffinityPolicy(RoutingConfig(), peers=me.peers)
    await me.start()
    await other.start()
    try:
        assert await until(lambda: me.peers() == {home: (3, 9000, 30000.0)}, timeout=5)
        d = policy.pick(p, snap, {})
        assert d.backend != home and d.reason is Reason.OVERLOAD_FALLBACK  # the peer's load moved it
        assert registry.get_sample_value("affinity_proxy_peer_load_up") == 1
        redis_server.stop()
        assert await until(lambda: me.peers() is None, timeout=5)  # after the TTL, not at once
        assert await until(lambda: registry.get_sample_value("affinity_proxy_peer_load_up") == 0, timeout=5)
        assert (registry.get_sample_value("affinity_proxy_peer_load_errors_total") or 0) >= 1
        # A policy that never saw the prompt (the first one learned where it sent it) routes on its own
        # (empty) load: the hash home.
        d = AffinityPolicy(RoutingConfig(), peers=me.peers).pick(p, snap, {})
        assert d.backend == home and d.reason is Reason.HASH
        redis_server.start()  # Redis back on the same port: the exchange resumes by itself
        assert await until(lambda: me.peers() == {home: (3, 9000, 30000.0)}, timeout=10)
        assert registry.get_sample_value("affinity_proxy_peer_load_up") == 1
    finally:
        await me.stop()
        await other.stop()


async def test_workers_of_one_host_publish_their_own_parts_and_read_the_other_hosts(redis_server: RedisServer) -> None:
    """With --workers each worker's ledger holds only its own entries: so each worker publishes its own
    part under `<host>/<index>` (`own_load`) for the other hosts, which sum the host's worker rows (the
    host once); it reads only the other hosts' rows (its mates it reads from the shared block, round 5),
    with an empty entry for each backend of its own row that no other host published (`host_view`)."""
    w1_load: Load = {"gpu-0": (2, 200, 20.0, ((0, 700.0), (1, 100.0))), "gpu-1": (0, 0, 0.0, ())}  # type: ignore[dict-item]  # a row with entries
    w2_load: Load = {"gpu-0": (4, 400, 40.0, ((2, 300.0),)), "gpu-1": (0, 0, 0.0, ())}  # type: ignore[dict-item]  # a row with entries
    w1 = _exchange(_cfg(redis_server, replica_id="host-a"), w1_load, worker=0)
    w2 = _exchange(_cfg(redis_server, replica_id="host-a"), w2_load, worker=1)
    # A host whose id starts like host-a's but is another host: read.
    other = _exchange(_cfg(redis_server, replica_id="host-ab"), {"gpu-0": (1, 10, 1.0, ((3, 5.0),))})  # type: ignore[dict-item]  # a row with entries
    assert (w1.replica_id, w2.replica_id, other.replica_id) == ("host-a/0", "host-a/1", "host-ab")
    for e in (w1, w2, other):
        await e.start()
    try:
        assert await until(lambda: other.peers() == {"gpu-0": (6, 600, 60.0, ((0, 700.0), (1, 100.0), (2, 300.0))),
                                                     "gpu-1": (0, 0, 0.0, ())}, timeout=5)
        for w in (w1, w2):
            assert await until(lambda w=w: w.peers() == {"gpu-0": (1, 10, 1.0, ((3, 5.0),)), "gpu-1": (0, 0, 0.0, ())},
                               timeout=5)
    finally:
        for e in (w1, w2, other):
            await e.stop()


def test_default_replica_id_names_the_host_and_the_process_owning_the_load() -> None:
    host = socket.gethostname()
    assert default_replica_id(False) == f"{host}:{os.getpid()}"
    assert default_replica_id(True) == f"{host}:{os.getppid()}"  # a worker: its supervisor's, the host's id


async def test_reload_keeps_an_unchanged_exchange_and_restarts_a_changed_one(redis_server: RedisServer) -> None:
    cfg = _cfg(redis_server, replica_id="r1")
    ex = _exchange(cfg, {})
    other = _exchange(_cfg(redis_server, replica_id="o"), {"gpu-0": (2, 2, 2.0)})
    await other.start()
    await ex.start()
    try:
        assert await until(lambda: ex.peers() == {"gpu-0": (2, 2, 2.0)}, timeout=5)
        task = ex._task
        ex.reload(PeerLoadConfig(**{**cfg.__dict__}))  # an equal section: nothing restarts
        assert ex._task is task
        ex.reload(PeerLoadConfig(**{**cfg.__dict__, "replica_id": "r2"}))
        assert await until(lambda: ex._task is not None and ex._task is not task, timeout=5)
        assert ex.replica_id == "r2"
        assert await until(lambda: other.peers() is not None and ex.peers() == {"gpu-0": (2, 2, 2.0)}, timeout=5)
        ex.reload(PeerLoadConfig())  # turned off: stops, and knows nothing
        assert await until(lambda: ex._task is None and ex.peers() is None, timeout=5)
        ex.reload(cfg)  # and on again
        assert await until(lambda: ex.peers() == {"gpu-0": (2, 2, 2.0)}, timeout=5)
    finally:
        await ex.stop()
        await other.stop()


async def test_off_by_default_starts_nothing() -> None:
    ex = _exchange(PeerLoadConfig(), {"gpu-0": (1, 1, 1.0)})
    await ex.start()
    assert ex._task is None and ex.peers() is None
    await ex.stop()


def test_merge_skips_what_is_malformed() -> None:
    rows = [json.dumps({"a": [1, 2, 3.5], "b": [1, 1, 1]}), b"not json", json.dumps([1, 2]),
            json.dumps({"a": [1, 2], "c": ["x", 1, 1], "d": [-1, 0, 0.0], "e": [1, 1, 1e400]}),
            json.dumps({"a": [2, 3, 0.5]})]
    assert merge_rows(rows) == {"a": (3, 5, 4.0), "b": (1, 1, 1.0)}


def test_rows_with_ledger_entries_are_put_together_and_a_row_without_gives_the_sums_only() -> None:
    """Round 4: a row may carry the replica's newest ledger entries ([age, tokens], newest first). Every
    row's entries for a backend are put together, sorted by age; a backend that some replica published
    without entries (an older replica, or a --workers host) gets the sums only, since the fleet estimate
    needs every replica's; a malformed entry list drops that backend's entry of the row."""
    rows = [json.dumps({"a": [1, 100, 40.0, [[0, 40.0], [3, 9.0]]], "b": [1, 10, 5.0, [[1, 5.0]]],
                        "c": [0, 0, 0.0, [[2, 7.0]]]}),
            json.dumps({"a": [2, 200, 60.0, [[1, 30.0], [2, 30.0]]], "b": [1, 10, 6.0]}),
            json.dumps({"a": [1, 1, 1.0, [[-1, 1.0]]], "c": [1, 1, 1.0, [[0, "x"]]],
                        "d": [1, 1, 1.0, [[0, 1.0]] * (PEER_RECENT_MAX + 1)], "e": [1, 1, 1.0, [[True, 1.0]]]})]
    assert merge_rows(rows) == {
        "a": (3, 300, 100.0, ((0, 40.0), (1, 30.0), (2, 30.0), (3, 9.0))),  # sorted by age
        "b": (2, 20, 11.0),
        "c": (0, 0, 0.0, ((2, 7.0),)),
    }


def test_a_replica_publishes_its_newest_entries_with_their_ages() -> None:
    """`own_load` ticks the ledger's epoch once per refresh and publishes, per backend, as many newest
    entries as the fleet's newest K could use: its own live requests plus the others' as last seen."""
    work, table = WorkLedger(), InflightTable()
    for tokens in (500.0, 400.0):
        work.record("a", tokens)
        table.acquire("a", 1000)
    row = own_load(work, table, ["a", "b"], None)
    assert row == {"a": (2, 2000, 900.0, ((1, 400.0), (1, 500.0))), "b": (0, 0, 0.0, ())}
    work.record("a", 300.0)
    table.acquire("a", 1000)
    table.release("a", 1000)
    row = own_load(work, table, ["a"], {"a": (1, 10, 1.0)})  # the others hold 1 more: 3 entries
    assert row["a"] == (2, 2000, 700.0, ((1, 300.0), (2, 400.0), (2, 500.0)))
    assert own_load(work, table, ["a"], {"a": (10 * PEER_RECENT_MAX, 1, 1.0)})["a"][3][-1] == (3, 500.0)


async def test_the_entries_reach_the_other_replica_through_redis(redis_server: RedisServer) -> None:
    entries = ((0, 300.0), (2, 500.0))
    a = _exchange(_cfg(redis_server, replica_id="a"), {"gpu-0": (1, 100, 300.0, entries)})  # type: ignore[dict-item]  # a row with entries
    b = _exchange(_cfg(redis_server, replica_id="b"), {"gpu-0": (2, 200, 900.0, ((1, 900.0),))})  # type: ignore[dict-item]  # a row with entries
    await a.start()
    await b.start()
    try:
        assert await until(lambda: (b.peers() or {}).get("gpu-0") == (1, 100, 300.0, entries), timeout=5)
        assert await until(lambda: (a.peers() or {}).get("gpu-0") == (2, 200, 900.0, ((1, 900.0),)), timeout=5)
        view = b.peers()
        assert view is not None
        # B's policy reads the fleet estimate from them: its own 2 live entries and A's, newest 3 of 4.
        led = WorkLedger()
        led.record("gpu-0", 900.0)
        led.record("gpu-0", 50.0)
        assert led.fleet_pending("gpu-0", Inflight(2, 200), *view["gpu-0"][:2], view["gpu-0"][3]) == 1250.0  # type: ignore[misc]  # the 4-tuple
    finally:
        await a.stop()
        await b.stop()


_BACKENDS = 'backends: [{name: a, url: "http://127.0.0.1:1"}]\n'


def test_the_config_section_is_parsed_and_bounded() -> None:
    cfg = parse_config(_BACKENDS + "routing:\n  peer_load: {redis_url: 'redis://r:6379/0', refresh_ms: 100}\n")
    pl = cfg.routing.peer_load
    assert pl.enabled and pl.refresh_ms == 100 and pl.ttl_ms == 1000 and pl.key_prefix == "affinity-proxy:peer-load"
    assert PeerLoadConfig(redis_url="redis://r", refresh_ms=500).ttl_ms == 1500
    assert not parse_config(_BACKENDS).routing.peer_load.enabled
    with pytest.raises(ConfigError) as err:
        parse_config(_BACKENDS + "routing:\n  peer_load: {redis_url: 'http://r', refresh_ms: 5, replica_id: ' '}\n")
    text = str(err.value)
    assert "routing.peer_load.redis_url" in text and "routing.peer_load.refresh_ms" in text
    assert "routing.peer_load.replica_id" in text
    with pytest.raises(ValueError):
        PeerLoadConfig(redis_url="redis://r", refresh_ms=0)


async def test_workers_of_a_host_publish_their_own_parts_under_the_supervisors_id(
        redis_server: RedisServer) -> None:
    """The app's wiring for --workers: each worker (role "data", its row of the shared load block)
    publishes under `<hostname:supervisor pid>/<its index>` its own row of the shared table and its own
    ledger entries; another replica sums the rows (the host's load once, whichever worker routed it), and
    each worker's policy reads its mate's request and entry from the shared block, next to the view."""
    from proxy.app import AffinityProxy
    from proxy.multiproc.shared_load import SharedLoad

    shared = SharedLoad.create(2, slots=8)
    text = (f"{_BACKENDS}telemetry: {{enabled: false}}\nhealth_checks: {{enabled: false}}\n"
            f"routing:\n  policy: affinity\n  peer_load: {{redis_url: '{redis_server.url}', refresh_ms: 20, key_prefix: k}}\n")
    tables = [shared.table(0), shared.table(1)]
    for t in tables:
        t.assign({"a": 0})
    workers = [AffinityProxy(parse_config(text), role="data", reuse_port=True, inflight=t) for t in tables]
    viewer = _exchange(PeerLoadConfig(redis_url=redis_server.url, refresh_ms=20, key_prefix="k",
                                      replica_id="elsewhere"), {})
    try:
        ids = [w.peer_load.replica_id for w in workers]  # type: ignore[union-attr]  # built for data roles
        assert ids == [f"{socket.gethostname()}:{os.getppid()}/{i}" for i in (0, 1)]
        for w, t, tokens in ((workers[1], tables[1], 300), (workers[0], tables[0], 100)):
            assert w._work is not None  # the affinity policy's ledger, which the worker publishes
            w._work.record("a", float(tokens), t)  # a request routed by this worker
            t.acquire("a", tokens)
        own = [w._own_load()["a"] for w in workers]
        assert [o[:2] for o in own] == [(1, 100), (1, 300)]  # each its own part of the host's 2
        assert [[tok for _age, tok in o[3]] for o in own] == [[100.0], [300.0]]  # type: ignore[misc]  # rows with entries
        for w in workers:
            await w.peer_load.start()  # type: ignore[union-attr]  # the exchange alone: no listeners needed
        await viewer.start()
        assert await until(lambda: (viewer.peers() or {}).get("a", (0, 0))[:2] == (2, 400), timeout=5)
        # Each worker's view: the other host's (empty) row, not its mate's; the mate comes from the block.
        def fresh() -> bool:
            return all(w.peer_load.peers() == {"a": (0, 0, 0.0, ())} for w in workers)  # type: ignore[union-attr]
        assert await until(fresh, timeout=5)
        for w, t in zip(workers, tables):
            assert w._work is not None
            merged, pending = AffinityPolicy._with_peers(w.peer_load.peers() or {}, t, w._work)  # type: ignore[union-attr]
            assert merged["a"] == Inflight(2, 400) and pending("a", merged["a"]) == 400.0
    finally:
        await viewer.stop()
        for w in workers:
            await w.peer_load.stop()  # type: ignore[union-attr]
        tables[0].release("a", 100)
        tables[1].release("a", 300)


async def test_stop_ends_a_loop_that_swallowed_its_first_cancellation() -> None:
    """Python < 3.12's wait_for can swallow a cancellation racing its inner call's result, and the
    exchange loop runs on: stop() cancels until the task has ended (it used to hang for good)."""
    import asyncio

    ex = _exchange(PeerLoadConfig(redis_url="redis://127.0.0.1:1/0"), {})
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed > 1:
                    raise

    ex._task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(ex._stop_loop(), 5)
    assert swallowed == 2 and ex._task is None


def test_a_full_row_decodes_in_one_checked_step_as_entry_by_entry() -> None:
    """Round 5: a row as this version publishes it (every backend with its entries) is decoded and
    checked by msgspec in one step (~7x cheaper per row); the result is the entry-by-entry parse's, and
    anything else (NaN, an older replica's sums, a bad entry) still takes the tolerant path."""
    from proxy.control.peer_load import encode_row, parse_row

    load = {"a": (2, 200, 60.0, ((0, 30.0), (1, 7.0))), "b": (0, 0, 0.0, ())}
    raw = encode_row(load)
    assert json.loads(raw) == {"a": [2, 200, 60.0, [[0, 30.0], [1, 7.0]]], "b": [0, 0, 0.0, []]}
    assert parse_row(raw) == parse_row(json.dumps(json.loads(raw))) == {
        "a": (2, 200, 60.0, [(0, 30.0), (1, 7.0)]), "b": (0, 0, 0.0, [])}
    got = parse_row(json.dumps({"a": [1, 1, 3, [[0, 5]]]}))  # integer tokens read as floats
    assert got == {"a": (1, 1, 3.0, [(0, 5.0)])} and isinstance(got["a"][3][0][1], float)  # type: ignore[index, misc]  # with entries
    assert parse_row(json.dumps({"a": [1, 1, float("nan"), []], "b": [1, 1, 1.0, [[0, 2.0]]]})) == {
        "b": (1, 1, 1.0, [(0, 2.0)])}
