"""The fleet as the data plane sees it: one immutable, versioned value.

The control plane (poller, health checks, reload, discovery) never mutates a snapshot: it builds a new
one with `evolve`/`replace_backend` and swaps it in with a single reference assignment. A request reads
`current` once and routes on that value, so a decision is always made against a consistent fleet, and
the very next request sees new weights and load even on a long-lived HTTP/2 connection (the failure mode
of pickers that cache per connection).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from proxy.core.bounds import check_config, check_value

# The bound of a backend's weight, configured (BackendSpec, YAML) or set at run time (BackendState, admin
# API): finite and >= 0; 0 takes the backend out of rotation without draining it.
WEIGHT_BOUNDS: Mapping[str, Any] = {"ge": 0}


class Health(str, enum.Enum):
    """Routing eligibility. UNKNOWN backends are routable: a fresh proxy must serve before its first check."""

    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # failed active checks (with hysteresis) or ejected as an outlier
    DRAINING = "draining"  # removed by config/discovery/admin: finishes in-flight work, gets nothing new

    @property
    def routable(self) -> bool:
        return self in (Health.UNKNOWN, Health.HEALTHY)


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """What configuration (or discovery) says about a backend; never changed by telemetry."""

    name: str
    url: str  # base URL of the OpenAI-compatible HTTP server, e.g. http://10.0.0.5:8000
    weight: float = field(default=1.0, metadata=WEIGHT_BOUNDS)
    grpc_address: str | None = None  # host:port of its gRPC server, if any
    metrics_url: str | None = None  # defaults to url + /metrics
    models: tuple[str, ...] = ()  # models it serves; empty = any
    # LoRA adapters declared loaded there (YAML backends[].adapters); telemetry adds the discovered ones.
    adapters: tuple[str, ...] = ()
    max_inflight: int | None = field(default=None, metadata={"ge": 1})  # in-flight limit enforced by the data plane

    def __post_init__(self) -> None:
        # Every door that makes a backend (YAML, reload, discovery, code) goes through here.
        check_config(self)


def duplicate_urls(specs: Iterable[BackendSpec]) -> list[tuple[int, int]]:
    """(index, index of the earlier one) for every backend whose URL an earlier backend already has.

    Two entries for one server would double its share of traffic under two names and split its health
    and load accounting; the config rejects them, discovery drops them (the one rule, kept here)."""
    first: dict[str, int] = {}
    out: list[tuple[int, int]] = []
    for i, spec in enumerate(specs):
        j = first.setdefault(spec.url.rstrip("/"), i)
        if j != i:
            out.append((i, j))
    return out


@dataclass(frozen=True, slots=True)
class Signals:
    """Normalised telemetry of one backend at one instant. None means "not reported", never zero.

    Missing data read as zero load is how routers send everything to a backend whose metrics broke.
    """

    scraped_at: float  # time.monotonic() of the scrape that produced these values
    engine: str | None = None  # vllm | sglang | tgi | triton | agent | orca
    mem_used_bytes: float | None = None
    mem_total_bytes: float | None = None
    kernel_queue: float | None = None  # cuda_kernel_queue_length (agent) or running+waiting (engines)
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0..1
    kv_tokens_per_s: float | None = None
    kv_capacity_tokens: float | None = None
    loaded_adapters: frozenset[str] = frozenset()
    latency_ms: float | None = None  # recent observed latency (e.g. TTFT mean), for adaptive scores
    qps: float | None = None  # requests/s the backend completed recently (counter rate), for qps_memory
    gpu_utilization: float | None = None  # 0..1 share of time a kernel ran (NVML / busy-time counter)


@dataclass(frozen=True, slots=True)
class BackendState:
    """A backend plus everything the control plane currently believes about it."""

    spec: BackendSpec
    health: Health = Health.UNKNOWN
    signals: Signals | None = None
    load_score: float | None = None  # 0 idle .. 1 full; None when unknown or stale
    stale: bool = True  # metrics older than the staleness limit (or never scraped)
    weight: float | None = None  # run-time override of spec.weight (admin API)

    def __post_init__(self) -> None:
        # The admin doors (HTTP and gRPC) set the run-time weight: the same bound as the configured one, so
        # no snapshot can ever carry a weight the routing arithmetic cannot use. One float check per
        # backend state built (a poll round builds one per backend), not per request.
        if self.weight is not None:
            check_value("weight", self.weight, WEIGHT_BOUNDS)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def effective_weight(self) -> float:
        return self.spec.weight if self.weight is None else self.weight

    @property
    def routable(self) -> bool:
        return self.health.routable and self.effective_weight > 0

    @property
    def adapters(self) -> frozenset[str]:
        """The LoRA adapters it has loaded: declared in its spec, plus those its telemetry reports (the
        engine's /v1/models entries with a `parent`, the metrics' running adapters)."""
        declared = frozenset(self.spec.adapters)
        return declared | self.signals.loaded_adapters if self.signals is not None else declared

    def serves(self, model: str | None) -> bool:
        """May a request for `model` go here: no `models` list (any model), the list names it, or it is a
        LoRA adapter loaded here (declared ones are in the list already; discovered ones only here)."""
        models = self.spec.models
        return model is None or not models or model in models or model in self.adapters


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An immutable view of the fleet. `backends` keeps configuration order, which policies rely on."""

    version: int
    backends: tuple[BackendState, ...]
    _by_name: Mapping[str, BackendState] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate backend names in snapshot: {names}")
        object.__setattr__(self, "_by_name", {b.name: b for b in self.backends})

    def get(self, name: str) -> BackendState | None:
        return self._by_name.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.backends)

    def routable(self) -> tuple[BackendState, ...]:
        return tuple(b for b in self.backends if b.routable)

    def evolve(self, backends: Iterable[BackendState]) -> "Snapshot":
        """The next version with a new backend list."""
        return Snapshot(version=self.version + 1, backends=tuple(backends))

    def replace_backend(self, name: str, **changes: Any) -> "Snapshot":
        """The next version with one backend's state changed (e.g. health, signals, weight)."""
        if name not in self._by_name:
            raise KeyError(name)
        return self.evolve(replace(b, **changes) if b.name == name else b for b in self.backends)

    @classmethod
    def initial(cls, specs: Iterable[BackendSpec]) -> "Snapshot":
        return cls(version=1, backends=tuple(BackendState(spec=s) for s in specs))
