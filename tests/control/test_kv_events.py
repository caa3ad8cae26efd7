"""The KV-event subscriber against the simulator's publisher: live events, gaps and replays, restarts,
silence, garbage, and a backend that publishes nothing."""

from __future__ import annotations

import asyncio
import socket
from typing import Callable

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from proxy.control.kv_events import KVEventSubscriber
from proxy.control.telemetry_config import KVEventsEndpoint
from proxy.core.kv_index import KVIndex
from sim.kv_events import KVEventPublisher, KVEventsConfig
from sim.kvcache import Removed, Stored
from sim.tokenizer import token_ids
from sim.tokens import VOCAB

BS = 4
MODEL = "m"
W = VOCAB[:24]  # six blocks of four words


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stored(i: int, parent: int | None = None) -> Stored:
    """Block i of the chain W, keyed i + 100 by the 'engine'."""
    return Stored((100 + i,), parent, tuple(W[BS * i : BS * (i + 1)]), None)


def _chain(n: int) -> list[Stored]:
    return [_stored(i, 100 + i - 1 if i else None) for i in range(n)]


def _prompt(n_blocks: int) -> list[int]:
    return token_ids(" ".join(W[: BS * n_blocks]))


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


class Rig:
    def __init__(self, replay: bool = True, stale_after_s: float = 30.0, silent_backend: bool = False,
                 drain_interval_s: float = 0.0) -> None:
        self.pub_port, self.replay_port = _port(), _port()
        self.replay = replay
        self.ctx = zmq.asyncio.Context()
        self.index = KVIndex()
        self.registry = CollectorRegistry()
        backends = {"b0": KVEventsEndpoint(endpoint=f"tcp://127.0.0.1:{self.pub_port}",
                                           replay_endpoint=f"tcp://127.0.0.1:{self.replay_port}" if replay else None,
                                           topic="kv")}
        if silent_backend:
            backends["quiet"] = KVEventsEndpoint(endpoint=f"tcp://127.0.0.1:{_port()}")
        self.sub = KVEventSubscriber(self.index, backends, models={"b0": MODEL, "quiet": MODEL},
                                     registry=self.registry, stale_after_s=stale_after_s, replay_timeout_s=2.0,
                                     context=self.ctx, drain_interval_s=drain_interval_s)
        self.pub = self.new_publisher()

    def new_publisher(self) -> KVEventPublisher:
        return KVEventPublisher(KVEventsConfig(endpoint=f"tcp://127.0.0.1:{self.pub_port}", topic="kv",
                                               replay_endpoint=f"tcp://127.0.0.1:{self.replay_port}" if self.replay else None,
                                               encoding="array"), block_size=BS, context=self.ctx)

    async def connected(self) -> None:
        await asyncio.sleep(0.6)  # PUB drops messages until the SUB's subscription reached it

    async def running_with(self, blocks: int) -> None:
        """Publisher and subscriber started and connected, the first `blocks` blocks of W indexed."""
        self.pub.start()
        await self.sub.start()
        await self.connected()
        self.pub.publish(_chain(blocks))
        await _until(lambda: self.index.num_blocks("b0") == blocks)

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, {"backend": "b0", **labels}) or 0.0

    async def close(self) -> None:
        await self.sub.stop()
        await self.pub.stop()
        self.ctx.destroy(linger=0)


async def _rigs(drain_interval_s: float):
    rigs: list[Rig] = []

    def make(**kw) -> Rig:
        kw.setdefault("drain_interval_s", drain_interval_s)
        r = Rig(**kw)
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        await r.close()


@pytest.fixture(params=[0.0, 0.05], ids=["each-message", "drained"])
async def rig(request):
    """Rigs whose subscriber applies each message as it arrives, then (telemetry.kv_events.drain_interval_ms)
    what arrived every 50 ms: the sequence logic is the same either way."""
    async for make in _rigs(request.param):
        yield make


@pytest.fixture
async def rig_each():
    """Rigs whose subscriber applies each message as it arrives (a reader on the socket's descriptor),
    unless the test names a drain interval."""
    async for make in _rigs(0.0):
        yield make


