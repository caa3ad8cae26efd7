"""Offline what-if replay: the proxy's real routing core on the simulator's engine model, in virtual time.

    python -m loadtest.replay --workload mooncake --policies round_robin,least_load,affinity --backends 4 \\
        --speed 3 --epsilon 0.25 --block-bytes 256 --out loadtest/results/replay-demo

Nothing here is a re-implementation: requests become `RequestSummary`s through the data plane's own
`summary_from_openai`, the policy is `build_policy(RoutingConfig)` from proxy/core, in-flight accounting is
the data plane's `InflightTable` (acquired at pick, released when the stream ends, as `Lease` does), and
telemetry is the real `Poller` (extractor, rate deriver, load score, staleness) reading the simulator's own
`/metrics` rendering every `--poll-ms` of virtual time. The engines are `sim.engine.Engine`
driven by the caller's clock, exactly as the simulated servers drive them in real time.

What the replay leaves out, and the live run has: HTTP and proxy latency (about a millisecond per hop
here), the client's and the proxy's CPU contention on a shared machine, and the jitter of a real-time
driver. `--net-ms` adds a fixed delay per request to approximate the first; the agreement with a live run
on the same window is stated in the comparison report.

Users tune epsilon, block size and score weights on their own trace before deploying: every knob of the
`routing:` and `telemetry.score` sections used by the policies is a flag here.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import sys
import time
from collections import Counter, deque
from concurrent.futures import Executor, Future
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import UnionType
from typing import Any, Callable, Mapping, Sequence, get_args, get_type_hints

from loadtest.records import Record, RunResult
from loadtest.run import add_workload_args, prepare_workload
from sim.api import SimRequest, render_chat
from sim.engine import Engine
from sim.kvcache import Removed as KVRemoved, Stored as KVStored
from sim.metrics import render as render_metrics
from sim.server import models_listing
from sim.profiles import Profile, get_profile
from loadtest.workloads import CHAT, Workload, build_body
from proxy.control.peer_load import PEER_RECENT_MAX, host_view, merge_loads, own_load
from proxy.control.poller import Poller
from proxy.control.store import SnapshotStore
from proxy.control.telemetry_config import TelemetryConfig
from proxy.core import kv_index
from proxy.core.affinity import AffinityPolicy
from proxy.core.decision import Policy
from proxy.core.registry import build_policy
from proxy.core.work_ledger import WorkLedger
from sim.tokenizer import TOKENIZER_DIR, token_ids
from proxy.core.request import summary_from_openai
from proxy.core.routing_config import AffinityConfig, LoadConfig, RoutingConfig
from proxy.core.score import ScoreConfig
from proxy.core.snapshot import BackendSpec, Snapshot
from proxy.core.inflight import InflightTable, SharedInflightTable, SharedLayout
from proxy.core.decision import NoBackendAvailable
from proxy.dataplane.router import Router, UnknownModel
from proxy.metrics import ProxyMetrics

_RATE_WINDOW_S = 1.0
# Policies that read telemetry (load scores). For the others the poller is skipped: their decisions cannot
# depend on it, and rendering and parsing /metrics five times a virtual second is most of a replay's cost.
TELEMETRY_POLICIES = frozenset({"affinity", "least_load", "power_of_two"})


class VirtualBackend:
    """What `sim.metrics.render` reads from a simulated server, on a virtual clock."""

    def __init__(self, name: str, profile: Profile, seed: int, adapters: tuple[str, ...], kv_events: bool = False) -> None:
        self.name = name
        self.profile = profile
        self.engine = Engine(profile, seed=seed, adapters=adapters, kv_events=kv_events)
        self.now = 0.0
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_sum = 0
        # SimBackend's lateness against the engine model (sim/metrics.py): in virtual time never late.
        self.steps = 0
        self.late_seconds = 0.0
        self.late_max_seconds = 0.0

    def note_step(self, end: float, tokens: int) -> None:
        self._recent.append((end, tokens))
        self._recent_sum += tokens
        self.steps += 1

    def tokens_per_second(self) -> float:
        """KV tokens written over the last second, like SimBackend's (steps that ended by `now`)."""
        recent, lo = self._recent, self.now - _RATE_WINDOW_S
        while recent and recent[0][0] < lo:
            self._recent_sum -= recent.popleft()[1]
        late = sum(n for t, n in recent if t > self.now) if recent and recent[-1][0] > self.now else 0
        return (self._recent_sum - late) / _RATE_WINDOW_S

    def busy_seconds(self) -> float:
        return max(0.0, self.engine.busy_time(self.now))

    def memory_used_bytes(self) -> int:
        p = self.profile
        return int(p.model.weight_bytes + p.reserved_bytes * p.tp + self.engine.pool.num_used * p.block_bytes)


class _VirtualPoller(Poller):
    """The real poller, fetching the virtual backends' rendered /metrics instead of doing HTTP."""

    def __init__(self, store: SnapshotStore, config: TelemetryConfig, backends: dict[str, VirtualBackend], clock: Any) -> None:
        super().__init__(store, config, clock=clock)
        self._pages = {f"virtual://{name}/metrics": b for name, b in backends.items()}
        self._models = {f"virtual://{name}/v1/models": b for name, b in backends.items()}

    async def _fetch(self, url: str) -> str:
        if url in self._models:  # adapter discovery reads the engine's /v1/models, as live
            b = self._models[url]
            return json.dumps(models_listing(b.engine, b.profile.model.max_model_len, 0))
        return render_metrics(self._pages[url], "vllm")


