"""KV-event subscriptions follow a reload (issue 13): a backend added to `telemetry.kv_events.backends`
is subscribed and fills the index, a removed one stops and leaves it, a changed endpoint starts afresh,
an unchanged one keeps its stream."""

from __future__ import annotations

import asyncio

import zmq.asyncio
from prometheus_client import CollectorRegistry

from proxy.config import parse_config
from proxy.control.kv_events import KVEventSubscriber
from proxy.control.telemetry_config import KVEventsEndpoint
from proxy.core.kv_index import KVIndex
from sim.kv_events import KVEventPublisher, KVEventsConfig
from sim.tokenizer import TOKENIZER_DIR

from .test_kv_events import BS, MODEL, _chain, _port, _prompt, _until


def _publisher(ctx: zmq.asyncio.Context, port: int) -> KVEventPublisher:
    return KVEventPublisher(KVEventsConfig(endpoint=f"tcp://127.0.0.1:{port}", topic="kv", encoding="array"),
                            block_size=BS, context=ctx)


def _ep(port: int) -> KVEventsEndpoint:
    return KVEventsEndpoint(endpoint=f"tcp://127.0.0.1:{port}", topic="kv")


async def test_reconfigure_adds_and_removes_subscriptions() -> None:
    ctx = zmq.asyncio.Context()
    p0, p1, p2 = _port(), _port(), _port()
    pubs = [_publisher(ctx, p) for p in (p0, p1, p2)]
    for p in pubs:
        p.start()
    index = KVIndex()
    sub = KVEventSubscriber(index, {"b0": _ep(p0)}, models={"b0": MODEL}, registry=CollectorRegistry(), context=ctx)
    try:
        await sub.start()
        await asyncio.sleep(0.6)  # PUB drops messages until the SUB's subscription reached it
        pubs[0].publish(_chain(2))
        await _until(lambda: index.num_blocks("b0") == 2)

        # A reload adds b1: tracked at once (stale: "no events yet" is never "empty"), then subscribed.
        changed = sub.reconfigure({"b0": _ep(p0), "b1": _ep(p1)}, {"b0": MODEL, "b1": MODEL})
        assert changed == ["b1"]
        assert sorted(sub.feeds()) == ["b0", "b1"] and index.state("b1") == "stale"
        await asyncio.sleep(0.6)
        pubs[1].publish(_chain(3))
        await _until(lambda: index.is_fresh("b1") and index.num_blocks("b1") == 3)
        assert index.match(_prompt(3), MODEL) == {"b0": 2 * BS, "b1": 3 * BS}
        assert index.num_blocks("b0") == 2  # b0's stream and index were left alone
        pubs[0].publish(_chain(3)[2:])
        await _until(lambda: index.num_blocks("b0") == 3)

        # b0 leaves the config: its subscription stops and its index goes (the learned index decides for it).
        assert sub.reconfigure({"b1": _ep(p1)}, {"b1": MODEL}) == ["b0"]
        assert "b0" not in index and list(sub.feeds()) == ["b1"]
        assert "b0" not in sub._tasks and "b0" not in sub._sockets
        pubs[0].publish(_chain(4))
        await asyncio.sleep(0.3)
        assert "b0" not in index

        # b1 moves to another endpoint (a new engine): dropped and subscribed afresh, empty until it speaks.
        assert sub.reconfigure({"b1": _ep(p2)}, {"b1": MODEL}) == ["b1"]
        assert index.num_blocks("b1") == 0 and index.state("b1") == "stale"
        await asyncio.sleep(0.6)
        pubs[2].publish(_chain(1))
        await _until(lambda: index.is_fresh("b1") and index.num_blocks("b1") == 1)
        # Nothing changed: nothing restarts.
        assert sub.reconfigure({"b1": _ep(p2)}, {"b1": MODEL}) == []
        assert index.num_blocks("b1") == 1
    finally:
        await sub.stop()
        for p in pubs:
            await p.stop()
        ctx.destroy(linger=0)


async def test_a_reloaded_config_drives_the_subscriptions() -> None:
    """`reload` is the listener the proxy registers: it reads `telemetry.kv_events` of the new config,
    and a config it cannot use (a listed backend with no model) leaves the subscriptions as they were."""
    base = "backends:\n  - {name: a, url: 'http://127.0.0.1:1', models: [m]}\n  - {name: b, url: 'http://127.0.0.1:2'}\n"
    kv = "telemetry:\n  kv_events:\n    tokenizers: {m: '%s'}\n    backends:\n" % TOKENIZER_DIR
    a = "      a: {endpoint: 'tcp://127.0.0.1:%d'}\n" % _port()
    b_with_model = "      b: {endpoint: 'tcp://127.0.0.1:%d', model: m}\n" % _port()
    b_without = "      b: {endpoint: 'tcp://127.0.0.1:%d'}\n" % _port()
    index = KVIndex()
    sub = KVEventSubscriber(index, {}, models={}, registry=CollectorRegistry())
    try:
        await sub.start()
        sub.reload(parse_config(base + kv + a))
        assert list(sub.feeds()) == ["a"] and index.tracked() == ["a"]
        sub.reload(parse_config(base + kv + a + b_with_model))
        assert sorted(sub.feeds()) == ["a", "b"]
        sub.reload(parse_config(base + kv + b_without))
        assert sorted(sub.feeds()) == ["a", "b"]  # refused: b has no model; nothing changed
        sub.reload(parse_config(base))
        assert list(sub.feeds()) == [] and index.tracked() == []
    finally:
        await sub.stop()


