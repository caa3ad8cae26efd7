"""Per-backend latency/error windows and the two trouble rules, as plain data in and events out.

No clock and no I/O: the caller says which window a sample belongs to (``int(now // window_s)``) and when a
window is closed; this module only aggregates and decides, so tests feed windows directly and the offline
replay can run it in virtual time.

Windows
    One `BackendWindow` per backend per 10 s window: request and error counts, a fixed-bucket histogram of
    TTFT and of end-to-end duration (41 integers each, never a list of samples), and sums for the mean load
    score and in-flight count. A third histogram, `waiting`, holds the age at the window's end of every
    request routed there that had not had its first byte yet: a stalled backend finishes nothing, so
    without these censored samples its windows would be empty (no evidence) for exactly as long as it stalls.
    TTFT p99 is taken over finished TTFTs and waiting ages together; each age is a lower bound of that
    request's TTFT, so this never overstates a backend's latency. Everything in it adds up, so windows from several worker processes are merged
    with `merge` (or `WindowRing.merge_data` on their `to_data()` form) and judged once.

Rules (`HotspotDetector`)
    *Latency hot spot*: the backend's window p99 (TTFT by default) is more than ``latency_rise`` (2.0 = 200%)
    above its baseline for ``windows`` (3) consecutive judged windows. *Spreading an anomaly*: while it is a
    hot spot, its error rate pooled over those windows is more than ``error_rise`` (0.05 = 5 points) above
    its baseline error rate.

    The baseline is the backend's OWN history: the median of its p99 over the last ``baseline_windows``
    (30 = 5 min) normal windows, and its pooled error rate over the same windows. Windows that were over the
    threshold or that fell while it was a hot spot never enter the baseline, so a long stall does not
    become the new normal. Own history rather than the fleet median, because fleets are heterogeneous (an
    A10 next to an H100, a 70B model next to an 8B one): against the fleet median the slow-but-healthy
    backends would be hot spots forever and a fast one could triple before anyone noticed. The median (not
    the mean) keeps one earlier spike from raising the bar. A window with fewer than ``min_requests``
    finished requests is no evidence either way (it neither extends nor breaks a streak): a p99 of three
    samples is noise (waiting requests count as evidence for TTFT). ``min_p99_s`` is a floor under the threshold: 5 ms -> 20 ms is not trouble.

    A hot spot clears after ``clear_windows`` consecutive judged windows back under the threshold
    (hysteresis: one good window inside a stall must not make it flap); spreading clears with it, or when
    the pooled error rate of the latest over-threshold windows falls back under its rule.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Iterable, Literal, Mapping

from proxy.core.bounds import check_config

# Histogram bucket upper bounds in seconds: 1 ms * sqrt(2)^i, up to ~741 s, plus an overflow bucket. The
# sqrt(2) step bounds the p99 estimate's error to 41% (interpolated inside the bucket, typically far less),
# well under the 200% the latency rule looks for.
BUCKET_BOUNDS_S: tuple[float, ...] = tuple(0.001 * 2 ** (i / 2) for i in range(40))
N_BUCKETS = len(BUCKET_BOUNDS_S) + 1

LATENCY_HOT_SPOT = "latency_hot_spot"
SPREADING_ANOMALY = "spreading_anomaly"
STATES = (LATENCY_HOT_SPOT, SPREADING_ANOMALY)


@dataclass(frozen=True)
class HotspotConfig:
    """The `hotspots:` section.

    ```yaml
    hotspots:
      window_s: 10            # width of one heat-map window
      history_windows: 90     # windows kept (90 x 10 s = the last 15 minutes)
      metric: ttft            # which p99 the latency rule watches: ttft | e2e
      latency_rise: 2.0       # hot spot: p99 > (1 + 2.0) x baseline, i.e. risen by more than 200%
      error_rise: 0.05        # spreading: error rate > baseline + 5 points while a hot spot
      windows: 3              # consecutive windows over the threshold to enter
      clear_windows: 2        # consecutive windows back under it to leave
      baseline_windows: 30    # the baseline is the median of this many earlier normal windows
      min_baseline_windows: 3 # judge nothing before the backend has this many
      min_requests: 5         # a window with fewer finished requests is no evidence
      min_p99_s: 0.05         # a p99 under this is never a hot spot
      lower_weight_to: null   # optional: a hot spot's routing weight is multiplied by this (0 < x < 1) until it
                              # clears, as POST /admin/backends/{name}/weight would; null: off
    ```
    """

    window_s: float = field(default=10.0, metadata={"gt": 0})
    history_windows: int = field(default=90, metadata={"ge": 1})
    metric: Literal["ttft", "e2e"] = "ttft"
    latency_rise: float = field(default=2.0, metadata={"gt": 0})
    error_rise: float = field(default=0.05, metadata={"gt": 0, "lt": 1})
    windows: int = field(default=3, metadata={"ge": 1})
    clear_windows: int = field(default=2, metadata={"ge": 1})
    baseline_windows: int = field(default=30, metadata={"ge": 1})
    min_baseline_windows: int = field(default=3, metadata={"ge": 1})
    min_requests: int = field(default=5, metadata={"ge": 1})
    min_p99_s: float = field(default=0.05, metadata={"ge": 0})
    # > 0: a backend taken out of rotation would finish no requests, so it could never be seen to clear.
    lower_weight_to: float | None = field(default=None, metadata={"gt": 0, "lt": 1})

    def __post_init__(self) -> None:
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        if self.min_baseline_windows > self.baseline_windows:
            yield "min_baseline_windows", (f"must be <= baseline_windows ({self.baseline_windows}), "
                                           f"got {self.min_baseline_windows}")


def bucket_of(seconds: float) -> int:
    return bisect_left(BUCKET_BOUNDS_S, seconds)


def quantile(counts: list[int], q: float) -> float | None:
    """The q-quantile of a bucket histogram, interpolated geometrically inside its bucket; None if empty."""
    n = sum(counts)
    if n == 0:
        return None
    rank = q * n
    seen = 0
    for i, c in enumerate(counts):
        if c and seen + c >= rank:
            if i >= len(BUCKET_BOUNDS_S):
                return BUCKET_BOUNDS_S[-1]  # overflow bucket: all we know is "at least the last bound"
            hi = BUCKET_BOUNDS_S[i]
            lo = BUCKET_BOUNDS_S[i - 1] if i else hi / 2 ** 0.5
            frac = (rank - seen) / c
            return float(lo * (hi / lo) ** frac)
        seen += c
    return BUCKET_BOUNDS_S[-1]


@dataclass(slots=True)
class BackendWindow:
    """One backend's requests finished in one window. Every field adds up across workers."""

    requests: int = 0
    errors: int = 0
    ttft: list[int] = field(default_factory=lambda: [0] * N_BUCKETS)
    e2e: list[int] = field(default_factory=lambda: [0] * N_BUCKETS)
    waiting: list[int] = field(default_factory=lambda: [0] * N_BUCKETS)  # ages of requests awaiting a first byte
    load_sum: float = 0.0
    load_n: int = 0
    inflight_sum: float = 0.0
    inflight_n: int = 0

    def add(self, e2e_s: float, ttft_s: float | None = None, error: bool = False,
            load_score: float | None = None, inflight: int | None = None) -> None:
        self.requests += 1
        if error:
            self.errors += 1
        self.e2e[bisect_left(BUCKET_BOUNDS_S, e2e_s)] += 1
        if ttft_s is not None:
            self.ttft[bisect_left(BUCKET_BOUNDS_S, ttft_s)] += 1
        if load_score is not None:
            self.load_sum += load_score
            self.load_n += 1
        if inflight is not None:
            self.inflight_sum += inflight
            self.inflight_n += 1

    def add_waiting(self, age_s: float) -> None:
        """A request still waiting for its first byte at the end of the window, `age_s` after it was sent."""
        self.waiting[bisect_left(BUCKET_BOUNDS_S, age_s)] += 1

    def merge(self, other: "BackendWindow") -> None:
        self.requests += other.requests
        self.errors += other.errors
        for i, c in enumerate(other.ttft):
            self.ttft[i] += c
        for i, c in enumerate(other.e2e):
            self.e2e[i] += c
        for i, c in enumerate(other.waiting):
            self.waiting[i] += c
        self.load_sum += other.load_sum
        self.load_n += other.load_n
        self.inflight_sum += other.inflight_sum
        self.inflight_n += other.inflight_n

    @property
    def waiting_n(self) -> int:
        return sum(self.waiting)

    def evidence(self, metric: str = "ttft") -> int:
        """Samples behind `p99(metric)`: finished requests, plus waiting ones for TTFT."""
        return self.requests + self.waiting_n if metric == "ttft" else self.requests

    def p99(self, metric: str = "ttft") -> float | None:
        """p99 of TTFT with the waiting ages (falling back to e2e for finished requests that reported no
        first byte), or of e2e."""
        if metric == "ttft":
            if sum(self.ttft) or self.waiting_n:
                first = self.ttft if sum(self.ttft) or not self.requests else self.e2e
                return quantile([a + b for a, b in zip(first, self.waiting)], 0.99)
        return quantile(self.e2e, 0.99)

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    @property
    def load_score(self) -> float | None:
        return self.load_sum / self.load_n if self.load_n else None

    @property
    def inflight(self) -> float | None:
        """Mean in-flight requests to it at pick time (per process: merged workers give their mean view)."""
        return self.inflight_sum / self.inflight_n if self.inflight_n else None

    def to_data(self) -> dict[str, Any]:
        return {"requests": self.requests, "errors": self.errors, "ttft": list(self.ttft), "e2e": list(self.e2e),
                "waiting": list(self.waiting), "load_sum": self.load_sum, "load_n": self.load_n,
                "inflight_sum": self.inflight_sum, "inflight_n": self.inflight_n}

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> "BackendWindow":
        ttft, e2e, waiting = list(data["ttft"]), list(data["e2e"]), list(data["waiting"])
        if not len(ttft) == len(e2e) == len(waiting) == N_BUCKETS:
            raise ValueError(f"histograms must have {N_BUCKETS} buckets, got {len(ttft)}, {len(e2e)} and {len(waiting)}")
        return cls(requests=int(data["requests"]), errors=int(data["errors"]), ttft=ttft, e2e=e2e, waiting=waiting,
                   load_sum=float(data["load_sum"]), load_n=int(data["load_n"]),
                   inflight_sum=float(data["inflight_sum"]), inflight_n=int(data["inflight_n"]))


