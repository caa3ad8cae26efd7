"""Shared fakes: a settable clock, an in-memory access-log sink, and synthetic records."""

from __future__ import annotations

import json
import random

from proxy.core.hotspots import HotspotConfig
from proxy.observability.access_log import LineSink
from proxy.observability.config import AccessLogConfig, LoggingConfig
from proxy.observability.observer import Observer
from proxy.observability.record import GRPC, H2, HTTP1, RequestRecord


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Lines:
    """A LineSink target collecting what was written."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def __call__(self, data: bytes) -> None:
        self.chunks.append(bytes(data))

    @property
    def lines(self) -> list[str]:
        return b"".join(self.chunks).decode().splitlines()

    def json(self) -> list[dict]:
        return [json.loads(line) for line in self.lines]


def make_observer(clock: Clock, access: AccessLogConfig = AccessLogConfig(flush_interval_s=0.0), fmt: str = "json",
                  hotspots: HotspotConfig = HotspotConfig(), registry=None, role: str = "single"):
    out = Lines()
    sink = LineSink(out, access.flush_interval_s)
    obs = Observer(LoggingConfig(format=fmt, access_log=access), hotspots, registry, clock, sink=sink, role=role)
    return obs, out


def record(i: int, backend: str | None = "gpu-0", protocol: str = HTTP1, ttft: float = 0.1, status: int = 200,
           **kw) -> RequestRecord:
    paths = {HTTP1: "/v1/chat/completions", H2: "/v1/chat/completions", GRPC: "/affinity.v1.Generation/Generate"}
    fields = dict(request_id=f"req-{i}", trace_id=f"{i:032x}", client="127.0.0.1:50000", protocol=protocol,
                  method="POST", path=paths[protocol], model="llama", adapter=None, session=f"s{i % 3}",
                  policy="affinity", reason="prefix_hit" if backend else None, backend=backend, attempts=1,
                  status=status, grpc_status=0 if protocol == GRPC else None, ttft_s=ttft,
                  duration_s=ttft + 0.4, prompt_tokens=120, cached_tokens=64, bytes_in=900, bytes_out=4000,
                  load_score=0.3, inflight=2)
    fields.update(kw)
    return RequestRecord(**fields)


def feed_fleet(obs: Observer, clock: Clock, windows: int, backends: tuple[str, ...], per_window: int = 20,
               stalled: str | None = None, stall_from: int = 0, stall_to: int = 0, stall_factor: float = 10.0,
               error_backend: str | None = None, error_rate: float = 0.0, seed: int = 0) -> None:
    """`windows` 10 s windows of traffic; `stalled` is slow in windows [stall_from, stall_to)."""
    rng = random.Random(seed)
    ws = obs.hotspot_config.window_s
    start = (clock.now // ws) * ws  # each batch starts on a window boundary, so windows never straddle
    i = 0
    for k in range(windows):
        for j in range(per_window * len(backends)):
            b = backends[j % len(backends)]
            clock.now = start + k * ws + (j + 1) * 9.0 / (per_window * len(backends))
            ttft = 0.12 * rng.lognormvariate(0, 0.3)
            slow = b == stalled and stall_from <= k < stall_to
            if slow:
                ttft *= stall_factor
            failed = b == error_backend and slow and rng.random() < error_rate
            obs.on_finish(record(i, backend=b, ttft=ttft, status=503 if failed else 200,
                                 reason=rng.choice(["prefix_hit", "exact_hit", "hash", "overload_fallback"]),
                                 load_score=0.9 if slow else 0.3 + 0.1 * rng.random(),
                                 inflight=12 if slow else rng.randint(0, 4)))
            i += 1
    clock.now = start + windows * ws + 0.5