@dataclass
class ReplayConfig:
    policy: str = "affinity"
    backends: int = 4
    profile: str = "llama3-8b-h100"
    max_model_len: int | None = None  # e.g. 131072 for Llama-3.1-8B (same architecture, 128k context)
    profile_overrides: tuple[tuple[str, float], ...] = ()  # Profile fields, e.g. (("mfu_prefill", 0.55),)
    affinity_overrides: tuple[tuple[str, float | int | bool], ...] = ()  # any AffinityConfig field, e.g. (("request_epsilon", 3),)
    speed: float = 1.0
    model: str = "llama3-8b"
    adapters: tuple[str, ...] = ()  # LoRA adapters every engine has registered
    # Per-backend LoRA adapters (backend name -> adapters registered on that engine, on top of `adapters`),
    # as a live fleet loaded through /v1/load_lora_adapter; with `declare_adapters` they are also declared
    # in the backends' specs (YAML backends[].adapters), else the proxy learns them by discovery only.
    placement: tuple[tuple[str, tuple[str, ...]], ...] = ()
    declare_adapters: bool = False
    # None: the proxy's own default (AffinityConfig), so a replay matches a live proxy run without flags.
    epsilon: float | None = None
    block_bytes: int | None = None
    min_prefix_blocks: int | None = None
    session_header: bool = False
    score: ScoreConfig = ScoreConfig()
    poll_ms: int = 200
    net_ms: float = 0.0
    # A first sighting that waits for its tokenisation (precise lookup "proxy": `tokenise_now` tokenised it)
    # is picked this much virtual time after it arrived, other arrivals meanwhile picked first, as live
    # (~15 ms mean there: loadtest/results/scaleout-live.md Round 19). 0: picked at once (the default).
    tokenise_wait_ms: float = 0.0
    seed: int = 0
    sample_s: float = 1.0
    # Scale-out (issue 13): R replicas behind a Service (a random replica per request), W workers in each
    # (a random worker), every one with its own policy (learned state) and, unless the workers of a
    # replica share load, its own in-flight table and work ledger.
    replicas: int = 1
    workers: int = 1
    shared_worker_load: bool = True
    # With workers > 1 and shared load, and load_view "own" or "engines" (what a replica reads without
    # routing.peer_load: its own load, or with routing.shared_backends also the engines'): False, the
    # workers of a replica share one in-flight table and one work ledger (an idealised host: one
    # process's load view, each worker its own learned state); True, each has its own row of the proxy's
    # shared-memory table (SharedInflightTable) and its own ledger, as `--workers N` runs without
    # routing.peer_load (the shipped Deployment): the host's queued prefill is read from the shared block
    # (`SharedInflight.backlog`). (load_view "peers" always models the shared-memory host.) See
    # `shm_host_asked`.
    host_table: bool = False
    # learned: each process's own indexes only. precise: each also consults proxy/core/kv_index.py, fed
    # by the engines' own BlockStored/BlockRemoved events, delivered to every replica after this delay.
    index: str = "learned"
    kv_event_delay_ms: float = 50.0
    # When a step's events leave its engine (see KV_EVENTS_AT): "end", after the step (every row recorded
    # before round 16; vLLM releases that publish from `update_from_output`), or "start", when the step is
    # scheduled (the simulator, sim/backend.py, and vLLM releases that publish from `schedule`).
    kv_events_at: str = "end"
    # How a process turns a prompt into token ids for the precise index (see PRECISE_LOOKUPS).
    precise_lookup: str = "proxy"
    # How a replica that sees 1/R of the traffic estimates each backend's load (see LOAD_VIEWS).
    load_view: str = "own"
    # load_view "peers": how often each replica publishes its load and reads the others' (a shared ledger).
    peer_refresh_ms: float = 10.0  # routing.peer_load.refresh_ms's default
    # load_view "peers": each replica also publishes its newest work-ledger entries with their ages, and
    # the others estimate the fleet's queued prefill from them (the proxy's routing.peer_load); False: the
    # summed per-replica estimates only (round 3's peer load).
    # With workers > 1 (shared load) and load_view "peers", a replica is a --workers host as the proxy runs
    # it: the workers share a SharedInflightTable (counts and the host-wide queued prefill), each has its
    # own work ledger; with peer_recent each worker publishes its own part under its own id and reads
    # the other hosts' rows, its host-mates' counts and entries from the shared block (round 5;
    # proxy/control/peer_load.py); without, the same rows without their entries.
    peer_recent: bool = True
    # A perturbation, for measuring how much of a difference is the configuration and how much the
    # trajectory (a 4%-hit window is chaotic: one long prompt placed elsewhere moves it by points): each
    # arrival moves later by a uniform [0, arrival_jitter_ms) drawn from `seed`, never before the one
    # before it (the order, and so every record's index, is the trace's). The traces' timestamps are
    # whole milliseconds, so a jitter under 1 ms is within what the trace itself records.
    arrival_jitter_ms: float = 0.0


# The load side under scale-out: what one process's policy reads as a backend's in-flight work.
#   own       its own in-flight table (the proxy before issue 13)
#   engines   max(own, the engine's running + waiting from the last scrape): `routing.shared_backends`
# (R x own, with and without the engines' counts, was measured at commits 7fd5eb5 and 7ed056f; see
# loadtest/results/scaleout.md.)
#   fleet-counts  (an oracle, for analysis only) every process reads the fleet's exact in-flight counts at
#             once, and its own ledger for their sizes: what exact, instant request counts alone are worth
#   peers     an optional shared ledger (e.g. Redis): every `peer_refresh_ms` each replica publishes its
#             per-backend in-flight requests, tokens and queued uncached prefill, and reads the others'
#             (the policy's `peers` input), with `routing.shared_backends` as the fallback
LOAD_VIEWS = ("own", "engines", "fleet-counts", "peers")
# The load views a replica has without routing.peer_load: `host_table` models its --workers host with them.
HOST_TABLE_VIEWS = ("own", "engines")


def shm_host_asked(cfg: ReplayConfig) -> bool:
    """Whether `host_table` applies: --workers replicas sharing load, with a load view it models."""
    return cfg.host_table and cfg.workers > 1 and cfg.shared_worker_load and cfg.load_view in HOST_TABLE_VIEWS