@dataclass(slots=True)
class Window:
    """Everything finished in one window: per backend, plus the routing mix (reason -> count)."""

    index: int
    backends: dict[str, BackendWindow] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)
    unrouted: int = 0  # finished without a backend (rejected, invalid, nothing routable)

    def backend(self, name: str) -> BackendWindow:
        w = self.backends.get(name)
        if w is None:
            w = self.backends[name] = BackendWindow()
        return w

    def merge(self, other: "Window") -> None:
        for name, bw in other.backends.items():
            self.backend(name).merge(bw)
        for reason, n in other.reasons.items():
            self.reasons[reason] = self.reasons.get(reason, 0) + n
        self.unrouted += other.unrouted

    def to_data(self) -> dict[str, Any]:
        return {"index": self.index, "backends": {k: v.to_data() for k, v in self.backends.items()},
                "reasons": dict(self.reasons), "unrouted": self.unrouted}

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> "Window":
        return cls(index=int(data["index"]),
                   backends={str(k): BackendWindow.from_data(v) for k, v in data["backends"].items()},
                   reasons={str(k): int(v) for k, v in data["reasons"].items()}, unrouted=int(data["unrouted"]))


class WindowRing:
    """The last `keep` windows. `advance(index)` opens window `index` and returns the windows it closed."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._windows: dict[int, Window] = {}
        self.current: Window | None = None

    def advance(self, index: int) -> list[Window]:
        """Make `index` the open window; the windows that closed (gaps included, as empty windows, at most
        `keep` of them) come back oldest first. An index older than the open one changes nothing."""
        cur = self.current
        if cur is not None and index <= cur.index:
            return []
        closed: list[Window] = []
        if cur is not None:
            closed.append(cur)
            first_gap = max(cur.index + 1, index - self.keep)
            for i in range(first_gap, index):
                gap = self._windows[i] = Window(i)
                closed.append(gap)
        self.current = self._windows[index] = Window(index)
        floor = index - self.keep
        for i in [i for i in self._windows if i <= floor]:
            del self._windows[i]
        return closed

    def window(self, index: int) -> Window | None:
        return self._windows.get(index)

    def windows(self) -> list[Window]:
        """Kept windows, oldest first (the open one last)."""
        return [self._windows[i] for i in sorted(self._windows)]

    def to_data(self) -> list[dict[str, Any]]:
        return [w.to_data() for w in self.windows()]

    def merge_data(self, data: Iterable[Mapping[str, Any]]) -> None:
        """Add another process's windows (its `to_data()`) into these, index by index."""
        for item in data:
            other = Window.from_data(item)
            mine = self._windows.get(other.index)
            if mine is None:
                if self.current is not None and other.index <= self.current.index - self.keep:
                    continue  # older than anything kept
                mine = self._windows[other.index] = Window(other.index)
            mine.merge(other)


