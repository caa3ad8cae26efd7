"""The other proxy replicas' live load, shared through Redis (`routing.peer_load`, optional, off by default).

Why: with R replicas behind a Service each sees ~1/R of the traffic, so its in-flight counts and work
ledger miss the requests the others just sent to the same backends; what no estimate from the engines'
counts gives is the size of those newest requests (loadtest/results/scaleout.md). The affinity policy
takes an optional `peers` input for that (proxy/core/affinity.py `_with_peers`); this component fills it.

What it does, every `refresh_ms` (default 10), in ONE round trip to Redis: publish this process's row
(per backend: in-flight requests, in-flight tokens, queued uncached prefill tokens, and its newest
work-ledger entries with their ages in refreshes, `own_load`) under
`<key_prefix>:replica:<replica id>` with a TTL of max(3 x refresh, 1 s), so a dead replica's load expires
by itself, and read every other live replica's row. The round trip is one Lua script (EVALSHA): SET the
own row with PX ttl, SADD the replica id to `<key_prefix>:replicas`, then GET every other member's row
(dropping the members whose row has expired) and return them. Why a script: SCAN + GETs (or KEYS + MGET)
needs two round trips and SCAN walks the whole keyspace; one hash per backend with a field per replica
needs per-field TTLs (HPEXPIRE, Redis >= 7.4 only) or a reader-side clock that would trust every host's
clock; the script works on any Redis >= 2.6, keeps the expiry in Redis's own key TTL, reads one
consistent set of rows and costs one network round trip per refresh. (It names the other rows' keys
itself, so it needs one Redis, or Sentinel, not Redis Cluster.)

Why the entries: the fleet's queued prefill on a backend is the newest K ledger entries over every replica
(K its live requests), which the sum of each replica's own estimate is not (requests finish out of order:
proxy/core/work_ledger.py); summing them cost R = 4 +11% TTFT mean against one process in the replay, the
entries at 20 ms +0-2% (loadtest/results/scaleout.md, Round 4). Why 10 ms: at 50 ms the entries' ages
and the others' live counts are too coarse (+7-11%), and at 20 ms R = 4 hosts of --workers 2 still miss
by +8% on one multi-turn seed (Round 5). Its cost (`loadtest/bench_peer_load.py`, a real redis-server, 8
processes x 16 backends, full rows of 64 entries a backend, a busy 2-core machine; Round 5b): per
exchange ~1.6 ms of a worker's CPU and ~0.125 ms of Redis's, so at 10 ms ~16% / ~10% of a core (round 5's
JSON rows, sorted at every refresh: ~2.9 / ~0.165 ms). Rows are packed (`encode_row_packed`, a few
`struct` calls to read one; JSON rows of a previous version are still read, and while any is seen this
replica publishes JSON too, so that both versions read each other during a rolling upgrade); the rest of
an exchange is mostly redis-py and asyncio.

The rows are summed into a fresh dict swapped in whole (the entries of every row kept as one part each,
`PeerRecent`: nothing is sorted per refresh, a pick bisects them): `peers()` (the policy's input, called on every
pick) only reads an attribute, the data plane never awaits Redis. While Redis does not answer, the last
view is used until it is older than the TTL; then `peers()` returns None and the policy falls back to the
engines' counts (`routing.shared_backends`, if on) until Redis is back. Failures are counted
(affinity_proxy_peer_load_errors), the state is a gauge (affinity_proxy_peer_load_up) and logged once
per change of state and at most every 30 s while it lasts.

With --workers N, the workers of one host already share their in-flight counts and queued prefill through
shared memory (proxy/multiproc/shared_load.py): each worker's in-flight table reads the sum over every
worker. But each worker's work ledger holds only the entries of the requests IT routed, and the fleet's
newest K needs every entry. So each worker publishes its OWN part under its own id,
`<host id>/<worker index>` (the host id: replica_id, or hostname:<supervisor pid>): its own row of the
shared table (requests, tokens), its own estimate and its own newest entries; to the other hosts a host
of W workers is W replicas (each request counted once, by the worker that routed it). Its host-mates it
does not read from Redis (the exchange skips ids `<host id>/...`, and `host_view` keeps the view
non-empty): their counts and newest entries are in the host's shared block too (proxy/core/inflight.py
`mates`, `mates_recent`), read at each pick, both of the same moment (round 4b: the host-wide instant
counts with the mates' *published* entries, counts newer than entries, cost R = 2 x W = 2 +19% TTFT mean;
round 4b's mates' rows from Redis lagged a refresh and, when a mate's exchange failed, dropped its
requests after the TTL). The host-wide table stays what the workers route on while Redis is not
answering. Measured in the replay (loadtest/results/scaleout.md, Rounds 4b and 5).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import struct
import time
from array import array
from dataclasses import dataclass
from itertools import accumulate, chain
from operator import itemgetter
from typing import Annotated, Any, Callable, Iterable, Mapping, Sequence

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from proxy.core.affinity import PeerEntry
from proxy.core.decision import Inflight
from proxy.core.inflight import SharedInflightTable
from proxy.core.work_ledger import EntryColumns, PeerRecent, RecentEntry, WorkLedger
from proxy.core.routing_config import PeerLoadConfig

log = logging.getLogger("affinity_proxy.peer_load")

# Per backend: (in-flight requests, in-flight tokens, queued uncached prefill tokens), optionally with
# this replica's newest work-ledger entries as (age in refresh epochs, tokens), newest first.
Load = Mapping[str, PeerEntry]
# The most ledger entries per backend a row carries (the fleet's newest K rarely needs more of one replica's).
PEER_RECENT_MAX = 64

# KEYS[1]: the set of replica ids, KEYS[2]: this replica's row. ARGV: this replica's id, its row (JSON),
# the TTL in ms, the prefix of a row's key, the prefix of its host-mates' ids ("<host>/" for a --workers
# worker, whose mates it reads from shared memory; "" for none). Returns the other live replicas' rows.
_EXCHANGE = """
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
local out = {}
local mates = ARGV[5]
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if id ~= ARGV[1] and (mates == '' or string.sub(id, 1, #mates) ~= mates) then
    local row = redis.call('GET', ARGV[4] .. id)
    if row then out[#out + 1] = row else redis.call('SREM', KEYS[1], id) end
  end
end
return out
"""

_LOG_EVERY_S = 30.0
_AGE = itemgetter(0)
_TOK = itemgetter(1)


def default_replica_id(host_shared: bool) -> str:
    """hostname:pid; a --workers worker (`host_shared`: its table is the host's shared one) names its
    supervisor: the host's id, which its worker index follows (`PeerLoadExchange.replica_id`)."""
    pid = os.getppid() if host_shared else os.getpid()
    return f"{socket.gethostname()}:{pid}"


def worker_replica_id(host: str, worker: int | None) -> str:
    """The id a process publishes under: the host's id, and for a --workers worker `/<its index>`."""
    return host if worker is None else f"{host}/{worker}"


def own_load(work: WorkLedger, inflight: Mapping[str, Inflight], names: Iterable[str],
             seen: Load | None) -> dict[str, PeerEntry]:
    """This process's row, per backend: in-flight requests, in-flight tokens, the work ledger's queued
    prefill and its newest ledger entries as (age in refresh epochs, tokens), as many as the fleet's newest
    K could use (its own live count plus the others' as last `seen`, at most PEER_RECENT_MAX); the
    ledger's epoch is ticked first (one call per refresh). A --workers worker (a shared in-flight table)
    publishes its own part of the host: its own row's requests and tokens, its own ledger's estimate for
    them and its own entries, as a replica of its own would."""
    work.tick()
    host = inflight if isinstance(inflight, SharedInflightTable) else None
    if host is not None:
        host.tick()  # the epoch of its entries in the shared block, which its host-mates read
    out: dict[str, PeerEntry] = {}
    for name in names:
        own = host.own(name) if host is not None else inflight.get(name)
        row = (0, 0, 0.0) if own is None else (own.requests, own.tokens, work.pending(name, own))
        peer = seen.get(name) if seen else None
        # The fleet's live count: its own, the other hosts' as last seen, and its host-mates' now.
        n = min(PEER_RECENT_MAX, row[0] + (peer[0] if peer is not None else 0)
                + (host.mates(name)[0] if host is not None else 0))
        out[name] = (*row, work.recent(name, n))
    return out


def host_view(others: Load, own: Load) -> dict[str, PeerEntry]:
    """What a --workers worker's policy reads: the other hosts' merged rows, and for each backend of its
    own row that none of them published an empty entry, so that a fresh view is never empty (an empty
    one reads as "no view": the worker would route on the host-wide sums, not its mates' entries)."""
    view = dict(others)
    for name in own:
        view.setdefault(name, (0, 0, 0.0, ()))
    return view


def encode_row(load: Load) -> str:
    """A row as published (JSON: backend -> [requests, tokens, queued] or [..., [[age, tokens], ...]];
    msgspec writes tuples as arrays, the same JSON as json.dumps at a fraction of its CPU)."""
    return _ENCODER.encode(load).decode()


_ENCODER = msgspec.json.Encoder()
_Count = Annotated[int, msgspec.Meta(ge=0)]
_Tokens = Annotated[float, msgspec.Meta(ge=0)]  # JSON has no NaN or infinity: msgspec refuses them
# A row as this version publishes it (every backend with its entries): decoded and checked in C. Any
# other row (an older replica's sums, anything malformed) takes `parse_row`'s slower path, which keeps
# the well-formed backends of a row. Per row of 16 backends x 64 entries: ~0.05 ms against ~0.35 ms.
_FULL_ROW = msgspec.json.Decoder(dict[str, tuple[_Count, _Count, _Tokens, Annotated[
    list[tuple[_Count, _Tokens]], msgspec.Meta(max_length=PEER_RECENT_MAX)]]])


# A row packed (round 5b; the JSON rows of round 5 and before are still read, and written while any
# replica publishing them is seen, `PeerLoadExchange`): little-endian, the magic, then the number of
# backends B, of entries E and the flags (1: tokens as float32, when every one of the row's is exactly
# one), B name lengths (uint16), the names (UTF-8), B requests and B tokens (int64), B queued (float64),
# B entry counts (uint32; _NO_ENTRIES: a backend without entries, the sums only), then every backend's
# entries: E ages (uint32, ascending within a backend: not checked, a row out of order gives a wrong
# estimate, never an error) and E tokens. A reader turns it into columns with a few C calls, no Python
# object per entry. A round-5 reader takes it for malformed JSON (its first
# byte is not UTF-8) and skips it, without an error.
PACKED_MAGIC = b"\xffPL2"
_HEAD = struct.Struct("<4sIIB")
_NO_ENTRIES = 0xFFFFFFFF
_F32 = 1
_NAMES: dict[bytes, list[str]] = {}  # a packed row's block of names -> the names (read-only once in)


def encode_row_packed(load: Load) -> bytes:
    """A row as this version publishes it (see PACKED_MAGIC)."""
    names = [n.encode("utf-8", "surrogatepass") for n in load]
    values = list(load.values())
    recents = [v[3] if len(v) > 3 else None for v in values]
    counts = [_NO_ENTRIES if r is None else len(r) for r in recents]
    flat = list(chain.from_iterable(r for r in recents if r))
    ages = list(map(_AGE, flat))
    toks = list(map(_TOK, flat))
    b, e = len(names), len(flat)
    narrow = array("f", toks)
    f32 = narrow.tolist() == toks
    out = [_HEAD.pack(PACKED_MAGIC, b, e, _F32 if f32 else 0), struct.pack(f"<{b}H", *map(len, names)), *names,
           struct.pack(f"<{b}q{b}q{b}d{b}I", *(v[0] for v in values), *(v[1] for v in values),
                       *(float(v[2]) for v in values), *counts),
           struct.pack(f"<{e}I", *ages), struct.pack(f"<{e}{'f' if f32 else 'd'}", *toks)]
    return b"".join(out)


def parse_packed(raw: bytes) -> dict[str, PeerEntry] | None:
    """A packed row (PACKED_MAGIC) as load, or None if it is malformed in any way (the whole row: only
    this version writes them)."""
    try:
        magic, b, e, flags = _HEAD.unpack_from(raw, 0)
        if magic != PACKED_MAGIC:
            return None
        at = _HEAD.size
        lens = struct.unpack_from(f"<{b}H", raw, at)
        at += 2 * b
        size = sum(lens)
        block = raw[at:at + size]
        names = _NAMES.get(block)  # a replica publishes the same names at every refresh
        if names is None:
            names = []
            o = 0
            for n in lens:
                names.append(block[o:o + n].decode("utf-8", "surrogatepass"))
                o += n
            if o != len(block):
                return None
            if len(_NAMES) >= 256:
                _NAMES.clear()
            _NAMES[block] = names
        at += size
        sums = struct.unpack_from(f"<{b}q{b}q{b}d{b}I", raw, at)
        at += 28 * b
        tok_fmt = "f" if flags & _F32 else "d"
        ages = struct.unpack_from(f"<{e}I", raw, at)
        at += 4 * e
        toks = struct.unpack_from(f"<{e}{tok_fmt}", raw, at)
        at += (4 if flags & _F32 else 8) * e
    except (struct.error, UnicodeDecodeError):
        return None
    if at != len(raw) or len(set(names)) != b:
        return None
    reqs, tokens, queued, counts = sums[:b], sums[b:2 * b], sums[2 * b:3 * b], sums[3 * b:]
    if b and (min(reqs) < 0 or min(tokens) < 0 or not _finite_non_negative(queued)):
        return None
    if e and not _finite_non_negative(toks):
        return None
    cum = list(accumulate(toks, initial=0.0))  # the running sums the picks read (one pass for the row)
    out: dict[str, PeerEntry] = {}
    o = 0
    for name, req, tok, q, n in zip(names, reqs, tokens, queued, counts):
        if n == _NO_ENTRIES:
            out[name] = (req, tok, q)
            continue
        if n > PEER_RECENT_MAX:
            return None
        out[name] = (req, tok, q, EntryColumns(ages, toks, cum, o, n))
        o += n
    return out if o == e else None


def _finite_non_negative(values: Sequence[float]) -> bool:
    try:
        return min(values) >= 0.0 and math.isfinite(math.fsum(values))  # a NaN or an infinity: not finite
    except (OverflowError, ValueError):
        return False


def _recent(raw: Any) -> list[RecentEntry] | None:
    """A row's published ledger entries ([[age, tokens], ...]), or None if malformed."""
    if not isinstance(raw, list) or len(raw) > PEER_RECENT_MAX:
        return None
    out: list[RecentEntry] = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2):
            return None
        age, tok = item
        if not (isinstance(age, int) and isinstance(tok, (int, float))) or isinstance(age, bool):
            return None
        if age < 0 or not math.isfinite(tok) or tok < 0:
            return None
        out.append((age, float(tok)))
    return out


def parse_row(raw: Any) -> dict[str, PeerEntry] | None:
    """One published row as load: packed (PACKED_MAGIC, this version's), or JSON (backend -> [requests,
    tokens, queued] or [requests, tokens, queued, [[age, tokens], ...]], round 5's and before: a replica
    of a previous version, during a rolling upgrade); None if it is neither; a malformed backend entry of
    a JSON row is dropped (raises nothing: it comes from the network)."""
    if isinstance(raw, (bytes, bytearray)) and raw[:4] == PACKED_MAGIC:
        return parse_packed(bytes(raw))
    try:
        return _FULL_ROW.decode(raw)  # type: ignore[return-value]  # the entries as a list: a Sequence
    except (msgspec.DecodeError, UnicodeDecodeError, TypeError):  # ValidationError is a DecodeError
        pass
    try:
        row = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(row, dict):
        return None
    out: dict[str, PeerEntry] = {}
    for name, entry in row.items():
        if not (isinstance(entry, list) and len(entry) in (3, 4)):
            continue
        req, tok, queued = entry[:3]
        if not (isinstance(req, int) and isinstance(tok, int) and isinstance(queued, (int, float))):
            continue
        if req < 0 or tok < 0 or not math.isfinite(queued) or queued < 0:
            continue
        if len(entry) == 3:
            out[name] = (req, tok, float(queued))
            continue
        entries = _recent(entry[3])
        if entries is not None:
            out[name] = (req, tok, float(queued), entries)
    return out


def merge_loads(loads: Iterable[Load]) -> dict[str, PeerEntry]:
    """The sum, per backend, of the loads other replicas published, with the entries of every one put
    together (a `PeerRecent`: as a sequence their merge by age, stable, each load's order kept among
    equal ages; a pick bisects each load's entries instead, nothing is sorted here); a backend some load
    published without entries gets the sums only (the estimate from entries needs every replica's)."""
    out: dict[str, tuple[int, int, float]] = {}
    recent: dict[str, list[Sequence[RecentEntry]] | None] = {}
    for load in loads:
        for name, entry in load.items():
            sums = out.get(name)
            if sums is None:
                out[name] = (entry[0], entry[1], entry[2])
                recent[name] = [entry[3]] if len(entry) > 3 else None
                continue
            out[name] = (sums[0] + entry[0], sums[1] + entry[1], sums[2] + entry[2])
            so_far = recent[name]
            if len(entry) < 4:
                recent[name] = None
            elif so_far is not None:
                so_far.append(entry[3])
    merged: dict[str, PeerEntry] = {}
    for name, sums in out.items():
        parts = recent[name]
        merged[name] = sums if parts is None else (*sums, PeerRecent(parts))
    return merged


def merge_rows(rows: Iterable[Any]) -> dict[str, PeerEntry]:
    """`merge_loads` of published rows (JSON, `parse_row`): a malformed row or entry is skipped."""
    return merge_loads([x for r in rows if (x := parse_row(r)) is not None])


@dataclass
class _Metrics:
    errors: Counter
    up: Gauge
    peers: Gauge

    @classmethod
    def build(cls, registry: CollectorRegistry | None) -> "_Metrics":
        reg = registry if registry is not None else CollectorRegistry()
        return cls(
            errors=Counter("affinity_proxy_peer_load_errors",
                           "Round trips to Redis for the peer load (routing.peer_load) that failed.", registry=reg),
            up=Gauge("affinity_proxy_peer_load_up",
                     "1 while the other replicas' load from Redis is fresh (routing.peer_load), else 0.",
                     registry=reg),
            peers=Gauge("affinity_proxy_peer_load_replicas",
                        "Other proxy replicas (or --workers workers) whose rows the last exchange with Redis returned.", registry=reg),
        )


class PeerLoadExchange:
    """Publishes this process's load to Redis and reads the other replicas' (a Service: start/stop).

    `load()`: this process's per-backend (requests, tokens, queued prefill), read on the event loop once
    per refresh. `peers()`: the others' summed load, or None when off or not fresh (the policy's `peers`)."""

    def __init__(self, cfg: PeerLoadConfig, load: Callable[[], Load], *, worker: int | None = None,
                 registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._cfg = cfg
        self._load = load
        self._worker = worker  # a --workers worker's index (its row of the host's shared table), else None
        self._clock = clock
        self._metrics = _Metrics.build(registry)
        self._view: Load | None = None
        self._fresh_until = -math.inf
        self._task: asyncio.Task[None] | None = None
        self._restart: asyncio.Task[None] | None = None
        self._started = False
        self._ok: bool | None = None  # state of the last exchange (None: none yet), for the log lines
        self._last_log = -math.inf
        self.replica_id = self._replica_id(cfg)

    def _replica_id(self, cfg: PeerLoadConfig) -> str:
        host = cfg.replica_id if cfg.replica_id is not None else default_replica_id(self._worker is not None)
        return worker_replica_id(host, self._worker)


    @property
    def config(self) -> PeerLoadConfig:
        return self._cfg

    # ------------------------------------------------------------------------------------ data plane

    def peers(self) -> Load | None:
        """The other replicas' load as last read, while it is fresh (younger than the TTL); else None."""
        view = self._view
        if view is None or self._clock() > self._fresh_until:
            return None
        return view

    # ------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._started = True
        if self._cfg.enabled and self._task is None:
            self._task = asyncio.create_task(self._run(self._cfg, self.replica_id), name="peer-load")

    async def stop(self) -> None:
        self._started = False
        if self._restart is not None:
            await asyncio.gather(self._restart, return_exceptions=True)
            self._restart = None
        await self._stop_loop()

    def reload(self, cfg: PeerLoadConfig) -> None:
        """Follow a reload: keep running on an unchanged section, else restart on the new one (off: stop)."""
        if cfg == self._cfg:
            return
        self._cfg = cfg
        if not self._started:
            self.replica_id = self._replica_id(cfg)
            return
        previous = self._restart

        async def restart() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            await self._stop_loop()
            cfg_now = self._cfg
            self.replica_id = self._replica_id(cfg_now)
            if self._started and cfg_now.enabled:
                self._task = asyncio.create_task(self._run(cfg_now, self.replica_id), name="peer-load")

        self._restart = asyncio.ensure_future(restart())

    async def _stop_loop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # Python < 3.12's asyncio.wait_for can swallow a cancellation that arrives as its inner call
            # completes (the loop then runs on): cancel again until the task has ended. Seen with 8
            # exchanges on a busy machine (loadtest/bench_peer_load.py), where stop() hung for good.
            while not (await asyncio.wait({task}, timeout=0.5))[0]:
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._view = None
        self._fresh_until = -math.inf
        self._metrics.up.set(0)
        self._metrics.peers.set(0)

    # ------------------------------------------------------------------------------------ the loop

    async def _run(self, cfg: PeerLoadConfig, replica_id: str) -> None:
        import redis.asyncio as aioredis  # optional dependency: imported only when routing.peer_load is on

        ttl_ms = cfg.ttl_ms
        timeout = ttl_ms / 1000.0
        client = aioredis.from_url(cfg.redis_url or "", socket_timeout=timeout, socket_connect_timeout=timeout)
        exchange = client.register_script(_EXCHANGE)
        row_prefix = f"{cfg.key_prefix}:replica:"
        keys = [f"{cfg.key_prefix}:replicas", row_prefix + replica_id]
        mates = replica_id.rpartition("/")[0] + "/" if self._worker is not None else ""
        period = cfg.refresh_ms / 1000.0
        legacy = False  # a replica of a previous version is publishing JSON rows: publish JSON too
        try:
            while True:
                began = self._clock()
                try:
                    load = self._load()
                    row: bytes | str = encode_row(load) if legacy else encode_row_packed(load)
                    rows = await asyncio.wait_for(
                        exchange(keys=keys, args=[replica_id, row, ttl_ms, row_prefix, mates]), timeout)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - any failure of the optional component: fall back
                    self._failed(cfg, exc)
                else:
                    rows = list(rows)
                    legacy = not all(isinstance(r, bytes) and r[:4] == PACKED_MAGIC for r in rows)
                    merged = merge_rows(rows)
                    self._view = host_view(merged, load) if self._worker is not None else merged
                    self._fresh_until = self._clock() + timeout
                    self._metrics.peers.set(len(rows))
                    self._succeeded(cfg)
                await asyncio.sleep(max(0.0, period - (self._clock() - began)))
        finally:
            try:  # leave at once rather than after the TTL
                await asyncio.wait_for(client.delete(keys[1]), timeout)
            except BaseException:  # noqa: BLE001 - best effort while stopping; the TTL removes it anyway
                pass
            await client.aclose()

    def _failed(self, cfg: PeerLoadConfig, exc: BaseException) -> None:
        self._metrics.errors.inc()
        if self._clock() > self._fresh_until:
            self._metrics.up.set(0)
        now = self._clock()
        if self._ok is not False or now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            log.warning("peer load: the exchange with Redis at %s failed (%s: %s); routing on this replica's "
                        "own load once the last view is older than %d ms", cfg.redis_url, type(exc).__name__, exc,
                        cfg.ttl_ms)
        self._ok = False

    def _succeeded(self, cfg: PeerLoadConfig) -> None:
        self._metrics.up.set(1)
        if self._ok is not True:
            log.info("peer load: exchanging load through Redis at %s as replica %r", cfg.redis_url,
                     self.replica_id)
        self._ok = True
