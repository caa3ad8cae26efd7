"""KV-event subscriber: every backend's ZeroMQ event stream into the precise index (`proxy.core.kv_index`).

One SUB socket per configured backend (`telemetry.kv_events.backends`), one asyncio task each. Every worker
process and every replica runs its own subscriber and so holds the same index: what the engines report,
not what one process routed.

Sequence handling (vLLM numbers batches 0, 1, 2, ... per publisher process):

- first batch seen at seq s > 0, with a replay endpoint: ask the ROUTER for 0..s-1 (what its buffer still
  holds) so blocks cached before we connected are known; without one, start at s (older blocks stay
  unknown: the index under-reports, never over-reports).
- seq > expected: a gap (the PUB socket dropped messages). The backend is stale until a replay of
  expected..seq-1 succeeds; if the replay is missing, incomplete or times out, the index of that backend is
  cleared (removals may have been lost, so what it holds could be wrong) and rebuilt from here on.
- seq < expected: the publisher restarted (engine killed and started again): its cache is new, so the
  index is cleared, then filled as for a first batch.
- a restarted engine can also number past where the old one stopped before we reconnect, so after a gap
  or a disconnect (ZeroMQ socket monitor) the replay starts one batch early, at the last batch applied
  here, whose payload digest must match: a different batch there means a new engine (index cleared,
  history replayed from 0). Without a replay endpoint such a stream cannot be verified: cleared.
- no batch for `stale_after_s`: stale (routing falls back to the learned index) until the next batch,
  which makes it fresh again if it continues the sequence. An idle engine publishes nothing, so a quiet
  backend is "unknown", never "empty".

Applying the events: by default (`telemetry.kv_events.drain_interval_ms` > 0) nothing wakes the process when
a message arrives. The router calls `drain` before every pick, which reads, without awaiting, the sockets
one poll of their descriptors reports, and applies the batches in sequence; a timer does the same every
interval; a batch that needs a replay goes to its backend's task. With 0, a reader on each socket's
descriptor applies each message as it arrives.

Only events for the GPU medium (or none) are indexed: CPU-offload tiers (`medium: "CPU"`) do not decide
prefill reuse the same way. Metrics (on the registry passed in): batches and events received, decode
errors, gaps, replays by outcome, restarts, lag (our wall clock minus the batch's `ts`), events/s over the
last 10 s, index blocks and freshness per backend.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import select
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Mapping, cast

import xxhash
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from zmq.utils.monitor import parse_monitor_message

from proxy.config import is_dns_name, url_host_port
from proxy.control.discovery import service_of
from proxy.control.store import SnapshotStore
from proxy.control.telemetry_config import KVEventsEndpoint
from proxy.core.affinity import PreciseLookup
from proxy.core.kv_index import AllBlocksCleared, BlockRemoved, BlockStored, KVIndex
from proxy.core.snapshot import BackendSpec, Snapshot
from proxy.metrics import cumulative_buckets
from proxy.wire.kv_events import EventBatch, KVEventDecodeError, decode_message, decode_replay, encode_replay_request

if TYPE_CHECKING:
    from proxy.config import Config
    from proxy.dataplane.shared_chunks import SharedChunks

__all__ = ["KVEventMetrics", "KVEventSubscriber"]

_log = logging.getLogger(__name__)
_RATE_WINDOW_S = 10.0
_INDEXED_MEDIA = (None, "GPU")


def _digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


class KVEventMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches = Counter("affinity_proxy_kv_event_batches", "KV-event batches received, by backend.",
                               ["backend"], registry=registry)
        self.events = Counter("affinity_proxy_kv_events", "KV-cache events applied to the precise index, by backend.",
                              ["backend"], registry=registry)
        self.decode_errors = Counter("affinity_proxy_kv_event_decode_errors",
                                     "KV-event messages that could not be decoded or applied, by backend.",
                                     ["backend"], registry=registry)
        self.gaps = Counter("affinity_proxy_kv_event_gaps", "Sequence gaps in a backend's KV-event stream.",
                            ["backend"], registry=registry)
        self.replays = Counter("affinity_proxy_kv_event_replays",
                               "Replay requests to a backend's KV-event ROUTER, by outcome (complete, incomplete, "
                               "timeout, restarted).", ["backend", "outcome"], registry=registry)
        self.restarts = Counter("affinity_proxy_kv_event_restarts",
                                "KV-event sequence resets (the engine restarted): the backend's index was cleared.",
                                ["backend"], registry=registry)


@dataclass
class _Feed:
    name: str
    config: KVEventsEndpoint
    expected: int | None = None
    last_digest: int | None = None  # xxh3 of the payload of batch expected-1
    reconnected: bool = False  # the PUB socket disconnected since the last batch
    last_ts: float | None = None
    lag_s: float | None = None
    recent: deque[tuple[float, int]] = field(default_factory=deque)  # (monotonic time, events)
    # With a drain interval (`KVEventSubscriber.drain`): the SUB socket read without asyncio and its
    # descriptor, the messages read there that need the sequence logic's awaits (history to replay before a
    # first batch, a gap, a restart, a reconnect: its task takes them), whether the task is handling some
    # now (drain() then leaves the feed to it), the task's wake-up, and when the last message was read (a
    # silence of stale_after_s makes the backend stale).
    raw: "zmq.Socket[bytes] | None" = None
    fd: int = -1
    held: deque[list[bytes]] = field(default_factory=deque)
    busy: bool = False
    wake: asyncio.Event | None = None
    heard_at: float = 0.0


class KVEventSubscriber:
    def __init__(
        self,
        index: KVIndex,
        backends: Mapping[str, KVEventsEndpoint],
        *,
        models: Mapping[str, str],
        registry: CollectorRegistry | None = None,
        stale_after_s: float = 30.0,
        replay_timeout_s: float = 2.0,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        config: Config | None = None,
        store: SnapshotStore | None = None,
        load_tokenizers: Callable[[Mapping[str, str]], object] | None = None,
        drain_interval_s: float = 0.0,
    ) -> None:
        """`models`: base model name per backend (seeds the keys of blocks without a LoRA name); a backend's
        own `model:` in the configuration wins. `config` and `store`: the configuration `backends` came
        from and the process's snapshot store; the subscriptions then follow the fleet as well as reloads:
        a backend that DNS discovery adds (``<service>@<address>``, named in `telemetry.kv_events.backends`
        by its service, with ``{host}`` in its endpoints) is subscribed, and unsubscribed once it left the
        snapshot (every --workers worker gets the supervisor's snapshots, so each follows by itself).
        `load_tokenizers`: called with `telemetry.kv_events.tokenizers` of every reloaded configuration
        (`PreciseMatcher.load_tokenizers`: a model added, or whose folder changed, gets its tokenizer).
        `drain_interval_s` (`telemetry.kv_events.drain_interval_ms`): 0 applies each message as it arrives
        (the loop wakes for every one); > 0 applies what arrived when `drain` is called (the router calls it
        before every pick, so a pick sees every message that has reached the socket) and at least this
        often otherwise: one wake-up a period for every engine together, the batches applied back to back."""
        self.index = index
        # Called with a backend's name after each batch of its events is applied (a --workers worker:
        # `SharedInflightTable.publish_count`, so its host-mates read its index's count as of now).
        self.on_progress: Callable[[str], None] | None = None
        self._feeds: dict[str, _Feed] = {}
        self._tracked: dict[str, str] = {}  # backend -> the model its block keys are seeded with
        for name, ep in backends.items():
            model = ep.model or models.get(name)
            if not model:
                raise ValueError(f"telemetry.kv_events.backends.{name}: no model known to seed its block keys "
                                 "(set `model:` or list the backend's models)")
            index.track(name, model=model)
            self._feeds[name] = _Feed(name, ep)
            self._tracked[name] = model
        self.stale_after_s = stale_after_s
        self.replay_timeout_s = replay_timeout_s
        self.drain_interval_s = drain_interval_s
        self._drain_timer: asyncio.TimerHandle | None = None
        # Drained mode: one poll set of every SUB socket's descriptor, so a drain asks the kernel once which
        # sockets may have messages (a ZMQ_EVENTS read per socket costs µs each, per pick).
        self._ready: "select.epoll | select.poll | None" = None
        self._by_fd: dict[int, _Feed] = {}
        self._own_ctx = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._clock = clock
        self._wall = wall_clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._sockets: dict[str, list[zmq.asyncio.Socket]] = {}  # per backend: its SUB, then its monitor
        # per backend: the loop watching its SUB socket's descriptor, and the descriptor (see _run)
        self._readers: dict[str, tuple[asyncio.AbstractEventLoop, int]] = {}
        self._started = False
        self.metrics = KVEventMetrics(registry) if registry is not None else None
        if registry is not None:
            registry.register(_IndexCollector(self))
        self._config = config
        self._load_tokenizers = load_tokenizers
        self._fleet: tuple[BackendSpec, ...] = ()
        if store is not None:
            self.follow(store.current)
            store.subscribe(self.follow)

    # ---- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._started = True
        for feed in self._feeds.values():
            self._subscribe(feed)
        if self.drain_interval_s > 0:
            self._drain_timer = asyncio.get_running_loop().call_later(self.drain_interval_s, self._tick)

    def _subscribe(self, feed: _Feed) -> None:
        loop = asyncio.get_running_loop()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.IPV6, 1)  # a discovered pod's address may be IPv6 (tcp://[fd00::7]:5557)
        sub.setsockopt(zmq.RCVHWM, 100_000)  # vLLM's PUB high-water mark: a busy loop queues, not drops
        sub.setsockopt(zmq.SUBSCRIBE, feed.config.topic.encode("utf-8"))
        sub.connect(feed.config.endpoint)
        self._sockets[feed.name] = [sub]
        if self.drain_interval_s > 0:
            raw: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
            feed.raw, feed.fd = raw, raw.fileno()
            feed.wake = asyncio.Event()
            feed.heard_at = self._clock()
            if self._ready is None:
                self._ready = select.epoll() if hasattr(select, "epoll") else select.poll()
            self._ready.register(feed.fd, select.POLLIN)
            self._by_fd[feed.fd] = feed
            run = self._run_drained(feed, sub)
        else:
            run = self._run(feed, sub)
        self._tasks[feed.name] = loop.create_task(run, name=f"kv-events-{feed.name}")

    def _unsubscribe(self, name: str) -> asyncio.Task[None] | None:
        """Stop one backend's subscription now (its task is cancelled; await the returned task to see it end)."""
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
        feed = self._feeds.get(name)
        if feed is not None:  # drain() no longer reads it (its socket closes below)
            if self._by_fd.get(feed.fd) is feed:
                del self._by_fd[feed.fd]
                assert self._ready is not None
                self._ready.unregister(feed.fd)  # before the close: the number may be reused at once
            feed.raw, feed.fd = None, -1
            feed.held.clear()
        reader = self._readers.pop(name, None)
        if reader is not None:  # before the socket closes: its descriptor number may be reused at once
            reader[0].remove_reader(reader[1])
        for sock in self._sockets.pop(name, ()):
            sock.close(linger=0)
        return task

    async def stop(self) -> None:
        self._started = False
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        tasks = [t for name in list(self._tasks) if (t := self._unsubscribe(name)) is not None]
        for t in tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
        if self._ready is not None:
            close = getattr(self._ready, "close", None)  # an epoll has a descriptor to close; a poll has none
            if close is not None:
                close()
            self._ready = None
        if self._own_ctx:
            self._ctx.destroy(linger=0)

    def reconfigure(self, backends: Mapping[str, KVEventsEndpoint], models: Mapping[str, str]) -> list[str]:
        """Follow a reload of `telemetry.kv_events.backends`: a backend no longer listed stops its
        subscription and leaves the index (routing falls back to the learned index for it); a new one is
        tracked (stale, empty) and subscribed; one whose endpoint, topic, replay endpoint or model changed
        is dropped and subscribed afresh (its old engine's blocks are not the new one's). Unchanged
        backends keep their subscription, sequence and index. Runs on the event loop (a reload
        listener); returns the backends whose subscription changed. `models`: as for the constructor."""
        changed: list[str] = []
        for name in list(self._feeds):
            ep = backends.get(name)
            if ep is None or ep != self._feeds[name].config or (ep.model or models.get(name)) != self._tracked[name]:
                self._unsubscribe(name)
                del self._feeds[name]
                del self._tracked[name]
                self.index.untrack(name)
                changed.append(name)
        for name, ep in backends.items():
            if name in self._feeds:
                continue
            model = ep.model or models.get(name)
            if not model:
                _log.warning("telemetry.kv_events.backends.%s: no model known to seed its block keys; "
                             "it keeps the learned index", name)
                continue
            self.index.track(name, model=model)
            self._tracked[name] = model
            feed = self._feeds[name] = _Feed(name, ep)
            if self._started:
                self._subscribe(feed)
            if name not in changed:
                changed.append(name)
        if changed:
            _log.info("KV events: subscriptions now %s (changed: %s)", sorted(self._feeds), ", ".join(changed))
        return changed

    def reload(self, config: Config) -> None:
        """A reload listener: follow `telemetry.kv_events` of the configuration swapped in (its tokenizers,
        then its subscriptions)."""
        if self._load_tokenizers is not None and config.telemetry.kv_events.enabled:
            self._load_tokenizers(config.telemetry.kv_events.tokenizers)
        try:
            endpoints, models = kv_event_backends(config, self._fleet)
        except ValueError as exc:  # a listed backend with no model: keep the subscriptions in force
            _log.error("reload: KV-event subscriptions unchanged: %s", exc)
            return
        self._config = config
        self.reconfigure(endpoints, models)

    def follow(self, snapshot: Snapshot) -> None:
        """A snapshot listener: subscribe the backends discovery added, drop those that left the snapshot
        (drained). One tuple comparison when no backend's spec changed (most snapshots only carry new load
        signals)."""
        if self._config is None:
            return
        fleet = tuple(b.spec for b in snapshot.backends)
        if fleet == self._fleet:
            return
        self._fleet = fleet
        try:
            endpoints, models = kv_event_backends(self._config, fleet)
        except ValueError as exc:  # not expected: `reload` kept only a configuration that resolved
            _log.error("KV-event subscriptions unchanged: %s", exc)
            return
        self.reconfigure(endpoints, models)

    def status(self) -> dict[str, dict[str, object]]:
        """Per backend: freshness, next expected sequence, lag, index counts (for admin/debug pages)."""
        out: dict[str, dict[str, object]] = {}
        for name, feed in self._feeds.items():
            out[name] = {"state": self.index.state(name), "expected_seq": feed.expected, "lag_s": feed.lag_s,
                         "events_per_s": self.events_per_s(name), **self.index.stats(name)}
        return out

    def events_per_s(self, name: str) -> float:
        feed = self._feeds[name]
        cutoff = self._clock() - _RATE_WINDOW_S
        while feed.recent and feed.recent[0][0] < cutoff:
            feed.recent.popleft()
        return sum(n for _, n in feed.recent) / _RATE_WINDOW_S

    # ---- one backend ----------------------------------------------------------------------------------
    async def _run(self, feed: _Feed, sub: zmq.asyncio.Socket) -> None:
        """Read the backend's SUB socket until cancelled.

        Messages are drained with plain non-blocking reads of the socket (`zmq.Socket.shadow`): a wake-up
        of the loop reads every message queued, with no future per message. The loop is woken by the
        socket's file descriptor, which ZeroMQ signals edge-triggered (when its events may have changed):
        so the wake-up flag is cleared before the queue is read, and reading it until ZMQ_EVENTS says no
        message is left is what re-arms the descriptor. A silence of `stale_after_s` while fresh marks
        the backend stale; a disconnect of the publisher (the socket monitor) marks it stale until its
        stream is shown to continue ours."""
        name = feed.name
        loop = asyncio.get_running_loop()
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        fd = raw.fileno()
        wake = asyncio.Event()
        loop.add_reader(fd, wake.set)
        self._readers[name] = (loop, fd)
        watcher = self._watching(feed, sub)
        silent = False

        def timed_out() -> None:
            nonlocal silent
            silent = True
            wake.set()

        try:
            while True:
                wake.clear()
                got = 0
                while cast(int, raw.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    frames = raw.recv_multipart(zmq.NOBLOCK)
                    await self.on_message(name, frames)
                    got += 1
                    if got % 64 == 0:
                        await asyncio.sleep(0)  # a long backlog does not hold the loop
                if got:
                    silent = False
                elif silent:
                    _log.info("KV events from %s silent for %.1f s: stale, routing falls back to the learned "
                              "index", name, self.stale_after_s)
                    self.index.mark_stale(name)
                    silent = False
                timer = None
                if self.stale_after_s > 0 and self.index.is_fresh(name):
                    timer = loop.call_later(self.stale_after_s, timed_out)
                try:
                    await wake.wait()
                finally:
                    if timer is not None:
                        timer.cancel()
        finally:
            watcher.cancel()
            if self._readers.get(name) == (loop, fd):  # still ours (not already removed by _unsubscribe)
                del self._readers[name]
                loop.remove_reader(fd)

    # ---- drained mode (drain_interval_s > 0) ------------------------------------------------------------
    def drain(self) -> None:
        """Apply every message that has reached the backends' SUB sockets, now, without awaiting: a batch
        in sequence is applied here; one that needs the sequence logic's replays (history before a first
        batch, a gap, a restart, a reconnect) is handed to the backend's task, which also reads what follows
        it. The router calls this before every pick (`Router.refresh`), the timer at least every
        `drain_interval_s`. Never raises.

        The sockets' descriptors are asked first, in one poll: ZeroMQ signals a socket's descriptor when its
        events may have changed, and reading the socket until ZMQ_EVENTS shows no message (as here and in
        the task) clears it, so a socket whose descriptor is quiet has no message waiting."""
        if self._ready is None:
            return
        ready = self._ready.poll(0)
        if not ready:
            return
        now = self._clock()
        by_fd = self._by_fd
        for fd, _ in ready:
            feed = by_fd.get(fd)
            if feed is None or feed.busy or feed.held:
                continue
            raw = feed.raw
            assert raw is not None
            try:
                while cast(int, raw.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    frames = raw.recv_multipart(zmq.NOBLOCK)
                    feed.heard_at = now
                    if not self._apply_in_sequence(feed, frames):
                        feed.held.append(frames)
                        assert feed.wake is not None
                        feed.wake.set()
                        break
            except zmq.ZMQError as exc:  # not expected: the socket is open while feed.raw is set
                _log.warning("KV events from %s: read failed: %s", feed.name, exc)

    def _apply_in_sequence(self, feed: _Feed, frames: list[bytes]) -> bool:
        """`on_message` for a message that needs no await: True when it was dealt with (applied: the batch
        expected next, or a first batch with no history to replay; or counted as undecodable), False when it
        must go through `handle`."""
        name = feed.name
        batch = self._decoded(name, frames)
        if batch is None:
            return True
        if not self._in_sequence(feed, batch):
            return False
        try:
            self._accept(feed, batch, _digest(frames[2]))
        except Exception:  # as in on_message: a bug here must not end the subscription
            _log.exception("KV events from %s: batch %d could not be handled", name, batch.seq)
            self.index.mark_stale(name)
        return True

    def _tick(self) -> None:
        """The drain timer: apply what arrived, and mark stale a fresh backend silent for stale_after_s."""
        self._drain_timer = None
        try:
            self.drain()
            if self.stale_after_s > 0:
                now = self._clock()
                for feed in self._feeds.values():
                    if (feed.raw is not None and not feed.busy and now - feed.heard_at >= self.stale_after_s
                            and self.index.is_fresh(feed.name)):
                        _log.info("KV events from %s silent for %.1f s: stale, routing falls back to the "
                                  "learned index", feed.name, self.stale_after_s)
                        self.index.mark_stale(feed.name)
        finally:
            if self._started:
                self._drain_timer = asyncio.get_running_loop().call_later(self.drain_interval_s, self._tick)

    async def _run_drained(self, feed: _Feed, sub: zmq.asyncio.Socket) -> None:
        """A backend's task in drained mode: it sleeps until `drain` hands it a message that needs the
        sequence logic, handles it (replays included), then reads and handles what follows until the socket
        is empty, and gives the feed back to `drain`."""
        name = feed.name
        watcher = self._watching(feed, sub)
        wake, raw = feed.wake, feed.raw
        assert wake is not None and raw is not None
        try:
            while True:
                await wake.wait()
                wake.clear()
                feed.busy = True
                try:
                    got = 0
                    while feed.held or cast(int, raw.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                        if feed.held:
                            frames = feed.held.popleft()
                        else:
                            frames = raw.recv_multipart(zmq.NOBLOCK)
                            feed.heard_at = self._clock()
                        await self.on_message(name, frames)
                        got += 1
                        if got % 64 == 0:
                            await asyncio.sleep(0)  # a long backlog does not hold the loop
                finally:
                    feed.busy = False
        finally:
            watcher.cancel()

    def _watching(self, feed: _Feed, sub: zmq.asyncio.Socket) -> asyncio.Task[None]:
        """The task watching `sub`'s monitor (`_watch`); the monitor socket closes with the subscription."""
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sockets.setdefault(feed.name, []).append(monitor)
        return asyncio.get_running_loop().create_task(self._watch(feed, monitor), name=f"kv-events-monitor-{feed.name}")

    async def _watch(self, feed: _Feed, monitor: zmq.asyncio.Socket) -> None:
        """The SUB socket's monitor: a disconnected publisher makes the backend stale."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                # The engine went away (killed, restarting, network): unknown until it speaks again and
                # its stream is shown to continue ours.
                _log.info("KV events from %s: publisher disconnected: stale", feed.name)
                feed.reconnected = True
                self.index.mark_stale(feed.name)

    async def on_message(self, name: str, frames: list[bytes]) -> None:
        """One PUB message of backend `name` (`[topic, seq, payload]`): decoded, then `handle`d. A message
        that does not decode is counted and skipped (the next one shows the gap); nothing raises."""
        feed = self._feeds.get(name)
        if feed is None:  # unsubscribed while this message was on its way
            return
        batch = self._decoded(name, frames)
        if batch is None:
            return
        try:
            await self.handle(feed, batch, _digest(frames[2]))
        except Exception:  # a bug here must not end the subscription
            _log.exception("KV events from %s: batch %d could not be handled", name, batch.seq)
            self.index.mark_stale(name)

    async def handle(self, feed: _Feed, batch: EventBatch, digest: int | None = None) -> None:
        """Sequence logic for one live batch (replays as needed), then apply it and mark the backend fresh.

        `digest` (xxh3 of the payload) lets a later replay prove that the publisher's stream still contains
        the last batch applied here: after a disconnect or a gap, a restarted engine can be numbering new
        batches past where the old one stopped, which sequence numbers alone cannot tell apart.
        """
        if self._in_sequence(feed, batch):
            self._accept(feed, batch, digest)
            return
        name, seq, expected = feed.name, batch.seq, feed.expected
        check = feed.reconnected or (expected is not None and seq > expected)
        feed.reconnected = False
        if expected is not None and seq < expected:
            self._restarted(feed, f"sequence went back to {seq} (expected {expected})")
            expected = None
        elif expected is not None and check:
            if seq > expected:
                _log.warning("KV events from %s: gap %d..%d", name, expected, seq - 1)
                self._count(self.metrics.gaps if self.metrics else None, name)
            self.index.mark_stale(name)
            if not feed.config.replay_endpoint:
                self.index.clear(name)  # removals may be lost (or a new engine): start from scratch
            else:
                verify = (expected - 1, feed.last_digest) if feed.last_digest is not None else None
                start = expected - 1 if verify is not None else expected
                outcome = await self._replay(feed, start, seq, initial=False, verify=verify)
                if outcome == "restarted":
                    self._restarted(feed, f"its batch {expected - 1} is not the one applied here")
                    expected = None
        if expected is None and seq > 0 and feed.config.replay_endpoint:
            await self._replay(feed, 0, seq, initial=True)
        self._accept(feed, batch, digest)

    @staticmethod
    def _in_sequence(feed: _Feed, batch: EventBatch) -> bool:
        """Whether `batch` is applied as it is: the batch expected next, or a first batch with no history
        to replay, on a stream not interrupted since (else `handle` checks it, replaying as needed)."""
        expected = feed.expected
        if feed.reconnected:
            return False
        if expected is not None:
            return batch.seq == expected
        return batch.seq == 0 or not feed.config.replay_endpoint

    def _accept(self, feed: _Feed, batch: EventBatch, digest: int | None) -> None:
        """Apply a batch in sequence: the backend expects the next one and is fresh."""
        self._apply(feed, batch, digest)
        feed.expected = batch.seq + 1
        self.index.mark_fresh(feed.name)

    def _restarted(self, feed: _Feed, why: str) -> None:
        _log.warning("KV events from %s: the engine restarted (%s): index cleared", feed.name, why)
        self._count(self.metrics.restarts if self.metrics else None, feed.name)
        self.index.clear(feed.name)
        self.index.mark_stale(feed.name)
        feed.last_digest = None

    async def _replay(self, feed: _Feed, start: int, until: int, *, initial: bool,
                      verify: tuple[int, int] | None = None) -> str:
        """Apply the publisher's buffered batches start..until-1. With `verify` = (seq, digest) the batch
        `seq` (== start) must come back with that digest and is not applied again; a different one means a
        new publisher ("restarted": nothing applied). Outcomes: complete, incomplete, timeout, restarted; an
        incomplete or timed-out gap replay clears the index (what was lost may have removed blocks)."""
        name = feed.name
        endpoint = feed.config.replay_endpoint
        assert endpoint is not None
        got: dict[int, tuple[EventBatch, int]] = {}
        outcome = "timeout"
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IPV6, 1)
        try:
            dealer.connect(endpoint)
            await dealer.send_multipart(encode_replay_request(start))
            deadline = self._clock() + self.replay_timeout_s
            while True:
                left = deadline - self._clock()
                if left <= 0 or not await dealer.poll(int(left * 1000) + 1):
                    break
                frames = await dealer.recv_multipart()
                try:
                    batch = decode_replay(frames)
                except KVEventDecodeError as exc:
                    self._decode_error(name, exc)
                    continue
                if batch is None:
                    outcome = "complete"
                    break
                if start <= batch.seq < until:
                    got[batch.seq] = (batch, _digest(frames[-1]))
        finally:
            dealer.close(linger=0)
        first = start
        if verify is not None and outcome == "complete":
            mine = got.pop(verify[0], None)
            if mine is None:
                outcome = "incomplete"  # rolled out of its buffer: continuity cannot be shown
            elif mine[1] != verify[1]:
                outcome = "restarted"
            first = verify[0] + 1
        if outcome == "complete" and sorted(got) != list(range(first, until)):
            outcome = "incomplete"
        self._count(self.metrics.replays if self.metrics else None, name, outcome)
        _log.info("KV events from %s: replay %d..%d %s (%d batches)", name, start, until - 1, outcome, len(got))
        if outcome == "restarted":
            return outcome
        if outcome != "complete" and not initial:
            # Something between start and until is lost for good (removals included): start from scratch.
            self.index.clear(name)
        for seq in sorted(got):
            batch, digest = got[seq]
            self._apply(feed, batch, digest)
        return outcome

    def _apply(self, feed: _Feed, batch: EventBatch, digest: int | None) -> None:
        name = feed.name
        feed.last_digest = digest
        applied = 0
        for ev in batch.events:
            if isinstance(ev, (BlockStored, BlockRemoved)) and ev.medium not in _INDEXED_MEDIA:
                continue
            try:
                self.index.apply(name, ev)
            except ValueError as exc:
                self._decode_error(name, exc)
                continue
            applied += 1
            if isinstance(ev, AllBlocksCleared):
                _log.info("KV events from %s: all blocks cleared", name)
        if applied and self.on_progress is not None:
            self.on_progress(name)
        now = self._clock()
        feed.recent.append((now, applied))
        feed.last_ts = batch.ts
        feed.lag_s = max(0.0, self._wall() - batch.ts)
        if self.metrics is not None:
            self.metrics.batches.labels(name).inc()
            self.metrics.events.labels(name).inc(applied)

    def _decoded(self, name: str, frames: list[bytes]) -> EventBatch | None:
        """The message's batch, or None when it does not decode (counted and logged)."""
        try:
            return decode_message(frames)
        except KVEventDecodeError as exc:
            self._decode_error(name, exc)
            return None

    def _decode_error(self, name: str, exc: Exception) -> None:
        _log.warning("KV events from %s: %s", name, exc)
        self._count(self.metrics.decode_errors if self.metrics else None, name)

    @staticmethod
    def _count(counter: Counter | None, *labels: str) -> None:
        if counter is not None:
            counter.labels(*labels).inc()

    def feeds(self) -> Iterable[str]:
        return self._feeds.keys()


class _IndexCollector:
    """Gauges read from the index at scrape time (blocks, freshness, lag, events/s per backend)."""

    def __init__(self, sub: KVEventSubscriber) -> None:
        self._sub = sub

    def collect(self) -> Iterable[Metric]:
        sub = self._sub
        blocks = GaugeMetricFamily("affinity_proxy_kv_index_blocks",
                                   "Blocks the backend's engine holds according to its KV events.", labels=["backend"])
        fresh = GaugeMetricFamily("affinity_proxy_kv_index_fresh",
                                  "1 if the backend's KV-event view is trusted for routing, 0 if stale (learned index "
                                  "used).", labels=["backend"])
        lag = GaugeMetricFamily("affinity_proxy_kv_events_lag_seconds",
                                "Receipt time minus the last batch's engine timestamp (includes clock skew).",
                                labels=["backend"])
        rate = GaugeMetricFamily("affinity_proxy_kv_events_per_second",
                                 "KV-cache events applied per second over the last 10 s.", labels=["backend"])
        for name in sub.feeds():
            blocks.add_metric([name], sub.index.num_blocks(name))
            fresh.add_metric([name], 1.0 if sub.index.is_fresh(name) else 0.0)
            feed = sub._feeds[name]
            if feed.lag_s is not None:
                lag.add_metric([name], feed.lag_s)
            rate.add_metric([name], sub.events_per_s(name))
        return [blocks, fresh, lag, rate]

    def describe(self) -> Iterable[Metric]:
        return []


class _WaitCollector:
    """`PreciseMatcher.prepare`'s waits (a long, uncached prompt waiting for its tokenisation before its
    pick) and the waits that ran into `telemetry.kv_events.precise_wait_ms`."""

    def __init__(self, matcher: Any) -> None:  # proxy.dataplane.tokenize.PreciseMatcher
        self._m = matcher

    def collect(self) -> Iterable[Metric]:
        from proxy.dataplane.tokenize import WAIT_BUCKETS

        m = self._m
        hist = HistogramMetricFamily("affinity_proxy_precise_wait_seconds",
                                     "Time a request waited for its prompt's tokenisation (off the event loop) "
                                     "before its pick, for the precise KV index.")
        hist.add_metric([], cumulative_buckets(WAIT_BUCKETS, m.wait_counts), m.wait_sum_s)
        timeouts = CounterMetricFamily("affinity_proxy_precise_wait_timeouts",
                                       "Waits for a prompt's tokenisation that reached "
                                       "telemetry.kv_events.precise_wait_ms (routed by the learned index).")
        timeouts.add_metric([], m.wait_timeouts)
        skipped = CounterMetricFamily("affinity_proxy_precise_wait_skipped",
                                      "Long prompts that did not wait for their tokenisation because "
                                      "telemetry.kv_events.precise_wait_concurrency were running "
                                      "(routed by the learned index).")
        skipped.add_metric([], m.wait_skipped)
        chunks = CounterMetricFamily("affinity_proxy_tokenizer_chunks",
                                     "Chunks of prompt text (~2 KB) the precise lookup read the token ids of: "
                                     "tokenized (here), host_cache (copied from the host's shared block: another "
                                     "--workers worker tokenised them), own_cache (read from this process's cache, "
                                     "copies included).", labels=["source"])
        toks = list(m.tokenizers.values())
        chunks.add_metric(["own_cache"], sum(t.hits for t in toks))
        chunks.add_metric(["host_cache"], sum(t.shared_hits for t in toks))
        chunks.add_metric(["tokenized"], sum(t.misses for t in toks))
        return [hist, timeouts, skipped, chunks]

    def describe(self) -> Iterable[Metric]:
        return []


@dataclass
class PreciseRouting:
    """What `telemetry.kv_events` wires into one data-plane process: the index, the policy's lookup, and
    (built once the process has its metrics registry) the subscriber that keeps the index in step."""

    index: KVIndex
    matcher: PreciseLookup  # proxy.dataplane.tokenize.PreciseMatcher: AffinityPolicy(cfg, precise=matcher)
    endpoints: Mapping[str, KVEventsEndpoint]
    models: Mapping[str, str]
    stale_after_s: float
    replay_timeout_s: float
    drain_interval_s: float = 0.0  # telemetry.kv_events.drain_interval_ms (KVEventSubscriber)
    # The router's `prepare` hook (`PreciseMatcher.prepare`): a long prompt waits for its tokenisation.
    prepare: Callable[[Any], Awaitable[None] | None] | None = None
    config: Config | None = None  # what it was built from (discovered backends are resolved against it)
    # `PreciseMatcher.load_tokenizers`: a reload's telemetry.kv_events.tokenizers reach the matcher.
    load_tokenizers: Callable[[Mapping[str, str]], object] | None = None

    def subscriber(self, registry: CollectorRegistry | None, store: SnapshotStore | None = None) -> KVEventSubscriber:
        """`store`: the process's snapshot store, whose fleet the subscriptions follow (discovery)."""
        if registry is not None and self.prepare is not None:
            registry.register(_WaitCollector(self.matcher))
        return KVEventSubscriber(self.index, self.endpoints, models=self.models, registry=registry,
                                 stale_after_s=self.stale_after_s, replay_timeout_s=self.replay_timeout_s,
                                 config=self.config, store=store,
                                 load_tokenizers=self.load_tokenizers, drain_interval_s=self.drain_interval_s)


def _zmq_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _at_host(ep: KVEventsEndpoint, host: str | None) -> KVEventsEndpoint:
    """`ep` with ``{host}`` replaced by `host` (a URL host; IPv6 in brackets, as ZeroMQ writes it)."""
    if host is None or "{host}" not in ep.endpoint + (ep.replay_endpoint or ""):
        return ep
    h = _zmq_host(host)
    return dataclasses.replace(ep, endpoint=ep.endpoint.replace("{host}", h),
                               replay_endpoint=None if ep.replay_endpoint is None
                               else ep.replay_endpoint.replace("{host}", h))


def kv_event_backends(config: Config, fleet: Iterable[BackendSpec] = ()
                      ) -> tuple[dict[str, KVEventsEndpoint], dict[str, str]]:
    """The KV-event publisher of every backend that has one, and the base model seeding each one's block
    keys (its `model:`, else the backend's first model). Raises ValueError for a listed backend with no model.

    A `telemetry.kv_events.backends` entry is for the backend of that name, ``{host}`` standing for its URL
    host; the entry of a service that `discovery` resolves (a DNS name) is for every backend of `fleet` (the
    snapshot's) discovered from it, ``<service>@<address>``, each at its own address."""
    ke = config.telemetry.kv_events
    by_name = {b.name: b for b in config.backends}
    services = {b.name for b in config.backends if config.discovery.enabled and is_dns_name(url_host_port(b.url)[0])}
    endpoints: dict[str, KVEventsEndpoint] = {}
    models: dict[str, str] = {}
    service_models: dict[str, str] = {}
    for name, ep in ke.backends.items():
        b = by_name.get(name)
        model = ep.model or (b.models[0] if b is not None and b.models else None)
        if not model:
            raise ValueError(f"telemetry.kv_events.backends.{name}: set `model:` or the backend's `models:` "
                             "(the model name seeds its block keys)")
        if name in services:
            service_models[name] = model  # a template: its addresses are subscribed below, not the service
            continue
        endpoints[name] = _at_host(ep, url_host_port(b.url)[0] if b is not None else None)
        models[name] = model
    for spec in fleet:
        service = service_of(spec.name)
        if service is None or service not in service_models or spec.name in ke.backends:
            continue
        endpoints[spec.name] = _at_host(ke.backends[service], url_host_port(spec.url)[0])
        models[spec.name] = service_models[service]
    return endpoints, models


def build_precise_routing(config: Config, shared_chunks: SharedChunks | None = None) -> PreciseRouting | None:
    """From a `proxy.config.Config`: None unless `telemetry.kv_events.backends` lists a backend. Loads the
    tokenizers (raises `TokenizerError` for a bad folder) and checks every listed backend has a model.
    `shared_chunks`: a `--workers` worker's view of the host's tokenised chunks (its tokenizers read the
    other workers' and add their own)."""
    from proxy.dataplane.tokenize import ModelTokenizer, PreciseMatcher

    ke = config.telemetry.kv_events
    if not ke.enabled:
        return None
    endpoints, models = kv_event_backends(config)
    if not ke.tokenizers:
        raise ValueError("telemetry.kv_events.tokenizers: name at least one model's tokenizer folder")
    tokenizers = {m: ModelTokenizer.from_dir(path, shared=shared_chunks) for m, path in ke.tokenizers.items()}
    index = KVIndex(eviction_ages=config.routing.affinity.eviction_band_tokens > 0)  # (proxy/core/placement.py)
    matcher = PreciseMatcher(index, tokenizers, wait_s=ke.precise_wait_ms / 1000.0, paths=ke.tokenizers,
                             max_warming=ke.precise_wait_concurrency, shared_chunks=shared_chunks)
    return PreciseRouting(index, matcher, endpoints, models, ke.stale_after_s, ke.replay_timeout_ms / 1000.0,
                          drain_interval_s=ke.drain_interval_ms / 1000.0,
                          prepare=matcher.prepare if ke.precise_wait_ms > 0 else None, config=config,
                          load_tokenizers=matcher.load_tokenizers)