async def test_live_events_fill_the_index_and_removals_empty_it(rig) -> None:
    r = rig(silent_backend=True)
    r.pub.start()
    await r.sub.start()
    await r.connected()
    assert r.index.state("b0") == "stale" and r.index.match(_prompt(3), MODEL) == {}
    r.pub.publish(_chain(3))
    await _until(lambda: r.index.is_fresh("b0") and r.index.num_blocks("b0") == 3)
    # the quiet backend never published: it is left out (learned index), not reported as empty
    assert r.index.match(_prompt(3), MODEL) == {"b0": 12}
    r.pub.publish([Removed((101,))])
    await _until(lambda: r.index.num_blocks("b0") == 2)
    assert r.index.match(_prompt(3), MODEL) == {"b0": 4}
    assert r.metric("affinity_proxy_kv_events_total") == 4
    assert r.metric("affinity_proxy_kv_index_blocks") == 2 and r.metric("affinity_proxy_kv_index_fresh") == 1
    assert r.registry.get_sample_value("affinity_proxy_kv_index_fresh", {"backend": "quiet"}) == 0
    assert r.metric("affinity_proxy_kv_events_per_second") > 0
    assert r.sub.status()["b0"]["expected_seq"] == 2


async def test_a_gap_is_replayed_and_restores_the_index(rig) -> None:
    r = rig()
    await r.running_with(1)
    r.pub.drop_next = 2  # lost on the PUB socket, still in the replay buffer
    r.pub.publish([_stored(1, 100)])
    r.pub.publish([_stored(2, 101)])
    r.pub.publish([_stored(3, 102)])
    await _until(lambda: r.index.num_blocks("b0") == 4)
    assert r.index.match(_prompt(4), MODEL) == {"b0": 16} and r.index.is_fresh("b0")
    assert r.metric("affinity_proxy_kv_event_gaps_total") == 1
    assert r.metric("affinity_proxy_kv_event_replays_total", outcome="complete") == 1


async def test_a_gap_without_replay_clears_the_index(rig) -> None:
    r = rig(replay=False)
    r.pub.start()
    await r.sub.start()
    await r.connected()
    r.pub.publish(_chain(2))
    await _until(lambda: r.index.num_blocks("b0") == 2)
    r.pub.drop_next = 1
    r.pub.publish([Removed((100, 101))])  # lost: keeping blocks 0 and 1 would over-report
    r.pub.publish([_stored(0), _stored(5, 104)])  # new chain start + an orphan
    await _until(lambda: r.metric("affinity_proxy_kv_event_gaps_total") == 1 and r.index.is_fresh("b0"))
    assert r.index.num_blocks("b0") == 1 and r.index.stats("b0")["orphans"] == 1


async def test_a_late_subscriber_replays_the_buffered_history(rig) -> None:
    r = rig()
    r.pub.start()
    r.pub.publish(_chain(2))
    r.pub.publish([_stored(2, 101)])
    await r.sub.start()
    await r.connected()
    r.pub.publish([_stored(3, 102)])
    await _until(lambda: r.index.num_blocks("b0") == 4)
    assert r.metric("affinity_proxy_kv_event_replays_total", outcome="complete") == 1
    assert r.metric("affinity_proxy_kv_event_gaps_total") == 0


async def test_a_restarted_engine_clears_its_index(rig) -> None:
    r = rig()
    r.pub.start()
    await r.sub.start()
    await r.connected()
    r.pub.publish(_chain(3))
    for _ in range(9):  # seq 1..9 (the same block again): the restarted engine's numbers stay below
        r.pub.publish([_stored(3, 102)])
    await _until(lambda: r.index.num_blocks("b0") == 4)
    await r.pub.stop()  # engine killed ...
    r.pub = r.new_publisher()  # ... and started again: empty cache, sequence from 0
    for _ in range(50):
        try:
            r.pub.start()  # the old sockets close in ZeroMQ's I/O thread: the port may still be taken
            break
        except zmq.ZMQError:
            await r.pub.stop()
            await asyncio.sleep(0.05)
    for _ in range(50):  # the SUB reconnects by itself; what it misses meanwhile comes back by replay
        await asyncio.sleep(0.1)
        if r.metric("affinity_proxy_kv_event_restarts_total"):
            break
        if r.pub.next_seq < 5:  # until the SUB has reconnected, batches are lost: send a few
            r.pub.publish([_stored(0)])
    await _until(lambda: r.metric("affinity_proxy_kv_event_restarts_total") == 1 and r.index.is_fresh("b0"))
    assert r.index.num_blocks("b0") == 1 and r.index.match(_prompt(4), MODEL) == {"b0": 4}