INDEXES = ("learned", "precise")
# The precise index's lookup in each process:
#   proxy   the data plane's own `PreciseMatcher` with the simulator's tokenizer folder and the proxy's
#           defaults (proxy/dataplane/tokenize.py), each process with its own chunk cache and memo, as each
#           proxy worker has (a --workers host's workers also share their chunks since round 18: with
#           tokenisation taking no virtual time here, that changes no decision): a prompt whose untokenised
#           part exceeds the tokenizer's `offload_chars` waits for its tokenisation off the event loop (the router's `prepare` hook, bounded by
#           `telemetry.kv_events.precise_wait_ms`) and is then routed precisely. The tokenisation is
#           taken to cost no virtual time (`PreciseMatcher.tokenise_now` before the pick): ~30 ms for 64k
#           tokens (`python -m proxy.dataplane.tokenize`) is never near the 200 ms bound, so no wait falls
#           back, and the few ms it adds to those requests' TTFT are not modelled.
#   proxy-nowait  the proxy before the wait (precise_wait_ms 0): such a prompt is tokenised off the loop
#           and routed by the learned index that time (the executor work is done at once)
#   proxy-prefix  proxy-nowait with the matcher's `defer_prefix` on: a deferred prompt is answered from its
#           leading chunks (at most `offload_chars` of them tokenised inline) instead of not at all
#   inline  every prompt tokenised before its pick (what the replay modelled before: an upper bound)
PRECISE_LOOKUPS = ("proxy", "proxy-nowait", "proxy-prefix", "inline")
# When a step's KV events leave its engine (ReplayConfig.kv_events_at).
KV_EVENTS_AT = ("end", "start")


class _AtOnce(Executor):
    """An executor that runs each task in the caller, at once: the replay's stand-in for the proxy's
    tokenising thread pool, so a deferred prompt's chunks are cached deterministically before the next pick."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the future, as a pool would
            fut.set_exception(exc)
        return fut


def parse_profile_sets(items: Sequence[str]) -> dict[str, float]:
    """``KEY=VALUE`` pairs for Profile fields (e.g. ``mfu_prefill=0.55``): what-ifs on the hardware model,
    and a way to replay a past live run with the simulator settings it ran with."""
    out: dict[str, float] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--profile-set expects KEY=VALUE, got {item!r}")
        out[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
    return out


_KINDS = (bool, int, float)  # the AffinityConfig field types a replay can override from the command line
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def _field_kinds() -> dict[str, Any]:
    """Each AffinityConfig field's type, an optional one's as the type it takes when set (`uncached_weight:
    float | None` is a float): from the annotations, since a default of None names no type."""
    hints = get_type_hints(AffinityConfig)
    out: dict[str, Any] = {}
    for f in fields(AffinityConfig):
        kind = hints[f.name]
        if isinstance(kind, UnionType):
            set_as = [a for a in get_args(kind) if a is not type(None)]
            kind = set_as[0] if len(set_as) == 1 else kind
        out[f.name] = kind
    return out


def _typed(overrides: Sequence[tuple[str, float | int | bool]]) -> dict[str, float | int | bool]:
    """Each override as its AffinityConfig field's type (a suite's ``float(band)`` for an int field, 1 for a
    bool): the compiled policy (proxy/native) checks them, the interpreted one let them through."""
    kinds = _field_kinds()
    out: dict[str, float | int | bool] = {}
    for key, value in overrides:
        kind = kinds.get(key)
        if kind is int and float(value) != int(value):
            raise ValueError(f"affinity setting {key} is a whole number, got {value!r}")
        out[key] = kind(value) if kind in _KINDS else value
    return out


def parse_affinity_sets(items: Sequence[str]) -> dict[str, float | int | bool]:
    """``KEY=VALUE`` pairs for AffinityConfig fields (``--affinity-set cost_aware=false``), each value of its
    field's type (`_typed`): the compiled policy (proxy/native) refuses an int where the config says bool."""
    kinds = _field_kinds()
    pairs: list[tuple[str, float | int | bool]] = []
    for item in items:
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq:
            raise ValueError(f"--affinity-set expects KEY=VALUE, got {item!r}")
        kind = kinds.get(key)
        if kind not in _KINDS:
            raise ValueError(f"--affinity-set: {key!r} is not a numeric or boolean affinity setting")
        if kind is bool:
            if value.lower() not in _BOOL_WORDS:
                raise ValueError(f"--affinity-set {key}: expected true or false, got {value!r}")
            pairs.append((key, _BOOL_WORDS[value.lower()]))
        else:
            pairs.append((key, int(value) if kind is int else float(value)))
    return _typed(pairs)


def make_profile(name: str, max_model_len: int | None, overrides: dict[str, float] | None = None) -> Profile:
    p = get_profile(name)
    if max_model_len:
        p = p.with_overrides(model=replace(p.model, max_model_len=max_model_len))
    if overrides:
        unknown = [k for k in overrides if not hasattr(p, k) or k in ("model", "gpu", "name")]
        if unknown:
            raise ValueError(f"unknown profile field(s) {unknown}")
        p = p.with_overrides(**overrides)
    return p


def scaleout_label(cfg: ReplayConfig) -> str:
    """' R2xW2 precise ...' for a scale-out run, '' for the single process the replay always modelled."""
    if (cfg.replicas == 1 and cfg.workers == 1 and cfg.index == "learned" and cfg.load_view == "own"
            and cfg.arrival_jitter_ms <= 0):
        return ""
    parts = [f"R{cfg.replicas}xW{cfg.workers}", cfg.index]
    if cfg.workers > 1:
        parts.append("shared-load" if cfg.shared_worker_load else "separate-load")
        if shm_host_asked(cfg):
            parts.append("shm-host")
    if cfg.index == "precise":
        parts.append(f"delay {cfg.kv_event_delay_ms:g}ms")
        if cfg.kv_events_at != "end":
            parts.append(f"events at {cfg.kv_events_at}")
        if cfg.precise_lookup != "proxy":
            parts.append(f"lookup {cfg.precise_lookup}")
        if cfg.tokenise_wait_ms:
            parts.append(f"tokenise wait {cfg.tokenise_wait_ms:g}ms")
    if cfg.load_view != "own":
        parts.append(f"load {cfg.load_view}")
    if cfg.load_view == "peers":
        parts.append(f"every {cfg.peer_refresh_ms:g}ms")
        if not cfg.peer_recent:
            parts.append("sums only")
    if cfg.arrival_jitter_ms > 0:
        parts.append(f"jitter {cfg.arrival_jitter_ms:g}ms seed {cfg.seed}")
    return " " + " ".join(parts)


def arrival_times(items: Sequence[Any], cfg: ReplayConfig) -> list[float]:
    """Each item's arrival in replay seconds: its trace time over `speed`, plus `arrival_jitter_ms`'s
    seeded jitter (in trace time, before `speed`), kept in the trace's order."""
    if cfg.arrival_jitter_ms <= 0:
        return [it.t / cfg.speed for it in items]
    rng = random.Random(cfg.seed ^ 0xA771)
    out: list[float] = []
    prev = float("-inf")
    for it in items:
        prev = max(prev, it.t + rng.random() * cfg.arrival_jitter_ms / 1000.0)
        out.append(prev / cfg.speed)
    return out