def test_discovered_backends_fill_in_their_services_template() -> None:
    """`kv_event_backends` with the snapshot's fleet: a static backend's `{host}` is its URL host; a
    service that discovery resolves subscribes each `<service>@<address>` at its own address (IPv6 in
    brackets), never the service's own name; its model seeds each one's keys."""
    from proxy.control.kv_events import kv_event_backends
    from proxy.core.snapshot import BackendSpec

    text = ("discovery: {enabled: true}\nbackends:\n"
            "  - {name: s, url: 'http://10.0.0.9:8000', models: [m]}\n"
            "  - {name: vllm, url: 'http://vllm.ns.svc:8000', models: [big]}\n"
            "telemetry:\n  kv_events:\n    tokenizers: {m: '%s'}\n    backends:\n"
            "      s: {endpoint: 'tcp://{host}:5557'}\n"
            "      vllm: {endpoint: 'tcp://{host}:5557', replay_endpoint: 'tcp://{host}:5558', topic: kv}\n"
            % TOKENIZER_DIR)
    config = parse_config(text)
    endpoints, models = kv_event_backends(config)
    assert endpoints == {"s": KVEventsEndpoint(endpoint="tcp://10.0.0.9:5557")} and models == {"s": "m"}
    fleet = [BackendSpec("s", "http://10.0.0.9:8000", models=("m",)),
             BackendSpec("vllm@10.1.0.4:8000", "http://10.1.0.4:8000", models=("big",)),
             BackendSpec("vllm@[fd00::7]:8000", "http://[fd00::7]:8000", models=("big",)),
             BackendSpec("other@10.1.0.5:8000", "http://10.1.0.5:8000")]
    endpoints, models = kv_event_backends(config, fleet)
    assert sorted(endpoints) == ["s", "vllm@10.1.0.4:8000", "vllm@[fd00::7]:8000"]
    assert endpoints["vllm@10.1.0.4:8000"] == KVEventsEndpoint(
        endpoint="tcp://10.1.0.4:5557", replay_endpoint="tcp://10.1.0.4:5558", topic="kv")
    assert endpoints["vllm@[fd00::7]:8000"].endpoint == "tcp://[fd00::7]:5557"
    assert models["vllm@10.1.0.4:8000"] == "big"


async def test_the_subscriptions_follow_the_snapshots_fleet() -> None:
    """A discovered backend joining the snapshot is tracked and subscribed; once it left, it is gone."""
    from proxy.control.store import SnapshotStore
    from proxy.core.snapshot import BackendSpec, BackendState, Snapshot

    config = parse_config(
        "discovery: {enabled: true}\nbackends:\n  - {name: vllm, url: 'http://vllm.ns.svc:8000', models: [m]}\n"
        "telemetry:\n  kv_events:\n    tokenizers: {m: '%s'}\n    backends:\n"
        "      vllm: {endpoint: 'tcp://{host}:%d'}\n" % (TOKENIZER_DIR, _port()))
    store = SnapshotStore(Snapshot.initial(config.backend_specs()))
    index = KVIndex()
    sub = KVEventSubscriber(index, {}, models={}, registry=CollectorRegistry(), config=config, store=store)
    try:
        await sub.start()
        assert list(sub.feeds()) == []  # the service's own name is no backend to subscribe
        pod = BackendState(spec=BackendSpec("vllm@127.0.0.1:8000", "http://127.0.0.1:8000", models=("m",)))
        store.publish(store.current.evolve([pod]))
        assert list(sub.feeds()) == ["vllm@127.0.0.1:8000"] and index.state("vllm@127.0.0.1:8000") == "stale"
        assert "vllm@127.0.0.1:8000" in sub._tasks
        store.publish(store.current.evolve([pod]))  # the same fleet (new load signals): nothing changes
        assert list(sub.feeds()) == ["vllm@127.0.0.1:8000"]
        store.publish(store.current.evolve([]))
        assert list(sub.feeds()) == [] and index.tracked() == [] and sub._tasks == {}
    finally:
        await sub.stop()


def test_a_reload_of_kv_event_backends_or_tokenizers_is_not_reported_as_needing_a_restart() -> None:
    """The subscriber applies `telemetry.kv_events.backends` and `.tokenizers` at once, so the reload's
    "take effect only after a restart" warning must not name telemetry for them; any other telemetry
    change, and switching KV events on or off, still needs the restart and is named."""
    from proxy.resilience import restart_only_changes
    base = "backends:\n  - {name: a, url: 'http://127.0.0.1:1', models: [m]}\n  - {name: b, url: 'http://127.0.0.1:2', models: [m]}\n"
    kv = "telemetry:\n  kv_events:\n    tokenizers: {m: '%s'}\n    backends:\n" % TOKENIZER_DIR
    a = "      a: {endpoint: 'tcp://127.0.0.1:5557'}\n"
    b = "      b: {endpoint: 'tcp://127.0.0.1:5558'}\n"
    one, two = parse_config(base + kv + a), parse_config(base + kv + a + b)
    assert restart_only_changes(one, two) == []
    assert restart_only_changes(one, parse_config(base)) == ["telemetry"]
    slower = parse_config(base + "telemetry:\n  interval_ms: 500\n  kv_events:\n    tokenizers: {m: '%s'}\n"
                          "    backends:\n" % TOKENIZER_DIR + a)
    assert restart_only_changes(one, slower) == ["telemetry"]
    assert restart_only_changes(one, parse_config(base + kv + a + "limits: {max_body_bytes: 1000}\n")) == ["limits"]
    # The eviction-aware placement (routing.affinity.eviction_band_tokens) needs an index built with it.
    placed = parse_config(base + kv + a + "routing:\n  affinity: {eviction_band_tokens: 2048}\n")
    assert restart_only_changes(one, placed) == ["routing.affinity.eviction_band_tokens"]
    assert restart_only_changes(placed, one) == []  # switching it off applies at once (the rule abstains)