async def test_silence_makes_a_backend_stale_until_it_speaks_again(rig) -> None:
    r = rig(stale_after_s=0.3)
    r.pub.start()
    await r.sub.start()
    await r.connected()
    r.pub.publish(_chain(1))
    await _until(lambda: r.index.is_fresh("b0"))
    await _until(lambda: not r.index.is_fresh("b0"), timeout=3.0)
    assert r.index.num_blocks("b0") == 1  # kept, just not trusted
    r.pub.publish([_stored(1, 100)])
    await _until(lambda: r.index.is_fresh("b0") and r.index.num_blocks("b0") == 2)


async def test_a_burst_is_drained_in_order_and_the_socket_wakes_the_loop_again(rig) -> None:
    """The subscriber reads its socket without a future per message: everything queued while the loop was
    busy is applied in order on one wake-up, and the (edge-triggered) socket wakes it for the next one."""
    r = rig()
    await r.running_with(1)
    for _ in range(150):  # queued faster than one wake-up each: stored and removed again, block 1
        r.pub.publish([_stored(1, 100)])
        r.pub.publish([Removed((101,))])
    r.pub.publish(_chain(3)[1:])
    await _until(lambda: r.sub.status()["b0"]["expected_seq"] == 302)
    assert r.index.num_blocks("b0") == 3 and r.metric("affinity_proxy_kv_event_gaps_total") == 0
    await asyncio.sleep(0.3)  # idle: the next message must wake the loop again
    r.pub.publish([Removed((102,))])
    await _until(lambda: r.index.num_blocks("b0") == 2)
    assert r.index.match(_prompt(3), MODEL) == {"b0": 8}


async def test_a_dropped_subscription_stops_watching_its_socket_before_the_socket_closes(rig_each) -> None:
    """The descriptor of a closed socket can be reused at once (by the next subscription's socket): the
    loop must not keep the old reader on it until the cancelled task gets to run."""
    r = rig_each()
    await r.running_with(1)
    loop, fd = r.sub._readers["b0"]
    assert r.sub.reconfigure({}, {}) == ["b0"]
    assert not loop.remove_reader(fd)  # already removed, synchronously
    await asyncio.sleep(0.05)  # the cancelled task finishes without touching what is no longer its own
    assert "b0" not in r.sub._readers and r.sub.feeds() == {}.keys()


async def test_garbage_is_counted_and_the_stream_goes_on(rig) -> None:
    r = rig(replay=False)
    raw = r.ctx.socket(zmq.PUB)
    raw.bind(f"tcp://127.0.0.1:{r.pub_port}")
    try:
        await r.sub.start()
        await r.connected()
        await raw.send_multipart([b"kv", b"\x00" * 8, b"\xc1garbage"])
        await raw.send_multipart([b"kv", b"\x01"])
        from sim.kv_events import encode_batch

        await raw.send_multipart([b"kv", (0).to_bytes(8, "big"), encode_batch(_chain(1), 1.0, "map", BS)])
        await _until(lambda: r.index.num_blocks("b0") == 1)
        assert r.metric("affinity_proxy_kv_event_decode_errors_total") == 2
    finally:
        raw.close(0)


def test_a_backend_without_a_model_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="model"):
        KVEventSubscriber(KVIndex(), {"x": KVEventsEndpoint(endpoint="tcp://127.0.0.1:1")}, models={})