def routing_config(cfg: ReplayConfig) -> RoutingConfig:
    return RoutingConfig(
        policy=cfg.policy,
        seed=cfg.seed,
        session_header="x-session-id" if cfg.session_header else None,
        load=LoadConfig(),
        affinity=replace(AffinityConfig(), **{
            **{k: v for k, v in (("epsilon", cfg.epsilon), ("block_bytes", cfg.block_bytes),
                                 ("min_prefix_blocks", cfg.min_prefix_blocks)) if v is not None},
            **_typed(cfg.affinity_overrides),
        }),
    )


async def replay(workload: Workload, cfg: ReplayConfig, *, policy: Policy | None = None,
                 observe: Callable[[int, str, str, Mapping[str, Engine]], None] | None = None,
                 kv_tap: Callable[[str, float, list[Any]], None] | None = None) -> RunResult:
    """Replay `workload` through policy + engines in virtual time; same result shape as a live run.
    `policy`: pick with this object instead of `cfg.policy` (loadtest/experiment_replay.py passes one that
    splits the requests between an experiment's arms). `observe(index, backend, request id, engines)`:
    called as each request reaches its engine, in virtual time, with every engine as it is at that
    instant (loadtest/results/scaleout.py `losses` reads what each engine holds of the prompt then).
    `kv_tap(backend, virtual time sent, pool events)`: every engine step's KV-cache events (`--index precise`),
    as the engine hands them to its publisher (loadtest/bench_kv_events.py encodes them as vLLM would)."""
    profile = make_profile(cfg.profile, cfg.max_model_len, dict(cfg.profile_overrides))
    # The live fleet's names (sim.fleet: sim-0, sim-1, ...): rendezvous hashing keys on backend names,
    # so equal names give a live run and its replay the same hash homes.
    names = [f"sim-{i}" for i in range(cfg.backends)]
    precise = cfg.index == "precise"
    placed = dict(cfg.placement)
    unknown = sorted(set(placed) - set(names))
    if unknown:
        raise ValueError(f"placement names backends {unknown} that the replay does not have ({', '.join(names)})")
    own = {n: tuple(dict.fromkeys((*cfg.adapters, *placed.get(n, ())))) for n in names}
    backends = {n: VirtualBackend(n, profile, cfg.seed + i, own[n], kv_events=precise) for i, n in enumerate(names)}
    specs = [BackendSpec(name=n, url=f"virtual://{n}", metrics_url=f"virtual://{n}/metrics",
                         adapters=placed.get(n, ()) if cfg.declare_adapters else ()) for n in names]
    engines = {n: b.engine for n, b in backends.items()}  # (what `observe` sees)
    store = SnapshotStore(Snapshot.initial(specs))
    clock = [0.0]
    telemetry = TelemetryConfig(interval_ms=cfg.poll_ms, timeout_ms=max(1, cfg.poll_ms - 1), score=cfg.score)
    poller = _VirtualPoller(store, telemetry, backends, lambda: clock[0])
    rcfg = routing_config(cfg)
    if cfg.load_view in ("engines", "peers"):
        rcfg = replace(rcfg, shared_backends=True)  # the core's own estimate (routing.shared_backends)
    # The precise index: with one delivery delay for every replica, every replica's index holds the same
    # events at every instant, so one KVIndex object stands for all R of them (same answers, 1/R the work).
    kvidx = kv_index.KVIndex(eviction_ages=True) if precise else None  # (ages: routing.affinity.eviction_band_tokens)
    routing_ids: list[list[int]] = [[]]  # token ids of the prompt being routed, read by the precise view
    if kvidx is not None:
        for n in names:
            kvidx.track(n, model=cfg.model)
            kvidx.mark_fresh(n)  # a replay's event stream has no gaps

    def precise_view(req: Any) -> kv_index.PreciseMatch | None:
        ids = routing_ids[0]
        if not ids:
            return None
        return kv_index.PreciseMatch(len(ids), kvidx.match(ids, cfg.model), profile.block_size,  # type: ignore[union-attr]
                                     kvidx.lru_front)  # type: ignore[union-attr]

    if cfg.kv_events_at not in KV_EVENTS_AT:
        raise ValueError(f"kv_events_at must be one of {KV_EVENTS_AT}, got {cfg.kv_events_at!r}")
    if precise and cfg.precise_lookup not in PRECISE_LOOKUPS:
        raise ValueError(f"precise_lookup must be one of {PRECISE_LOOKUPS}, got {cfg.precise_lookup!r}")
    at_once = _AtOnce()

    def process_view() -> Any:
        """One process's precise lookup: the shared events index, this process's tokenizer caches."""
        if not precise:
            return None
        if cfg.precise_lookup == "inline":
            return precise_view
        from proxy.dataplane.tokenize import ModelTokenizer, PreciseMatcher

        matcher = PreciseMatcher(kvidx, {cfg.model: ModelTokenizer.from_dir(TOKENIZER_DIR, executor=at_once)},
                                 executor=at_once, defer_prefix=cfg.precise_lookup == "proxy-prefix",
                                 wait_s=0.2 if cfg.precise_lookup == "proxy" else 0.0)
        matchers.append(matcher)
        return matcher

    matchers: list[Any] = []
    waits: list[Any] = []  # per process: its prepare hook (virtual time), or None
    # R x W processes; workers of one replica share in-flight and ledger when `shared_worker_load`. Each
    # picks through the data plane's own Router (model and LoRA-holder exclusion, saturation), as live.
    procs: list[tuple[Any, InflightTable]] = []
    if policy is not None:  # a caller's own policy (loadtest/experiment_replay.py): one process routes with it
        procs.append((policy, InflightTable()))
        waits.append(None)
    # load_view "peers": per replica, the other replicas' load as of the last refresh.
    peer_views: list[dict[str, Any]] = [{} for _ in range(cfg.replicas)]
    replica_load: list[list[tuple[InflightTable, WorkLedger]]] = [[] for _ in range(cfg.replicas)]
    # --workers hosts (see ReplayConfig.peer_recent): per process (its replica, its table, its ledger), and
    # what it last read from the others.
    hosts = policy is None and (shm_host_asked(cfg) or (
        cfg.workers > 1 and cfg.shared_worker_load and cfg.load_view == "peers"))
    host_procs: list[tuple[int, SharedInflightTable, WorkLedger]] = []
    proc_views: list[dict[str, Any]] = [{} for _ in range(cfg.replicas * cfg.workers)]
    # With the index, the ledgers (and a --workers host's shared table) follow the engines' progress, as
    # the proxy's do with telemetry.kv_events: routing.affinity.running_weight decides what it counts.
    progress = kvidx.progress if kvidx is not None else None
    for r in range(cfg.replicas if policy is None else 0):
        replica_table, replica_ledger = InflightTable(), WorkLedger(progress=progress)
        peers = (lambda r=r: peer_views[r]) if cfg.load_view == "peers" else None
        layout = SharedLayout(rows=cfg.workers, slots=max(1, len(names)))
        host_buf = memoryview(bytearray(layout.size)) if hosts else None
        for w in range(cfg.workers):
            table = replica_table if cfg.shared_worker_load else InflightTable()
            ledger = replica_ledger if cfg.shared_worker_load else WorkLedger(progress=progress)
            if host_buf is not None:
                table, ledger = SharedInflightTable(host_buf, layout, w), WorkLedger(progress=progress)
                table.assign({n: k for k, n in enumerate(names)})
                if progress is not None:
                    table.follow_progress(progress)
                host_procs.append((r, table, ledger))
                if cfg.peer_recent and cfg.load_view == "peers":
                    peers = (lambda p=len(host_procs) - 1: proc_views[p])
            view = None
            if cfg.policy == "affinity":
                view = process_view()
                pol: Any = AffinityPolicy(rcfg, precise=view, work=ledger, peers=peers)
            else:
                pol = build_policy(rcfg, instance=r * cfg.workers + w)
            procs.append((pol, table))
            # The router's prepare hook, in virtual time: the wait for a long prompt's tokenisation.
            waits.append(view.tokenise_now if cfg.precise_lookup == "proxy" and view is not None
                         and hasattr(view, "tokenise_now") else None)
            if not replica_load[r] or not cfg.shared_worker_load:
                replica_load[r].append((table, ledger))
    n_procs = len(procs)
    fleet_table = InflightTable() if cfg.load_view == "fleet-counts" else None
    routers = [Router(store, pol, table if fleet_table is None else fleet_table, ProxyMetrics()) for pol, table in procs]
    pick_rng = random.Random(cfg.seed ^ 0x5CA1E0)

    text = workload.text()
    # Every adapter some engine has registered: what a live proxy knows once discovery has read each
    # /v1/models (the replay's non-telemetry policies skip the poller); the Router adds declared ones.
    adapters = frozenset(a for names_ in own.values() for a in names_)

    records: list[Record] = []
    live: dict[str, tuple[Record, str, int, float, InflightTable]] = {}  # id -> (record, backend, tokens, arrival, table)
    samples: list[dict[str, Any]] = []
    route_cpu = 0.0
    waited = 0
    reasons: Counter[str] = Counter()
    items = workload.items
    arrivals = arrival_times(items, cfg)
    net = cfg.net_ms / 1000.0
    next_poll = 0.0 if cfg.policy in TELEMETRY_POLICIES else float("inf")
    next_sample = 0.0
    next_peer = 0.0 if cfg.load_view == "peers" and policy is None else float("inf")

    def publish_hosts() -> None:
        """--workers hosts (with `peer_recent`): each worker publishes its own part (`peer_load.own_load`,
        the proxy's own code: its epochs ticked, its row of the host's table, its own entries) and reads
        the other hosts' rows merged (`peer_load.merge_loads`, `host_view`); its host-mates it reads from
        the host's shared block (its policy's `_with_peers`); without `peer_recent`, the same rows without
        their entries (round 3's sums). (Round 4's --workers host, which published its host-wide sums
        once, was replayed at commit 70dd986; round 4b's, the mates' rows read from Redis too, at commit
        a67f38f: scaleout.md Round 4b, Round 5.)"""
        rows = [own_load(ledger, table, names, proc_views[p]) for p, (_r, table, ledger) in enumerate(host_procs)]
        if not cfg.peer_recent:  # rows without entries (round 3's sums, per worker)
            rows = [{n: v[:3] for n, v in row.items()} for row in rows]
        # Each worker reads the other hosts' rows (peer_load's exchange skips its host-mates', whose counts
        # and entries its policy reads from the host's shared block: round 5), as `PeerLoadExchange` keeps it.
        for p, (r, _table, _ledger) in enumerate(host_procs):
            others = merge_loads([row for q, row in enumerate(rows) if host_procs[q][0] != r])
            proc_views[p] = host_view(others, rows[p])

    def publish_peers() -> None:
        """Each replica's published load, summed per backend over the OTHER replicas; with `peer_recent`
        also each one's newest ledger entries (as `AffinityProxy._own_load` publishes them: its live
        count plus the others' as it last read them, at most PEER_RECENT_MAX), its epoch ticked first."""
        published = []
        # (W > 1 with shared load is `publish_hosts`; here W > 1 only with separate loads, which no
        # proxy runs: such a replica publishes its sums only.)
        recent_rows = cfg.peer_recent and cfg.workers == 1
        for r, loads in enumerate(replica_load):
            mine: dict[str, list[Any]] = {}
            for table, ledger in loads:
                if recent_rows:
                    ledger.tick()
                for n in names:
                    f = table.get(n)
                    live = f.requests if f is not None else 0
                    recent: tuple[Any, ...] = ()
                    if recent_rows:
                        seen = peer_views[r].get(n)
                        recent = ledger.recent(n, min(PEER_RECENT_MAX, live + (seen[0] if seen else 0)))
                    if live <= 0 and not recent:
                        continue
                    acc = mine.setdefault(n, [0, 0, 0.0, []])
                    if f is not None and live > 0:
                        acc[0] += f.requests
                        acc[1] += f.tokens
                        acc[2] += ledger.pending(n, f)
                    acc[3].extend(recent)
            published.append(mine)
        for r in range(len(peer_views)):
            view: dict[str, Any] = {}
            for o, mine in enumerate(published):
                if o == r:
                    continue
                for n, (q, t, p, recent) in mine.items():
                    v = view.get(n, (0, 0, 0.0, ()))
                    view[n] = (v[0] + int(q), v[1] + int(t), v[2] + p, (*v[3], *recent))
            if recent_rows:  # as peer_load.merge_rows: the entries sorted by age
                view = {n: (*v[:3], tuple(sorted(v[3], key=lambda e: e[0]))) for n, v in view.items()}
            else:
                view = {n: v[:3] for n, v in view.items()}
            peer_views[r] = view
    i = 0
    end_t = 0.0

    def sample(t: float) -> None:
        for n, b in backends.items():
            e = b.engine
            b.now = t
            samples.append({
                "t": t, "backend": n, "running": e.num_running, "waiting": e.num_waiting, "kv_usage": e.kv_usage,
                "prefix_queries": e.stats.prefix_queries_tokens, "prefix_hits": e.stats.prefix_hits_tokens,
                "busy_s": b.busy_seconds(),
            })

    # Step outputs reach the proxy when the step ends (plus `net`): a heap of (time, order, outputs, backend).
    deliveries: list[tuple[float, int, Any, str]] = []
    order = 0
    inf = float("inf")

    def deliver(t: float, outputs: Any, name: str) -> None:
        for out in outputs:
            entry = live.get(out.request_id)
            if entry is None:
                continue
            rec, bname, tokens, sent, table = entry
            if out.first_token and rec.ttft is None:
                rec.ttft = t - sent
            if out.finished:
                rec.status = 200
                rec.e2e = t - sent
                if out.usage is not None:
                    rec.output_tokens = out.usage.completion_tokens
                    rec.cached_tokens = out.usage.cached_tokens
                if rec.ttft is not None and rec.output_tokens > 1:
                    rec.tpot = (rec.e2e - rec.ttft) / (rec.output_tokens - 1)
                table.release(bname, tokens)
                if fleet_table is not None:
                    fleet_table.release(bname, tokens)
                records.append(rec)
                del live[out.request_id]

    next_step = {n: inf for n in backends}

    def refresh(name: str) -> None:
        nt = backends[name].engine.next_step_time()
        next_step[name] = inf if nt is None else nt

    # KV events reach every replica `kv_event_delay_ms` after the step that produced them.
    kv_deliveries: list[tuple[float, int, str, list[Any]]] = []
    kv_delay = cfg.kv_event_delay_ms / 1000.0
    events_at_start = cfg.kv_events_at == "start"
    block_size = profile.block_size

    def apply_kv(name: str, events: list[Any]) -> None:
        assert kvidx is not None
        for ev in events:
            if isinstance(ev, KVStored):
                kvidx.stored(name, ev.keys, ev.parent, token_ids(" ".join(ev.tokens)), block_size, lora_name=ev.adapter)
            elif isinstance(ev, KVRemoved):
                kvidx.removed(name, ev.keys)
            else:
                kvidx.clear(name)
        for _r, table, _ledger in host_procs:  # each worker's subscriber publishes its count (on_progress)
            table.publish_count(name)

    tok_wait = cfg.tokenise_wait_ms / 1000.0
    # (pick time, order, request index, time sent, path, body, prompt, summary, process): waited first sightings
    postponed: list[tuple[float, int, int, float, str, dict[str, Any], str, Any, int]] = []
    while True:
        t_arr = arrivals[i] + net if i < len(items) else inf
        t_post = postponed[0][0] if postponed else inf
        if t_post < t_arr:
            t_arr = t_post
        # An engine's next step time changes only when it is given a request or runs a step: cached.
        step_name = min(next_step, key=next_step.__getitem__)
        t_step = next_step[step_name]
        t_del = deliveries[0][0] if deliveries else inf
        t_kv = kv_deliveries[0][0] if kv_deliveries else inf
        if t_arr == inf and t_step == inf and t_del == inf:
            break
        t_next = min(t_arr, t_step, t_del, t_kv, next_poll, next_sample, next_peer)
        if t_next == t_kv:
            _, _, name, events = heapq.heappop(kv_deliveries)
            apply_kv(name, events)
            continue
        if t_next == t_del:
            _, _, outputs, name = heapq.heappop(deliveries)
            deliver(t_del, outputs, name)
            continue
        if t_next == next_peer:
            publish_hosts() if hosts else publish_peers()
            next_peer += cfg.peer_refresh_ms / 1000.0
            continue
        if t_next == next_sample:
            sample(t_next)
            next_sample += cfg.sample_s
            continue
        if t_next == next_poll:
            clock[0] = t_next
            for b in backends.values():
                b.now = t_next
            await poller.poll_once()
            next_poll += cfg.poll_ms / 1000.0
            continue
        if t_next == t_arr:
            # k: the request picked now; i: the next one to arrive
            if t_arr == t_post:  # a waited first sighting, tokenised: its pick
                _, _, k, t_sent, path, body, prompt, summary, p_i = heapq.heappop(postponed)
                item, inflight, router = items[k], procs[p_i][1], routers[p_i]
                c0 = time.perf_counter()
            else:
                k, t_sent = i, t_arr - net
                i += 1
                item = items[k]
                path, body = build_body(item, text, model=cfg.model, stream=True)
                prompt = render_chat(body["messages"]) if path == CHAT else body["prompt"]
                p_i = pick_rng.randrange(n_procs) if n_procs > 1 else 0
                inflight, router = procs[p_i][1], routers[p_i]
                c0 = time.perf_counter()
                if precise and cfg.precise_lookup == "inline":
                    routing_ids[0] = token_ids(prompt)  # the proxy tokenises with the model's tokenizer
                summary = summary_from_openai(path, body, session_key=item.session if cfg.session_header else None,
                                              adapters=adapters | router.adapter_names())
                if waits[p_i] is not None and waits[p_i](summary):
                    waited += 1
                    if tok_wait > 0:
                        route_cpu += time.perf_counter() - c0
                        order += 1
                        heapq.heappush(postponed, (t_arr + tok_wait, order, k, t_sent, path, body, prompt, summary, p_i))
                        continue
            try:
                decision, _ = router.pick(summary, frozenset())
            except NoBackendAvailable as exc:  # answered by the proxy itself, as live (404 / 503)
                route_cpu += time.perf_counter() - c0
                status = 404 if isinstance(exc, UnknownModel) else 503
                records.append(Record(index=k, sent=t_sent, scheduled=arrivals[k],
                                      input_tokens=item.input_tokens, status=status, error=str(exc)[:300]))
                continue
            if matchers:
                await asyncio.sleep(0)  # the loop runs the tokeniser's done-callbacks, as the proxy's would
            tokens = summary.prompt_tokens_est + (summary.max_tokens or 0)
            inflight.acquire(decision.backend, tokens)
            if fleet_table is not None:
                fleet_table.acquire(decision.backend, tokens)
            route_cpu += time.perf_counter() - c0
            reasons[decision.reason.value] += 1
            rid = f"r{k}"
            rec = Record(index=k, sent=t_sent, scheduled=arrivals[k], input_tokens=item.input_tokens, backend=decision.backend)
            b = backends[decision.backend]
            b.now = t_arr
            try:
                b.engine.add_request(
                    SimRequest(rid, prompt, max_tokens=item.output_tokens, temperature=0.0,
                               model=item.model if item.model in adapters else None, ignore_eos=True),
                    t_arr,
                )
            except Exception as exc:  # the engine refuses it (too long: 400, unknown model: 404), as live
                rec.status, rec.error = getattr(exc, "status", 400), f"{type(exc).__name__}: {exc}"[:300]
                inflight.release(decision.backend, tokens)
                if fleet_table is not None:
                    fleet_table.release(decision.backend, tokens)
                records.append(rec)
            else:
                live[rid] = (rec, decision.backend, tokens, t_sent, inflight)
                refresh(decision.backend)
                if observe is not None:
                    observe(k, decision.backend, rid, engines)
            continue
        b = backends[step_name]
        result = b.engine.step(t_step)
        refresh(step_name)
        b.note_step(result.end, result.num_prefill_tokens + result.num_decode_tokens)
        if precise:
            events = b.engine.take_kv_events()
            if events:
                order += 1
                sent_at = t_step if events_at_start else result.end
                if kv_tap is not None:
                    kv_tap(step_name, sent_at, events)
                heapq.heappush(kv_deliveries, (sent_at + kv_delay, order, step_name, events))
        end_t = max(end_t, result.end + net)
        if result.outputs:
            order += 1
            heapq.heappush(deliveries, (result.end + net, order, result.outputs, step_name))
    while kv_deliveries:  # events of the last steps, delivered after the last request finished
        _, _, name, events = heapq.heappop(kv_deliveries)
        apply_kv(name, events)
    sample(max(end_t, next_sample - cfg.sample_s))
    records.sort(key=lambda r: r.index)
    capacity = {n: b.engine.pool.num_blocks * profile.block_size for n, b in backends.items()}
    meta = {
        "label": f"replay:{cfg.policy}" + scaleout_label(cfg),
        "mode": "replay",
        "speed": cfg.speed,
        "replay": {k: (v if not isinstance(v, ScoreConfig) else repr(v)) for k, v in cfg.__dict__.items()},
        "workload": workload.summary(),
        "route_cpu_s": route_cpu,
        "reasons": dict(reasons),
    }
    if matchers:
        meta["precise_deferred"] = sum(m.deferred for m in matchers)  # first sightings routed by the learned index
        meta["precise_errors"] = sum(m.errors for m in matchers)
        meta["precise_waited"] = waited  # first sightings tokenised before their pick (lookup proxy)
    if kvidx is not None:
        # What the precise index ended with next to what the engines really hold (equal unless events
        # were lost: the feed's own check).
        meta["kv_index"] = {n: {"index_blocks": kvidx.num_blocks(n), "engine_cached_blocks": b.engine.pool.num_cached,
                                **kvidx.stats(n)} for n, b in backends.items()}
    return RunResult(meta, records, samples, capacity, end_t, route_cpu)