@dataclass(frozen=True, slots=True)
class HotspotEvent:
    """A backend entered (`entered`) or left one of the two states at the end of window `window`."""

    backend: str
    state: str  # LATENCY_HOT_SPOT | SPREADING_ANOMALY
    entered: bool
    window: int
    p99_s: float | None
    baseline_p99_s: float | None
    error_rate: float | None
    baseline_error_rate: float | None

    def to_data(self) -> dict[str, Any]:
        return {"backend": self.backend, "state": self.state, "entered": self.entered, "window": self.window,
                "p99_s": self.p99_s, "baseline_p99_s": self.baseline_p99_s, "error_rate": self.error_rate,
                "baseline_error_rate": self.baseline_error_rate}


@dataclass(slots=True)
class _Track:
    base_p99: deque[float]
    base_req: deque[int]
    base_err: deque[int]
    over: deque[tuple[int, int]]  # (requests, errors) of the latest consecutive over-threshold windows
    streak: int = 0
    clear: int = 0
    hot: bool = False
    spreading: bool = False
    hot_since: int | None = None
    spreading_since: int | None = None
    last_p99: float | None = None
    last_error_rate: float | None = None

    def baseline(self) -> tuple[float | None, float | None]:
        if not self.base_p99:
            return None, None
        req = sum(self.base_req)
        return median(self.base_p99), (sum(self.base_err) / req if req else 0.0)


