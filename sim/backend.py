"""`SimBackend`: one simulated GPU server's engine, run in real time, behind an async token stream.

The front ends (HTTP in server.py, gRPC in grpc.py) only ever call `generate()`; everything a real GPU
server does to a request (queueing, batching, prefix reuse, faults) happens behind it, so the HTTP and the
gRPC port of one server share one GPU, one cache and one queue, as they would on a real host.

Time: the engine runs on "engine seconds". `speed` maps the wall clock onto them (speed 50 makes a
simulated second last 20 ms), which is how tests run realistic profiles without waiting. One driver task
per backend steps the engine back to back while there is work: each step starts where the previous one
ended (or at the arrival that woke an idle engine), the task sleeps until the step's end on the wall clock
and then hands each request its tokens. Requests that arrive meanwhile join the next step.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from typing import AsyncIterator

from .api import ConnectionDropped, InjectedFailure, ServerStopping, SimError, SimRequest, TokenChunk
from .engine import Engine, RequestOutput
from .faults import Faults
from .kv_events import KVEventPublisher, KVEventsConfig
from .profiles import Profile
from .tokens import VOCAB

_RATE_WINDOW_S = 1.0
_log = logging.getLogger(__name__)


class _Stream:
    """Outputs of one request waiting for its consumer (a deque and one waiter, cheaper than a Queue)."""

    __slots__ = ("items", "waiter", "error")

    def __init__(self) -> None:
        self.items: deque[RequestOutput] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.error: SimError | None = None

    def push(self, out: RequestOutput) -> None:
        self.items.append(out)
        self._wake()

    def fail(self, error: SimError) -> None:
        self.error = error
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class SimBackend:
    def __init__(
        self,
        profile: Profile,
        *,
        name: str = "sim-0",
        seed: int = 0,
        adapters: tuple[str, ...] | list[str] = (),
        model_name: str | None = None,
        speed: float = 1.0,
        faults: Faults | None = None,
        kv_events: KVEventsConfig | None = None,
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.profile = profile
        self.name = name
        self.speed = speed
        self.faults = faults if faults is not None else Faults()
        self.engine = Engine(profile, seed=seed, adapters=adapters, model_name=model_name,
                             kv_events=kv_events is not None)
        # vLLM's --kv-events-config: one batch per engine step that cached or evicted blocks.
        self.kv_publisher: KVEventPublisher | None = (
            KVEventPublisher(kv_events, block_size=profile.block_size)
            if kv_events is not None else None
        )
        self._rng = random.Random(seed * 7919 + 1)
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self._stall_until = 0.0  # loop time
        self._stall_changed: asyncio.Future[None] | None = None
        self._recent: deque[tuple[float, int]] = deque()  # (engine end time, tokens computed) per step
        self._bg_ids: set[str] = set()
        self._bg_seq = 0
        self._req_seq = 0
        self.requests_failed = 0
        self.requests_dropped = 0
        # How far the driver fell behind the engine model: per step, the wall seconds its outputs went out
        # after the moment the model gives them (the machine's CPU, not the model; 0 when it keeps up).
        self.steps = 0
        self.late_seconds = 0.0
        self.late_max_seconds = 0.0
        self.stopped = False

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        loop = asyncio.get_running_loop()
        self._t0 = loop.time()
        if self.kv_publisher is not None:
            self.kv_publisher.start()
        self._task = loop.create_task(self._drive(), name=f"sim-driver-{self.name}")
        if self.faults.stall_ms:
            self.stall(self.faults.stall_ms)
        self.sync_background()

    async def stop(self) -> None:
        self.stopped = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for rid, stream in list(self._streams.items()):
            stream.fail(ServerStopping("the server is shutting down"))
            self.engine.abort(rid, self.now())
        self._streams.clear()
        if self.kv_publisher is not None:
            await self.kv_publisher.stop()

    # ---- clock ---------------------------------------------------------------------------------------
    def now(self) -> float:
        """Engine seconds since start."""
        return (asyncio.get_running_loop().time() - self._t0) * self.speed

    def _wall(self, engine_t: float) -> float:
        return self._t0 + engine_t / self.speed

    # ---- faults that act here ------------------------------------------------------------------------
    def stall(self, ms: float) -> None:
        """Freeze the engine and every endpoint for `ms` wall milliseconds from now (a GC pause); 0 ends
        a stall in progress."""
        loop = asyncio.get_running_loop()
        self._stall_until = loop.time() + ms / 1000.0  # 0 ends a stall early
        self.faults.stall_ms = 0.0
        changed, self._stall_changed = self._stall_changed, None
        if changed is not None and not changed.done():
            changed.set_result(None)  # waiters re-read the deadline
        self._wake.set()

    async def wait_stall(self) -> None:
        """Front ends await this before answering anything: a stalled server answers nothing."""
        loop = asyncio.get_running_loop()
        while (left := self._stall_until - loop.time()) > 0:
            if self._stall_changed is None:
                self._stall_changed = loop.create_future()
            await asyncio.wait((self._stall_changed,), timeout=left)

    def sync_background(self) -> None:
        """Top up (or trim) the internal requests that make up `faults.background_requests`."""
        want = self.faults.background_requests
        while len(self._bg_ids) > want:
            rid = self._bg_ids.pop()
            self.engine.abort(rid, self.now())
        while len(self._bg_ids) < want:
            self._bg_seq += 1
            rid = f"bg-{self._bg_seq}"
            words = [VOCAB[(self._bg_seq * 31 + i * 7) % len(VOCAB)] for i in range(self.faults.background_prompt_tokens)]
            words[0] = rid  # a distinct first token: background load never shares a prefix
            req = SimRequest(rid, " ".join(words), max_tokens=self.faults.background_max_tokens, ignore_eos=True)
            self.engine.add_request(req, self.now())
            self._bg_ids.add(rid)
        self._wake.set()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block now (AllBlocksCleared goes out at once); False while blocks are in use."""
        done = self.engine.reset_prefix_cache()
        if done and self.kv_publisher is not None:
            self.kv_publisher.publish(self.engine.take_kv_events())
        return done

    # ---- the API front ends use ----------------------------------------------------------------------
    async def generate(self, req: SimRequest, *, default_max_tokens: int | None = None) -> AsyncIterator[TokenChunk]:
        """Stream one request's tokens: one `TokenChunk` per engine step, usage on the last one.

        Raises (before the first chunk) `InvalidRequest`, `ModelNotFound`, `InjectedFailure`, and during the
        stream `ConnectionDropped` (a fault: cut the connection) or `ServerStopping`. Stopping iteration
        or cancelling the consumer aborts the request in the engine and frees its KV blocks.
        `default_max_tokens` applies when `req.max_tokens` is None (OpenAI completions default to 16);
        without it the request may run to the end of the context.
        """
        if self.stopped:
            raise ServerStopping("the server is shutting down")
        await self.wait_stall()
        faults = self.faults
        if faults.fail_rate > 0 and self._rng.random() < faults.fail_rate:
            self.requests_failed += 1
            raise InjectedFailure(f"injected failure ({faults.fail_status})", faults.fail_status)
        rid = req.request_id
        if not rid or rid in self._streams or self.engine.is_active(rid):
            self._req_seq += 1
            rid = f"{req.request_id or 'req'}#{self._req_seq}"
            req = SimRequest(rid, req.prompt, req.max_tokens, req.temperature, req.model, req.ignore_eos)
        self.engine.add_request(req, self.now(), default_max_tokens)
        stream = _Stream()
        self._streams[rid] = stream
        self._wake.set()
        finished = False
        index = 0
        drop_after = faults.drop_after_chunks
        try:
            while True:
                if not stream.items:
                    if stream.error is not None:
                        raise stream.error
                    stream.waiter = asyncio.get_running_loop().create_future()
                    await stream.waiter
                    stream.waiter = None
                    continue
                out = stream.items.popleft()
                if drop_after is not None and index >= drop_after:
                    self.requests_dropped += 1
                    raise ConnectionDropped(f"injected connection drop after {drop_after} chunks")
                finished = out.finished
                yield TokenChunk(out.text, index, out.finish_reason, out.usage, out.num_tokens)
                index += 1
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished and not self.stopped:
                self.engine.abort(rid, self.now())
                self._wake.set()

    # ---- gauges for /metrics and load headers --------------------------------------------------------
    def tokens_per_second(self) -> float:
        """KV tokens written per engine second over the last second (the GPU agent's kvcache rate)."""
        now = self.now()
        recent = self._recent
        while recent and recent[0][0] < now - _RATE_WINDOW_S:
            recent.popleft()
        return sum(n for t, n in recent if t <= now) / _RATE_WINDOW_S

    def busy_seconds(self) -> float:
        return max(0.0, self.engine.busy_time(self.now()))

    def memory_used_bytes(self) -> int:
        p = self.profile
        return int(p.model.weight_bytes + p.reserved_bytes * p.tp + self.engine.pool.num_used * p.block_bytes)

    # ---- the driver ----------------------------------------------------------------------------------
    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        while True:
            t = engine.next_step_time()
            if t is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            if loop.time() < self._stall_until:
                await self.wait_stall()
                t = max(t, self.now())
            try:
                result = engine.step(t)
            except Exception as exc:  # a bug in the model must not leave every client hanging
                _log.exception("simulated engine %s failed a step; failing its requests", self.name)
                for rid, stream in list(self._streams.items()):
                    stream.fail(SimError(f"simulated engine failure: {exc!r}"))
                    engine.abort(rid, self.now())
                for rid in list(self._bg_ids):
                    engine.abort(rid, self.now())
                self._bg_ids.clear()
                continue
            events = engine.take_kv_events() if self.kv_publisher is not None else []
            if events and self.kv_publisher is not None and self.kv_publisher.config.publish_at == "start":
                self.kv_publisher.publish(events)  # earlier vLLM releases: from `schedule`, before the model ran
                events = []
            recent = self._recent
            recent.append((result.end, result.num_prefill_tokens + result.num_decode_tokens))
            while recent[0][0] < result.end - _RATE_WINDOW_S:
                recent.popleft()
            # The engine already holds the step's end state, so top up background load now, not after
            # the sleep: otherwise gauges read in between show the finished background requests gone
            # and none replacing them, i.e. artificial load that flickers to zero once per step.
            bg_done = False
            for out in result.outputs:
                if out.finished and out.request_id in self._bg_ids:
                    self._bg_ids.discard(out.request_id)
                    bg_done = True
            if bg_done:
                self.sync_background()
            delay = self._wall(result.end) - loop.time()
            self.steps += 1
            if delay < 0:
                self.late_seconds -= delay
                if -delay > self.late_max_seconds:
                    self.late_max_seconds = -delay
            await asyncio.sleep(delay if delay > 0 else 0)
            if loop.time() < self._stall_until:
                await self.wait_stall()
            if events and self.kv_publisher is not None:
                self.kv_publisher.publish(events)  # vLLM main: from `update_from_output`, before the outputs
            streams = self._streams
            for out in result.outputs:
                stream = streams.get(out.request_id)
                if stream is not None:
                    stream.push(out)