def isolated_ttfts(workload: Workload, profile: Profile) -> list[float]:
    """Each request's TTFT alone on an idle GPU with an empty cache: the floor no router can go below.

    On long-context traces the p99 TTFT of any policy is bounded by the prefill of the longest prompts
    that nobody has cached yet; this separates that floor from queueing, which routing can change.
    """
    out = []
    for i, item in enumerate(workload.items):
        blocks = -(-(item.input_tokens + item.output_tokens) // profile.block_size) + 2
        p = profile.with_overrides(num_gpu_blocks_override=blocks)
        if p.model.max_model_len < item.input_tokens + item.output_tokens:
            continue
        engine = Engine(p, seed=0)
        engine.add_request(SimRequest(f"iso{i}", "w " * item.input_tokens, max_tokens=1, ignore_eos=True), 0.0)
        t = engine.next_step_time()
        while t is not None:
            result = engine.step(t)
            if any(o.first_token for o in result.outputs):
                out.append(result.end)
                break
            t = engine.next_step_time()
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.replay", description=__doc__.split("\n")[0])
    add_workload_args(ap)
    ap.add_argument("--policies", default="round_robin,least_request,least_load,affinity")
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--max-model-len", type=int, default=131072, help="context limit of the simulated model (Llama-3.1-8B: 131072)")
    ap.add_argument("--profile-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a simulator profile field, e.g. mfu_prefill=0.5 (repeat)")
    ap.add_argument("--speed", type=float, default=1.0, help="time compression of the arrivals, as for loadtest.run")
    ap.add_argument("--epsilon", type=float, help="affinity bounded-load slack (default: the proxy's)")
    ap.add_argument("--block-bytes", type=int, help="affinity prefix block size in bytes (default: the proxy's)")
    ap.add_argument("--min-prefix-blocks", type=int, help="shortest prefix match worth following (default: the proxy's)")
    ap.add_argument("--affinity-set", action="append", default=[], metavar="KEY=VALUE",
                    help="any other field of the routing.affinity section, e.g. request_epsilon=3 (repeat)")
    ap.add_argument("--score-kind", default="design", choices=("design", "qps_memory", "request_cost"))
    ap.add_argument("--score-weights", help="design score weights memory,queue,kv_rate (e.g. 0.4,0.35,0.25)")
    ap.add_argument("--poll-ms", type=int, default=200)
    ap.add_argument("--net-ms", type=float, default=0.0, help="fixed client<->engine delay added to every request")
    ap.add_argument("--tokenise-wait-ms", type=float, default=0.0,
                    help="a first sighting that waits for its tokenisation is picked this much later (live: ~15 ms)")
    ap.add_argument("--session-header", action="store_true", help="route with the workload's session ids")
    ap.add_argument("--adapters", default="", help="comma-separated LoRA adapter names the engines know")
    ap.add_argument("--replicas", type=int, default=1, help="proxy replicas behind a Service: each request goes to a random one")
    ap.add_argument("--workers", type=int, default=1, help="worker processes per replica (a random one per request)")
    ap.add_argument("--shared-worker-load", action=argparse.BooleanOptionalAction, default=True,
                    help="workers of one replica share in-flight counts and the work ledger (the product does)")
    ap.add_argument("--host-table", action="store_true",
                    help="with --workers > 1 and --load-view own or engines: each worker its own row of the proxy's "
                         "shared-memory in-flight table and its own ledger, as --workers runs without "
                         "routing.peer_load (default: one table and ledger for all, an idealised host)")
    ap.add_argument("--index", default="learned", choices=INDEXES,
                    help="learned: each process's own indexes; precise: also the engines' KV events (proxy/core/kv_index.py)")
    ap.add_argument("--peer-recent", action=argparse.BooleanOptionalAction, default=True,
                    help="--load-view peers: replicas also publish their newest ledger entries and read the fleet's "
                         "queued prefill from them (the proxy); --no-peer-recent: the summed estimates only (round 3)")
    ap.add_argument("--peer-refresh-ms", type=float, default=10.0,
                    help="--load-view peers: how often each replica publishes its load and reads the others'")
    ap.add_argument("--precise-lookup", default="proxy", choices=PRECISE_LOOKUPS,
                    help="proxy: the data plane's PreciseMatcher (a long first sighting waits for its tokenisation "
                         "off the loop, in no virtual time); proxy-nowait: routed by the learned index meanwhile; "
                         "inline: every prompt tokenised before its pick")
    ap.add_argument("--kv-event-delay-ms", type=float, default=50.0, help="engine step -> every replica's index (precise)")
    ap.add_argument("--kv-events-at", default="end", choices=KV_EVENTS_AT,
                    help="when a step's KV events leave its engine: end (after the step; vLLM publishing from "
                         "update_from_output) or start (when it is scheduled: the simulator, vLLM publishing "
                         "from schedule)")
    ap.add_argument("--load-view", default="own", choices=LOAD_VIEWS,
                    help="what a replica reads as a backend's load: its own table, or also the engines' running+waiting")
    ap.add_argument("--arrival-jitter-ms", type=float, default=0.0,
                    help="move each arrival later by a uniform [0, this) ms drawn from --seed, order kept: a "
                         "perturbation to tell a configuration's effect from the trajectory's chaos")
    ap.add_argument("--out", type=Path, help="report folder (report.md/.json/.png)")
    args = ap.parse_args(argv)
    if args.replicas < 1 or args.workers < 1:
        ap.error("--replicas and --workers must be >= 1")
    if args.kv_event_delay_ms < 0:
        ap.error("--kv-event-delay-ms must be >= 0")
    if args.arrival_jitter_ms < 0:
        ap.error("--arrival-jitter-ms must be >= 0")
    workload = prepare_workload(args)
    score = ScoreConfig(kind=args.score_kind)
    if args.score_weights:
        m, q, k = (float(x) for x in args.score_weights.split(","))
        score = replace(score, memory_weight=m, queue_weight=q, kv_rate_weight=k)
    from loadtest.report import design_comparison, summarize, write_report

    summaries = []
    for pol in filter(None, (p.strip() for p in args.policies.split(","))):
        cfg = ReplayConfig(
            policy=pol, backends=args.backends, profile=args.profile, max_model_len=args.max_model_len,
            profile_overrides=tuple(parse_profile_sets(args.profile_set).items()),
            affinity_overrides=tuple(parse_affinity_sets(args.affinity_set).items()),
            speed=args.speed, epsilon=args.epsilon, block_bytes=args.block_bytes,
            min_prefix_blocks=args.min_prefix_blocks, score=score, poll_ms=args.poll_ms, net_ms=args.net_ms,
            tokenise_wait_ms=args.tokenise_wait_ms,
            session_header=args.session_header, seed=args.seed,
            adapters=tuple(a for a in args.adapters.split(",") if a),
            replicas=args.replicas, workers=args.workers, shared_worker_load=args.shared_worker_load,
            host_table=args.host_table,
            index=args.index, kv_event_delay_ms=args.kv_event_delay_ms, kv_events_at=args.kv_events_at,
            load_view=args.load_view, precise_lookup=args.precise_lookup, peer_refresh_ms=args.peer_refresh_ms,
            peer_recent=args.peer_recent, arrival_jitter_ms=args.arrival_jitter_ms,
        )
        t0 = time.perf_counter()
        result = asyncio.run(replay(workload, cfg))
        elapsed = time.perf_counter() - t0
        s = summarize(result, workload, label=f"replay {pol}{scaleout_label(cfg)}")
        s["replay_wall_s"] = elapsed
        summaries.append(s)
        print(
            f"{pol + scaleout_label(cfg):>14}: {len(result.records)} requests, {result.wall_s:.0f} virtual s in {elapsed:.1f} s; "
            f"TTFT p50 {(s['ttft_p50'] or 0) * 1000:.0f} ms p99 {(s['ttft_p99'] or 0) * 1000:.0f} ms, "
            f"hit {(s['hit_ratio'] or 0) * 100:.1f}%, util {(s['gpu_util_mean'] or 0) * 100:.0f}% std {(s['gpu_util_std'] or 0) * 100:.1f} pts, "
            f"errors {s['errors']}; reasons {result.meta['reasons']}",
            flush=True,
        )
    if args.out:
        write_report(summaries, args.out, title=f"offline replay: {workload.name}", workload=workload,
                     preface=f"Command: `python -m loadtest.replay {' '.join(argv or sys.argv[1:])}`",
                     appendix="## The design's table next to ours\n\n" + design_comparison(summaries))
    print(json.dumps([{k: v for k, v in s.items() if isinstance(v, (int, float, str)) or v is None} for s in summaries], indent=1)[:4000])


if __name__ == "__main__":
    main()