class HotspotDetector:
    """Feed it each closed window once, in order (`observe`); it answers the transitions it caused."""

    def __init__(self, config: HotspotConfig) -> None:
        self.config = config
        self._tracks: dict[str, _Track] = {}

    def _track(self, name: str) -> _Track:
        t = self._tracks.get(name)
        if t is None:
            n = self.config.baseline_windows
            t = self._tracks[name] = _Track(deque(maxlen=n), deque(maxlen=n), deque(maxlen=n),
                                            deque(maxlen=self.config.windows))
        return t

    def observe(self, window: Window) -> list[HotspotEvent]:
        events: list[HotspotEvent] = []
        for name in sorted(window.backends):
            events.extend(self._judge(name, window.index, window.backends[name]))
        return events

    def _judge(self, name: str, index: int, w: BackendWindow) -> list[HotspotEvent]:
        cfg = self.config
        t = self._track(name)
        if w.evidence(cfg.metric) < cfg.min_requests:
            return []
        p99 = w.p99(cfg.metric)
        assert p99 is not None  # evidence > 0 means one of the histograms is not empty
        err = w.errors / w.requests if w.requests else 0.0
        t.last_p99, t.last_error_rate = p99, err
        base_p99, base_err = t.baseline()
        if base_p99 is None or len(t.base_p99) < cfg.min_baseline_windows:
            self._to_baseline(t, p99, w)
            return []
        assert base_err is not None
        events: list[HotspotEvent] = []

        def event(state: str, entered: bool) -> None:
            events.append(HotspotEvent(name, state, entered, index, p99, base_p99, err, base_err))

        if p99 > max(base_p99 * (1.0 + cfg.latency_rise), cfg.min_p99_s):
            t.streak += 1
            t.clear = 0
            t.over.append((w.requests, w.errors))
            if not t.hot and t.streak >= cfg.windows:
                t.hot, t.hot_since = True, index
                event(LATENCY_HOT_SPOT, True)
            req = sum(r for r, _ in t.over)
            # (a stall that has finished nothing yet says nothing about errors: the state stays as it was)
            if t.hot and req:
                spreading = sum(e for _, e in t.over) / req - base_err > cfg.error_rise
                if spreading != t.spreading:
                    t.spreading = spreading
                    t.spreading_since = index if spreading else None
                    event(SPREADING_ANOMALY, spreading)
            return events
        t.streak = 0
        t.over.clear()
        if t.hot:
            t.clear += 1
            if t.clear >= cfg.clear_windows:
                if t.spreading:
                    t.spreading, t.spreading_since = False, None
                    event(SPREADING_ANOMALY, False)
                t.hot, t.hot_since, t.clear = False, None, 0
                event(LATENCY_HOT_SPOT, False)
            return events
        self._to_baseline(t, p99, w)
        return events

    @staticmethod
    def _to_baseline(t: _Track, p99: float, w: BackendWindow) -> None:
        t.base_p99.append(p99)
        t.base_req.append(w.requests)
        t.base_err.append(w.errors)

    def mark(self, name: str) -> str | None:
        """What the heat map marks on the backend's latest window: spreading, hot, over (a streak building)."""
        t = self._tracks.get(name)
        if t is None:
            return None
        if t.spreading:
            return "spreading"
        if t.hot:
            return "hot"
        return "over" if t.streak else None

    def state(self, name: str) -> dict[str, bool]:
        t = self._tracks.get(name)
        return {LATENCY_HOT_SPOT: bool(t and t.hot), SPREADING_ANOMALY: bool(t and t.spreading)}

    def status(self) -> dict[str, dict[str, Any]]:
        """Per backend: both states, since which window, the streak, latest values and the baseline."""
        out: dict[str, dict[str, Any]] = {}
        for name in sorted(self._tracks):
            t = self._tracks[name]
            base_p99, base_err = t.baseline()
            out[name] = {
                LATENCY_HOT_SPOT: t.hot, SPREADING_ANOMALY: t.spreading,
                "hot_since_window": t.hot_since, "spreading_since_window": t.spreading_since,
                "streak": t.streak, "p99_s": t.last_p99, "error_rate": t.last_error_rate,
                "baseline_p99_s": base_p99, "baseline_error_rate": base_err,
                "baseline_windows": len(t.base_p99),
            }
        return out