async def test_build_precise_routing_from_the_config(tmp_path) -> None:
    import dataclasses

    from proxy.config import ConfigError, parse_config
    from proxy.control.kv_events import build_precise_routing
    from proxy.dataplane.tokenize import TokenizerError
    from sim.tokenizer import TOKENIZER_DIR

    base = "backends:\n  - {name: a, url: 'http://127.0.0.1:1', models: [m]}\n  - {name: b, url: 'http://127.0.0.1:2'}\n"
    assert build_precise_routing(parse_config(base)) is None
    kv = "telemetry:\n  kv_events:\n    tokenizers: {m: '%s'}\n    backends:\n      a: {endpoint: 'tcp://127.0.0.1:5557'}\n"
    config = parse_config(base + kv % TOKENIZER_DIR)
    built = build_precise_routing(config)
    assert built is not None and built.models == {"a": "m"} and built.index.tracked() == []
    sub = built.subscriber(CollectorRegistry())
    assert built.index.tracked() == ["a"] and built.index.state("a") == "stale"
    assert list(sub.feeds()) == ["a"]
    await sub.stop()
    with pytest.raises(ValueError, match="model"):
        build_precise_routing(parse_config(base + (kv % TOKENIZER_DIR).replace("a: {", "b: {")))
    with pytest.raises(TokenizerError):  # a folder broken after the configuration's check
        build_precise_routing(dataclasses.replace(config, telemetry=dataclasses.replace(
            config.telemetry, kv_events=dataclasses.replace(config.telemetry.kv_events, tokenizers={"m": str(tmp_path)}))))
    with pytest.raises(ConfigError, match="tokenizers.m"):  # which the check refuses (issue 13)
        parse_config(base + kv % tmp_path)


async def test_a_restarted_engine_numbering_past_ours_is_caught_by_the_digest(rig) -> None:
    """The new engine has published past our sequence before the SUB reconnects (ZeroMQ waits 100 ms to
    reconnect): the first batch we see looks like a gap, and only the replayed payload of our last batch,
    which differs, shows that this is another stream."""
    r = rig()
    r.pub.start()
    await r.sub.start()
    await r.connected()
    r.pub.publish(_chain(3))
    await _until(lambda: r.index.num_blocks("b0") == 3)
    await r.pub.stop()
    r.pub = r.new_publisher()
    for _ in range(50):
        try:
            r.pub.start()
            break
        except zmq.ZMQError:
            await r.pub.stop()
            await asyncio.sleep(0.05)
    for _ in range(3):
        r.pub.publish([_stored(0)])  # seq 0..2, before the SUB is back
    for _ in range(50):
        await asyncio.sleep(0.1)
        if r.metric("affinity_proxy_kv_event_restarts_total"):
            break
        r.pub.publish([_stored(0)])
    await _until(lambda: r.metric("affinity_proxy_kv_event_restarts_total") == 1 and r.index.is_fresh("b0"))
    assert r.index.num_blocks("b0") == 1 and r.index.match(_prompt(3), MODEL) == {"b0": 4}


async def test_precise_wait_ms_is_validated_and_wires_the_routers_hook() -> None:
    from proxy.config import parse_config
    from proxy.control.kv_events import build_precise_routing
    from sim.tokenizer import TOKENIZER_DIR

    base = ("backends:\n  - {name: a, url: 'http://127.0.0.1:1', models: [m]}\n"
            "telemetry:\n  kv_events:\n    tokenizers: {m: '%s'}\n    backends:\n      a: {endpoint: 'tcp://127.0.0.1:5557'}\n"
            % TOKENIZER_DIR)
    built = build_precise_routing(parse_config(base))
    assert built is not None and built.prepare is not None
    assert built.matcher.wait_s == 0.2  # type: ignore[attr-defined]  # the default, 200 ms
    registry = CollectorRegistry()
    sub = built.subscriber(registry)
    assert registry.get_sample_value("affinity_proxy_precise_wait_seconds_count") == 0
    assert registry.get_sample_value("affinity_proxy_precise_wait_timeouts_total") == 0
    assert registry.get_sample_value("affinity_proxy_precise_wait_skipped_total") == 0
    built.matcher.wait_skipped = 3  # type: ignore[attr-defined]
    assert registry.get_sample_value("affinity_proxy_precise_wait_skipped_total") == 3
    await sub.stop()
    off = build_precise_routing(parse_config(base + "    precise_wait_ms: 0\n"))
    assert off is not None and off.prepare is None  # never wait: the learned index routes long first sightings
    with pytest.raises(ValueError, match="precise_wait_ms"):
        parse_config(base + "    precise_wait_ms: -5\n")


async def test_a_workers_host_mates_read_its_index_count_as_of_each_batch(rig) -> None:
    """A --workers worker's subscriber publishes its index's count after every batch it applies
    (`on_progress`), so a host-mate's read of the host's queued prefill subtracts the engine's progress
    since this worker's entry at once, not as of this worker's next request there."""
    from proxy.core.inflight import SharedInflightTable, SharedLayout
    from proxy.core.work_ledger import WorkLedger

    r = rig()
    layout = SharedLayout(rows=2, slots=1)
    buf = memoryview(bytearray(layout.size))
    w0, w1 = SharedInflightTable(buf, layout, 0), SharedInflightTable(buf, layout, 1)
    for t in (w0, w1):
        t.assign({"b0": 0})
    w0.follow_progress(r.index.progress)
    w1.follow_progress({"b0": 0})  # the mate's own index (not fed here)
    r.sub.on_progress = w0.publish_count
    r.pub.start()
    await r.sub.start()
    await r.connected()
    WorkLedger(progress=r.index.progress).record("b0", 100.0, w0)
    w0.acquire("b0", 100)
    assert w1["b0"].backlog() == (100.0, 100.0)
    # One prefill of three blocks (12 tokens) stored since worker 0's entry (single blocks are decode).
    r.pub.publish([Stored((100, 101, 102), None, tuple(W[:3 * BS]), None)])
    await _until(lambda: w1["b0"].backlog() == (100.0, 88.0))
    w0.release("b0", 100)


async def test_drained_events_wait_for_a_pick_or_the_timer_and_then_apply_all_in_order(rig_each) -> None:
    """With a drain interval, a message does not wake the process: what arrived is applied when the router
    calls `drain` before a pick (synchronously: the pick reads it), or by the timer. A batch that needs a
    replay (here a gap) goes to the backend's task, and what follows it waits its turn."""
    r = rig_each(drain_interval_s=60.0)  # the timer never fires in this test
    r.pub.start()
    await r.sub.start()
    await r.connected()
    r.pub.publish(_chain(2))  # seq 0: nothing to replay before it, applied by the drain itself
    await asyncio.sleep(0.3)
    assert r.index.num_blocks("b0") == 0 and r.index.state("b0") == "stale"  # arrived, not applied
    r.sub.drain()
    assert r.index.num_blocks("b0") == 2 and r.index.is_fresh("b0")
    r.pub.publish([_stored(2, 101)])
    r.pub.publish([Removed((101, 102))])
    await asyncio.sleep(0.3)
    assert r.index.num_blocks("b0") == 2
    r.sub.drain()
    assert r.index.num_blocks("b0") == 1 and r.index.match(_prompt(3), MODEL) == {"b0": 4}
    r.pub.drop_next = 1  # seq 3 lost on the socket, kept for replay
    r.pub.publish([_stored(1, 100)])
    r.pub.publish([_stored(2, 101)])  # seq 4: a gap
    r.pub.publish([_stored(3, 102)])  # seq 5: behind the gap
    await asyncio.sleep(0.3)
    r.sub.drain()  # hands seq 4 to the task (a replay is awaited), leaves seq 5 to it
    await _until(lambda: r.sub.status()["b0"]["expected_seq"] == 6)
    assert r.index.num_blocks("b0") == 4 and r.index.is_fresh("b0")
    assert r.metric("affinity_proxy_kv_event_replays_total", outcome="complete") == 1
    assert r.sub.reconfigure({}, {}) == ["b0"]
    r.sub.drain()  # the dropped backend's closed socket is not read


async def test_drained_the_timer_applies_events_and_judges_silence(rig_each) -> None:
    r = rig_each(drain_interval_s=0.1, stale_after_s=0.5)
    await r.running_with(2)  # applied by the timer: no pick drains here
    assert r.index.is_fresh("b0")
    await _until(lambda: not r.index.is_fresh("b0"), timeout=3.0)  # silent past stale_after_s
    r.pub.publish([_stored(2, 101)])
    await _until(lambda: r.index.is_fresh("b0") and r.index.num_blocks("b0") == 3)
