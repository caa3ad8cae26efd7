"""The affinity policy: send a prompt where its KV cache lives, unless that GPU is overloaded.

One decision, in order:

1. **Session** — with `session_affinity` on and a session key on the request, the key is placed by
   rendezvous hashing (reason SESSION); the learned indexes are not consulted.
1b. **KV hit** (only with a `precise` lookup, i.e. `telemetry.kv_events`) — the backend whose engine
   reports (KV-cache events, `proxy/core/kv_index.py`) the longest cached prefix of the prompt, if it is
   long enough by the same rule as a prefix hit (step 3, in tokens); reason PREFIX_HIT. Only backends whose
   event stream is fresh answer; with no such hit the learned steps below decide as before.
2. **Exact hit** — the request's exact fingerprint was routed recently: its backend (EXACT_HIT).
3. **Prefix hit** — the backend whose prefix index holds the longest run of the prompt's leading block
   hashes, if the run is long enough: at least `min_prefix_blocks`, and covering the first user turn (chat)
   or `min_prefix_ratio` of the prompt (other prompts), so that a merely shared system prompt does not pull
   every request to one GPU. Ties go to the backend ranked higher for this prompt by rendezvous hashing.
4. **Hash** — otherwise the top backend in the rendezvous ranking of the prompt's distinguishing prefix.

A request with no prompt at all (and no session) skips all four: it is placed by least request (BALANCED).

Then the **bounded-load rule** (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads")
on that primary choice: it must be routable and not excluded (else UNHEALTHY_FALLBACK), not saturated
(its `max_inflight` reached or telemetry score >= `saturation`), and within the bounds: its fresh
telemetry score <= (1+ε) · fleet mean + `overload_margin`, and its in-flight requests + 1 <=
ceil((1+ε_r) · (fleet in-flight + 1) · weight/total weight), ε_r = `request_epsilon` (else
OVERLOAD_FALLBACK). The request cap is the hard guarantee; it is looser than ε (default 1.5 vs 0.25)
because at a few requests in flight per GPU a tight cap sheds most reuses off their cache (measured: at
ε_r = 0.25, 27% of decisions on the Mooncake sample), and the cost check below balances the work finely.

Then the **cost check** (`cost_aware`): request counts cannot see that one request is a 90k-token document
and the next a 500-token chat turn, and a request's time to first token is the prefill queued ahead of it
plus its own uncached prefill. A backend's cost for this request is the uncached prompt tokens of what this
policy sent it that are still in flight (`WorkLedger`) plus `uncached_weight` (by default 3, or 2 against the
queued prefill the engines' KV events bound, see `routing_config`) x the prompt tokens it does
not hold (from its prefix index) plus `adapter_miss_tokens` when its fresh telemetry does not list the
request's LoRA adapter, per unit of weight. An admissible primary is kept unless another admissible
backend costs less than (cost - `cost_slack_tokens`) / (1 + `cost_epsilon`), or, when the primary holds
none of the prompt, less than cost - `new_prompt_slack_tokens`: a near-equal fleet keeps the deterministic
placement, a GPU with a long prefill queued sheds new work (OVERLOAD_FALLBACK). In that new-prompt
comparison, when nothing is in flight anywhere (an idle fleet), a chat prompt's match that reaches no block wholly
past its system messages (only the shared system prompt) is costed as no match (a match reaching into the
user's own text, e.g. a per-user preamble, still counts): the home lacks it only until this request
has run there, and counting it sent every new conversation to the first GPU that saw the system prompt,
since in an idle fleet no queue pushes back (20 prompts with a 600-word system prompt, sent one at a time,
all went to one backend). Under load the
holder's queued work pushes back, and following it was measured better, so there the match counts. A
primary that fails the bound goes to the cheapest admissible backend (ties in rendezvous order); if none
is admissible, to the least-loaded eligible backend. (Measured with loadtest.replay on the Mooncake
sample, 4 backends, ~75% busy: see loadtest/results/affinity-tuning.md.)
Since some backend is always at or below its fair in-flight share, the in-flight bound is always
satisfiable: no backend ever receives work beyond ceil((1+ε_r)·mean).

**Determinism and what is learned.** Rendezvous hashing (xxh3 of the key with a per-backend seed derived
from the backend's *name*, weighted by -w/ln(u)) is a pure function of (config, backend set, prompt): the
same in every worker process and every replica, with no per-process salt, and removing or adding one of N
backends moves only the keys whose top-ranked backend changed, ~1/N of them. The ranking is over all
configured backends serving the model, healthy or not, so a health flap moves only the keys of the backend
that flapped (to their next-ranked backend) and they come back when it recovers.
The exact and prefix indexes and the work ledger are learned, per process: the indexes only ever point a
prompt at a backend that recently received it (or its prefix), and on a fresh process with a near-equal
fleet a prompt lands on its hash home. Two workers therefore agree on every prompt placed by hashing, and
on repeats of it; they can differ only after a fallback (bounded load or cost check, which read the live
in-flight work) or a prefix hit one of them saw and the other did not. The exact index follows the KV: a
first sighting records the backend it was actually sent to (its hash home, or wherever the bound or the
cost check placed it, since that is where the engine computed its KV), so its repeats go there. A repeat
shed off an overloaded holder does not move the entry, so keys shed by an overloaded backend return to it
as soon as it recovers. (Recording the hash home instead, as before issue 13, sent 13 of 20 repeats away
from the backend holding their KV after a cost-check placement.)
**Scale-out (issue 13).** Learned state is per process, so R replicas (or W workers) each learn ~1/R of
the history; with `precise` (a view fed by the engines' own KV events, `proxy/core/kv_index.py`) every
process reads the same caches: for each backend that view covers, the share of the prompt it holds replaces
the learned index's guess, in the prefix step and in the cost check (backends without fresh events keep the
learned index). The load side is per process too: with `routing.shared_backends` the bound and the cost
check read, per backend, the engine's own running + waiting from its last fresh scrape moved by this
process's own sends and completions since that scrape, never below its own in-flight count (the requests
it did not send are taken to be like those it sent there recently). That was the best of the estimates
measured (R x own, with and without the engines' counts, the engines' KV usage; doing nothing) with
precise events, and harmful with learned indexes: loadtest/results/scaleout.md. What no estimate from
the engines' counts gives is the size of the other replicas' newest requests: the optional `peers` input
(a shared ledger: the other replicas' published in-flight requests, tokens and queued prefill, and their
newest ledger entries, from which the fleet's queued prefill is read as one process would: `_with_peers`)
adds them, and the engines' counts are its fallback while it is unavailable.
Learned state deliberately outlives a change of the backend set: after a backend is added, prompts already
cached somewhere keep going there (their KV is there) and the newcomer gets its ~1/N share of new prompts;
a removed backend's entries are dropped at once. The 1/N movement guarantee is a property of the hashing
layer (tested with fresh policies); the learned layer only ever moves fewer keys.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, ClassVar, Mapping, Optional, Sequence, Union

import xxhash

from proxy.core.decision import Decision, Inflight, NoBackendAvailable, Reason
from proxy.core.fingerprint import Fingerprinter
from proxy.core.inflight import SharedInflight, SharedInflightTable
from proxy.core.kv_index import PreciseMatch
from proxy.core.load import effective_load, assumed_score, telemetry_score
from proxy.core.placement import place_new
from proxy.core.eligibility import eligible
from proxy.core.policies import LeastRequest
from proxy.core.prefix_index import GenerationalMap, PrefixIndex, holding
from proxy.core.request import BYTES_PER_TOKEN_ESTIMATE, RequestSummary
from proxy.core.routing_config import RoutingConfig
from proxy.core.snapshot import BackendSpec, BackendState, Snapshot
from proxy.core.work_ledger import RecentEntry, WorkLedger

_xxh3 = xxhash.xxh3_64_intdigest
_SESSION_DOMAIN = b"affinity-proxy/session/v1\xff"
_BACKEND_DOMAIN = b"affinity-proxy/backend/v1\xff"
_TWO_POW_M64 = 2.0**-64
_NO_INFLIGHT = Inflight()

# What the engines' KV events say about a request (None: no answer, e.g. not tokenised yet).
PreciseLookup = Callable[[RequestSummary], Optional[PreciseMatch]]
# The other proxy replicas' load as they last published it (an optional shared ledger): per backend, their
# in-flight requests, in-flight tokens and queued uncached prefill tokens, and optionally (a 4th element)
# their newest work-ledger entries as (age in refresh epochs, tokens), newest first per replica, from which
# the fleet's queued prefill is estimated as one process would (`WorkLedger.fleet_pending`). Empty or
# None: not known now.
PeerEntry = Union[tuple[int, int, float], tuple[int, int, float, Sequence[RecentEntry]]]
PeerLoad = Callable[[], Optional[Mapping[str, PeerEntry]]]


@functools.lru_cache(maxsize=4096)
def backend_seed(name: str) -> int:
    """The rendezvous seed of a backend: a function of its name only, identical in every process."""
    return _xxh3(_BACKEND_DOMAIN + name.encode("utf-8", "surrogatepass"))


class _Ring:
    """Rendezvous candidates for one (snapshot, model): backends with weight > 0 serving the model.

    Built once per snapshot (5 times a second with telemetry), so that the per-request work is the
    rendezvous scores plus the in-flight sum, not attribute lookups on every BackendState.
    """

    __slots__ = ("names", "seeds", "weights", "uniform", "members", "info", "routable", "routable_w",
                 "score_sum", "score_n", "indexes", "adapters", "queued")

    def __init__(self, states: list[BackendState]) -> None:
        self.names = [s.name for s in states]
        self.seeds = [backend_seed(s.name) for s in states]
        self.weights = [s.effective_weight for s in states]
        self.uniform = len(set(self.weights)) <= 1
        self.members = frozenset(self.names)
        # name -> (routable, weight, fresh telemetry score or None, max_inflight)
        self.info = {
            s.name: (s.routable, s.effective_weight, telemetry_score(s), s.spec.max_inflight) for s in states
        }
        self.routable = [s.name for s in states if s.routable]
        self.routable_w = sum(s.effective_weight for s in states if s.routable)
        fresh = [x for s in states if s.routable and (x := telemetry_score(s)) is not None]
        self.score_sum = sum(fresh)
        self.score_n = len(fresh)
        self.indexes: list[PrefixIndex] | None = None  # filled by the policy that owns the indexes
        # name -> requests the engine itself reports running + waiting (fresh telemetry only): what every
        # replica sees alike, the load of the other replicas included
        # (and the scrape's time, to count this process's own sends and completions since it)
        self.queued = {
            s.name: (s.signals.running + (s.signals.waiting or 0.0), s.signals.scraped_at)
            for s in states
            if s.signals is not None and s.signals.running is not None and telemetry_score(s) is not None
        }
        # name -> LoRA adapters it has loaded (absent: unknown): declared in the config (then known for every
        # backend: those declaring none have none) or reported by its fresh telemetry.
        declared = any(s.spec.adapters for s in states)
        self.adapters = {
            s.name: s.adapters
            for s in states
            if declared or (s.signals is not None and telemetry_score(s) is not None)
        }

    def scores(self, key: int) -> list[float]:
        """Higher is better. Weighted: w / -ln(u) gives backend i a share w_i / sum(w) of the keys."""
        kb = key.to_bytes(8, "little")
        if self.uniform:
            # As floats: the scores are a list[float] everywhere they are read. (Kept as the raw 64-bit ints,
            # compiled code (proxy/native) compared them as doubles and `_argmax`'s index() of the double
            # max found no int equal to it; only two hashes within 2**11 of each other could rank otherwise.)
            return [float(_xxh3(kb, s)) for s in self.seeds]
        log = math.log
        return [w / -log((_xxh3(kb, s) + 0.5) * _TWO_POW_M64) for s, w in zip(self.seeds, self.weights)]


def _argmax(scores: list[float]) -> int:
    """The index of the best rendezvous score, the first of equals (the head of a stable descending sort)."""
    return scores.index(max(scores))


def _best_holder(found: PreciseMatch) -> tuple[str | None, int]:
    """(the backend whose engine holds the most of the prompt, its tokens): the decision's kv_holder and
    kv_cached. (None, 0) when no engine holds any of it; ties go to the first name in sort order."""
    best, tokens = None, 0
    for name, t in found.cached.items():
        if t > tokens or (t == tokens and t > 0 and best is not None and name < best):
            best, tokens = name, t
    return best, tokens


def rendezvous_order(names: list[str], weights: list[float], key: int) -> list[str]:
    """Every backend in rendezvous order for `key` (used by tests and tools; the policy ranks lazily)."""
    ring = _Ring([BackendState(spec=BackendSpec(n, "", w)) for n, w in zip(names, weights)])
    scores = ring.scores(key)
    return [names[i] for i in sorted(range(len(names)), key=lambda i: scores[i], reverse=True)]


def _admits(entry: tuple[bool, float, float | None, int | None], requests: int, share: float, score_limit: float,
            saturation: float) -> bool:
    """The bounded-load rule for one backend (routable and not excluded is the caller's check): below its
    own in-flight limit and the saturation score, its fresh score within the fleet's limit, and its
    in-flight requests + 1 within ceil(share · weight)."""
    _, w, s, mx = entry
    if mx is not None and requests >= mx:
        return False
    if s is not None and (s >= saturation or s > score_limit):
        return False
    return requests + 1 <= math.ceil(share * w - 1e-9)


def _adapter_cost(miss: float, loaded: Mapping[str, frozenset[str]], adapter: str | None, name: str) -> float:
    """The shared LoRA pool: a backend whose fresh telemetry does not list the request's adapter as loaded
    must load it first (`miss` tokens of prefill it is worth; 0: no adapter); unknown telemetry, no penalty."""
    if not miss:
        return 0.0
    have = loaded.get(name)
    return miss if have is not None and adapter not in have else 0.0


class _Bound:
    """One pick's bounded-load figures, for the search over the other backends (`_cheapest`)."""

    __slots__ = ("exclude", "inflight", "share", "score_limit", "saturation", "miss", "loaded", "adapter")

    def __init__(self, exclude: frozenset[str], inflight: Mapping[str, Inflight], share: float,
                 score_limit: float, saturation: float, miss: float, loaded: Mapping[str, frozenset[str]],
                 adapter: str | None) -> None:
        self.exclude = exclude
        self.inflight = inflight
        self.share = share  # (1 + ε_r) · (fleet in-flight + 1) / total weight
        self.score_limit = score_limit  # (1 + ε) · mean fresh score + overload_margin
        self.saturation = saturation
        self.miss = miss
        self.loaded = loaded
        self.adapter = adapter


class AffinityPolicy:
    name: ClassVar[str] = "affinity"

    def __init__(
        self,
        cfg: RoutingConfig = RoutingConfig(),
        *,
        precise: PreciseLookup | None = None,
        work: WorkLedger | None = None,
        peers: PeerLoad | None = None,
    ) -> None:
        """`precise`: the engines' own view of their KV caches (proxy/core/kv_index.py, fed by their KV
        events): per request, the tokens of its prompt each backend with a fresh event stream holds. It
        picks the primary (step 1b) and replaces the learned index's guess for those backends in the
        prefix step and the cost check; backends it leaves out use the learned index. `work`: the ledger
        of queued prefill, when several policies (workers of one host) share one. `peers`: the other
        replicas' published load (a shared ledger), added to this process's own while it answers; when
        it does not, `routing.shared_backends` (if on) estimates it from the engines' counts."""
        self._cfg = cfg
        self._precise = precise
        a = cfg.affinity
        self._a = a
        self._fp = Fingerprinter(a)
        self._exact: GenerationalMap[str] = GenerationalMap(a.exact_entries)
        self._indexes: dict[str, PrefixIndex] = {}
        self._snapshot: Snapshot | None = None
        self._rings: dict[str | None, _Ring] = {}
        self._bound_factor = 1.0 + a.epsilon
        self._request_factor = 1.0 + a.request_epsilon
        self._work = work if work is not None else WorkLedger()
        # The ledger's queued prefill at `running_weight` (with KV events; 1: the newest-k sum as before).
        weight = a.running_weight
        self._pending: Callable[[str, Inflight | None], float] = (
            self._work.pending if weight >= 1.0 else functools.partial(self._work.pending, weight=weight))
        # What an uncached token weighs against a queued one: `uncached_weight`, or by default 2 against
        # the backlog bound (a ledger following the engines' progress, weight < 1) and 3 against the sum.
        bounded = self._work.follows_progress and weight < 1.0
        self._uw = a.uncached_weight if a.uncached_weight is not None else (2.0 if bounded else 3.0)
        # Other replicas share the backends: read the engines' own counts when they see more (see below).
        self._shared_backends = cfg.shared_backends
        self._peers = peers
        # name -> (scraped_at of the engine counts last read, this process's in-flight count then)
        self._scrape_base: dict[str, tuple[float, int]] = {}
        self._cost_factor = 1.0 + a.cost_epsilon
        self._block_tokens = a.block_bytes / BYTES_PER_TOKEN_ESTIMATE
        # A request with no routable content (a GET, an unparsed path, an empty input) has no cache to
        # find: placed by load, never all on the hash home of the empty prompt.
        self._no_content = LeastRequest(cfg)
        self._decisions: dict[tuple[str, Reason, int, tuple[str | None, int | None]], Decision] = {}

    # ------------------------------------------------------------------------------------------ state

    def _sync(self, snapshot: Snapshot) -> None:
        """Follow a new snapshot: rings, per-backend indexes (created, resized to KV capacity, dropped)."""
        if snapshot is self._snapshot:
            return
        self._snapshot = snapshot
        self._rings = {}
        a = self._a
        indexes = self._indexes
        for b in snapshot.backends:
            idx = indexes.get(b.name)
            kv = b.signals.kv_capacity_tokens if b.signals is not None else None
            if kv:
                cap = int(kv * BYTES_PER_TOKEN_ESTIMATE / a.block_bytes * a.index_capacity_factor)
                cap = max(1, min(a.index_max_blocks, cap))
            elif idx is not None:
                continue  # telemetry gone quiet: keep the size it last reported rather than flap and drop
            else:
                cap = a.index_blocks
            if idx is None:
                indexes[b.name] = PrefixIndex(cap)
            else:
                idx.resize(cap)
        gone = [n for n in indexes if n not in snapshot]
        for name in gone:
            del indexes[name]
            self._exact.discard_value(name)
            self._work.discard(name)
            self._scrape_base.pop(name, None)

    def _ring(self, snapshot: Snapshot, model: str | None) -> _Ring:
        ring = self._rings.get(model)
        if ring is None:
            if len(self._rings) >= 1024:  # model names come from clients: keep the cache bounded
                self._rings.clear()
            ring = self._rings[model] = _Ring(
                [
                    b
                    for b in snapshot.backends
                    if b.effective_weight > 0 and b.serves(model)
                ]
            )
        return ring

    def _ring_indexes(self, ring: _Ring) -> list[PrefixIndex]:
        """The ring's prefix indexes in ring order (cached with the ring, i.e. per snapshot)."""
        if ring.indexes is None:
            ring.indexes = [self._indexes[n] for n in ring.names]
        return ring.indexes

    def index_of(self, backend: str) -> PrefixIndex | None:
        """The prefix index of one backend (for the admin API, tests and the benchmark)."""
        return self._indexes.get(backend)

    # ------------------------------------------------------------------------------------------- pick

    def pick(
        self,
        req: RequestSummary,
        snapshot: Snapshot,
        inflight: Mapping[str, Inflight],
        exclude: frozenset[str] = frozenset(),
    ) -> Decision:
        a = self._a
        session = req.session_key if a.session_affinity else None
        if not req.prompt and session is None:
            return Decision(self._no_content.pick(req, snapshot, inflight, exclude).backend, Reason.BALANCED,
                            self.name)
        if snapshot is not self._snapshot:
            self._sync(snapshot)
        ring = self._rings.get(req.model)
        if ring is None:
            ring = self._ring(snapshot, req.model)
        if not ring.names:
            eligible(req, snapshot, exclude)  # raises with the precise reason
        fp = self._fp
        data = req.prompt_bytes
        seed, key_seed = fp.seeds(req.model, req.adapter)
        # Whether the request's structure marks the distinguishing prefix (the hash key itself, a pass over
        # that prefix, is computed by the steps that read it: not for a session, nor a repeat kept home).
        cut = req.key_prefix_chars
        structured = cut is not None and 0 < cut <= len(req.prompt)
        fingerprint = 0  # the exact fingerprint (not computed for a session, which never records one)
        # Computed only by the steps that read them: the block chain (the one cost that grows with the
        # prompt: an exact hit never needs it unless it is shed) and the rendezvous scores of the hash key
        # (an exact hit kept on its holder never needs them).
        blocks: list[int] | None = None
        scores: list[float] | None = None
        matched = 0
        record_exact = True
        # The engines' own view (KV events), asked once; `held`: leading learned-size blocks each backend it
        # covers holds, computed from it when the block chain is.
        found: PreciseMatch | None = None
        held: dict[str, int] | None = None
        kv_view: tuple[str | None, int | None] = (None, None)  # the decision's (kv_holder, kv_cached)

        if session is not None:
            key = _xxh3(_SESSION_DOMAIN + session.encode("utf-8", "surrogatepass"))
            scores = ring.scores(key)
            primary = ring.names[_argmax(scores)]
            reason = Reason.SESSION
            record_exact = False
        else:
            fingerprint = fp.fingerprint(req, data)
            exact = self._exact.get(fingerprint)
            kv_hit = None
            keyed: tuple[int, int, bool] | None = None  # (hash key, its full blocks, structured)
            if self._precise is not None:
                found = self._precise(req)
                if found is not None:
                    # The engines' token count of this prompt: what the ledger's bound converts with.
                    self._work.calibrate(len(data) / BYTES_PER_TOKEN_ESTIMATE, found.prompt_tokens)
                    kv_view = _best_holder(found)
                    if not found.cached or found.prompt_tokens <= 0:
                        found = None
                if found is not None:
                    keyed = fp.hash_key(req, data, key_seed)
                    scores = ring.scores(keyed[0])
                    kv_hit = self._kv_hit(found, req, structured, len(data), ring, scores)
            if kv_hit is not None:
                primary, matched = kv_hit
                reason = Reason.PREFIX_HIT
            elif exact is not None and exact in ring.members:
                primary, reason = exact, Reason.EXACT_HIT
            else:
                if keyed is None:
                    keyed = fp.hash_key(req, data, key_seed)
                key_blocks = keyed[1]
                if scores is None:
                    scores = ring.scores(keyed[0])
                blocks = fp.chain(data, seed) if len(data) >= a.block_bytes else []  # (no full block: no chain)
                if found is not None:
                    held = self._held(found, ring, len(blocks))
                need = a.min_prefix_blocks
                if structured:
                    # The match must reach past the end of the first user turn, i.e. include the block
                    # holding its last byte: a run that stops inside the shared system prompt is no hit.
                    need = max(need, key_blocks + 1)
                else:
                    need = max(need, math.ceil(a.min_prefix_ratio * len(blocks)))
                best_i = -1
                if 0 < need <= len(blocks):
                    idxs = self._ring_indexes(ring)
                    best_m, best_s = need, -1.0
                    for i in holding(idxs, blocks[need - 1]):
                        if held is not None and ring.names[i] in held:
                            continue  # the engine's own view of this backend replaces the guess
                        # Only a longer match, or an equal one ranked higher, can win: one lookup
                        # rejects the rest (most backends share the system prompt and nothing more).
                        tie_ok = scores[i] > best_s
                        m = idxs[i].match(blocks, best_m if tie_ok else best_m + 1)
                        if m:
                            best_i, best_m, best_s = i, m, scores[i]
                    if held:
                        for i, name in enumerate(ring.names):
                            m = held.get(name, 0)
                            if m > best_m or (m == best_m and m >= need and scores[i] > best_s):
                                best_i, best_m, best_s = i, m, scores[i]
                    if best_i >= 0:
                        matched = best_m
                if best_i >= 0:
                    primary, reason = ring.names[best_i], Reason.PREFIX_HIT
                else:
                    primary = ring.names[_argmax(scores)]
                    reason = Reason.HASH

        prompt_tokens = len(data) / BYTES_PER_TOKEN_ESTIMATE
        reason_was_exact = reason is Reason.EXACT_HIT
        if reason_was_exact:
            matched = -1  # the whole prompt is cached there
        elif reason is not Reason.PREFIX_HIT:
            matched = -2  # not looked up yet
        chosen, reason, matched, blocks = self._bounded(
            primary, reason, matched, prompt_tokens, ring, scores, key_seed, snapshot, inflight, exclude, req,
            structured, data, seed, blocks, found, held,
        )
        self._work.record(chosen, self._uncached(prompt_tokens, matched), inflight)
        if record_exact:
            # The exact index follows the KV: a first sighting is computed where it goes (its hash home,
            # or wherever the bound or the cost check sent it), so that is where its repeats belong. A
            # repeat shed off an overloaded holder leaves the entry alone (only refreshing it), so the
            # key goes back to its holder as soon as that recovers.
            self._exact.put(fingerprint, primary if reason_was_exact else chosen)
        if reason is not Reason.EXACT_HIT:
            # An exact hit's chain was recorded when the prompt was first routed; any other decision
            # (fallbacks included: the KV is built where the request actually goes) teaches the index.
            if blocks is None:
                blocks = fp.chain(data, seed)
            idx = self._indexes.get(chosen)
            if idx is not None and blocks:
                idx.add(blocks)
        # Decisions are immutable values: one object per (backend, reason, match), bounded.
        matched = matched if matched > 0 else 0
        decision_key = (chosen, reason, matched, kv_view)
        decision = self._decisions.get(decision_key)
        if decision is None:
            if len(self._decisions) >= 4096:
                self._decisions.clear()
            decision = self._decisions[decision_key] = Decision(chosen, reason, self.name, matched, *kv_view)
        return decision

    @staticmethod
    def _held(found: PreciseMatch, ring: _Ring, n_blocks: int) -> dict[str, int]:
        """Per ring member the engines' view covers: the leading blocks (of the learned index's size) of
        the prompt its engine holds, the same share of the prompt as the tokens it holds."""
        total = found.prompt_tokens
        return {n: min(n_blocks, int(t * n_blocks / total)) for n, t in found.cached.items() if n in ring.members}

    def _kv_hit(
        self, found: PreciseMatch, req: RequestSummary, structured: bool, prompt_bytes: int, ring: _Ring,
        scores: list[float],
    ) -> tuple[str, int] | None:
        """Step 1b: the ring member whose engine holds the longest long-enough prefix, as (name, matched
        in learned-block units, as the cost check counts), or None."""
        a = self._a
        if structured and req.key_prefix_chars is not None and req.prompt:
            share = min(1.0, (req.key_prefix_chars + 1) / len(req.prompt))  # past the first user turn
        else:
            share = a.min_prefix_ratio
        point = share * found.prompt_tokens
        if found.block_size > 0:
            # Engines cache whole blocks only: the block holding the end of the first user turn may not be
            # full yet, so reaching its start is enough (it already differs from other conversations).
            point = (point // found.block_size) * found.block_size
        need = max(1.0, a.min_prefix_blocks * self._block_tokens, point)
        best_i, best_t, best_s = -1, 0, -1.0
        cached = found.cached
        for i, name in enumerate(ring.names):
            t = cached.get(name, 0)
            if t >= need and (t > best_t or (t == best_t and scores[i] > best_s)):
                best_i, best_t, best_s = i, t, scores[i]
        if best_i < 0:
            return None
        # The share of the prompt cached there, in the learned index's blocks of `block_bytes` bytes.
        blocks = best_t / found.prompt_tokens * prompt_bytes / a.block_bytes
        return ring.names[best_i], max(1, int(blocks))

    # ------------------------------------------------------------------------------------ bounded load

    def _uncached(self, prompt_tokens: float, matched: int) -> float:
        """Estimated prompt tokens a backend holding `matched` leading blocks must still prefill."""
        if matched == -1:
            return 0.0
        return max(0.0, prompt_tokens - max(matched, 0) * self._block_tokens)

    def _bounded(
        self,
        primary: str,
        reason: Reason,
        matched: int,
        prompt_tokens: float,
        ring: _Ring,
        scores: list[float] | None,
        key_seed: int,
        snapshot: Snapshot,
        inflight: Mapping[str, Inflight],
        exclude: frozenset[str],
        req: RequestSummary,
        structured: bool,
        data: bytes,
        seed: int,
        blocks: list[int] | None,
        found: PreciseMatch | None,
        held: dict[str, int] | None,
    ) -> tuple[str, Reason, int, list[int] | None]:
        """Apply the bounded-load rule and the cost check to `primary`.

        Returns the chosen backend, the decision's reason, the prefix blocks it holds (-1: the whole
        prompt, an exact hit) and the block chain if it was computed (None: not needed so far). `scores`
        None: the rendezvous scores of the hash key (seeded by `key_seed`), computed if a tie-break needs
        them; `blocks`/`held` None: computed (from `data`, `seed`, `found`) if a cost needs them.
        """
        a = self._a
        info = ring.info
        # Fleet figures over the backends that could take this request now.
        if exclude:
            names_now = [n for n in ring.routable if n not in exclude]
            total_w = sum(info[n][1] for n in names_now)
            fresh = [x for n in names_now if (x := info[n][2]) is not None]
            score_sum, score_n = sum(fresh), len(fresh)
        else:
            names_now = ring.routable
            total_w, score_sum, score_n = ring.routable_w, ring.score_sum, ring.score_n
        if not names_now:
            eligible(req, snapshot, exclude)  # raises NoBackendAvailable with the precise reason
            raise NoBackendAvailable("no routable backend serves this request")
        pending: Callable[[str, Inflight | None], float] = self._pending
        peer_view = self._peers() if self._peers is not None else None
        if peer_view:
            inflight, pending = self._with_peers(peer_view, inflight, self._work, a.running_weight)
        elif self._shared_backends and ring.queued:
            inflight = self._engine_load(ring, inflight)
        get = inflight.get
        total_req = sum([get(n, _NO_INFLIGHT).requests for n in names_now])
        share = self._request_factor * (total_req + 1) / total_w
        score_limit = self._bound_factor * (score_sum / score_n) + a.overload_margin if score_n else math.inf
        adapter = req.adapter
        miss = float(a.adapter_miss_tokens) if adapter is not None else 0.0

        entry = info[primary]
        if entry[0] and primary not in exclude:
            if _admits(entry, get(primary, _NO_INFLIGHT).requests, share, score_limit, a.saturation):
                if not a.cost_aware:
                    return primary, reason, matched, blocks
                if matched == -2:
                    if blocks is None:
                        blocks = self._fp.chain(data, seed)
                    if held is None and found is not None:
                        held = self._held(found, ring, len(blocks))
                    if held is not None and primary in held:
                        matched = held[primary]
                    else:
                        matched = self._indexes[primary].match(blocks, 1) if blocks else 0
                w = entry[1]
                queued_here = pending(primary, get(primary))
                uncached = self._uncached(prompt_tokens, matched)
                adapter_here = _adapter_cost(miss, ring.adapters, adapter, primary)
                cost = (queued_here + self._uw * uncached + adapter_here) / w
                if matched > 0 or matched == -1:
                    # The affine backend holds part of the prompt: leave it only for one clearly cheaper,
                    # by a factor (1 + cost_epsilon) plus cost_slack_tokens.
                    limit = (cost - a.cost_slack_tokens) / self._cost_factor
                    preamble = 0
                else:
                    # New content: the hash home is only the deterministic tie-break (a near-equal fleet
                    # keeps it); any backend cheaper by new_prompt_slack_tokens takes the prompt instead.
                    # In an idle fleet (nothing in flight anywhere), a chat prompt's shared system prompt
                    # does not count towards "cheaper": the home lacks it only until this request has run
                    # there, and counting it sent every new conversation to whichever GPU saw the system
                    # prompt first, since with no queue anywhere nothing ever pushes back. Under load the
                    # holder's queue does push back, and following it saves prefill and KV (sysprompt
                    # workload: hit 90.9% vs 88.3%, TTFT p99 111 vs 144 ms when discounted always;
                    # loadtest/results/scaleout.md), so there the match counts.
                    limit = cost - a.new_prompt_slack_tokens
                    preamble = self._shared_blocks(req) if total_req == 0 and structured else 0
                    if (a.eviction_band_tokens and found is not None and found.lru_front is not None
                            and found.cached and not any(found.cached.values())):
                        # Eviction-aware placement (proxy/core/placement.py, off by default): of the
                        # near-equal backends, the one evicting the oldest KV.
                        if scores is None:
                            scores = ring.scores(self._fp.hash_key(req, data, key_seed)[0])
                        if blocks is None:
                            blocks = self._fp.chain(data, seed)
                        if held is None:
                            held = self._held(found, ring, len(blocks))
                        bound = _Bound(exclude, inflight, share, score_limit, a.saturation, miss, ring.adapters,
                                       adapter)
                        got = self._place_new(found, ring, scores, bound, pending, prompt_tokens, blocks, held,
                                              preamble)
                        if got is not None:
                            return (got[0], reason if got[0] == primary else Reason.OVERLOAD_FALLBACK, got[1],
                                    blocks)
                if limit > 0:
                    if scores is None:
                        scores = ring.scores(self._fp.hash_key(req, data, key_seed)[0])
                    bound = _Bound(exclude, inflight, share, score_limit, a.saturation, miss, ring.adapters,
                                   adapter)
                    best_i, best_m, blocks = self._cheapest(
                        primary, limit, preamble, ring, scores, bound, pending, prompt_tokens, data, seed, blocks,
                        found, held)
                    if best_i >= 0:
                        return ring.names[best_i], Reason.OVERLOAD_FALLBACK, best_m, blocks
                return primary, reason, matched, blocks
            fallback = Reason.OVERLOAD_FALLBACK
        else:
            fallback = Reason.UNHEALTHY_FALLBACK
        # The primary cannot take it: the cheapest admissible backend (the KV it holds of the prompt
        # saves part of the prefill; ties in rendezvous order).
        if scores is None:
            scores = ring.scores(self._fp.hash_key(req, data, key_seed)[0])
        bound = _Bound(exclude, inflight, share, score_limit, a.saturation, miss, ring.adapters, adapter)
        best_i, best_m, blocks = self._cheapest(
            primary, math.inf, 0, ring, scores, bound, pending, prompt_tokens, data, seed, blocks, found, held)
        if best_i >= 0:
            return ring.names[best_i], fallback, best_m, blocks
        # Everything eligible is saturated: the least-loaded one, by telemetry plus in-flight work.
        load_cfg = self._cfg.load
        states = [b for n in names_now if (b := snapshot.get(n)) is not None]
        assumed = assumed_score(states, load_cfg)
        best = min(
            states,
            key=lambda b: effective_load(b, inflight.get(b.name), load_cfg, assumed=assumed) / b.effective_weight,
        )
        return best.name, fallback, 0, blocks

    def _shared_blocks(self, req: RequestSummary) -> int:
        """Chat prompts: the blocks up to the end of the leading system messages (0: none). A match that
        reaches no block wholly past them is only their shared system prompt, a one-time cost wherever the
        prompt goes (see `_bounded`)."""
        cut = req.shared_prefix_chars
        if not cut:
            return 0
        shared_bytes = cut if req.prompt.isascii() else len(req.prompt[:cut].encode("utf-8", "surrogatepass"))
        return -(-shared_bytes // self._a.block_bytes)

    def _cheapest(
        self,
        primary: str,
        limit: float,
        preamble: int,
        ring: _Ring,
        scores: list[float],
        bound: _Bound,
        pending: Callable[[str, Inflight | None], float],
        prompt_tokens: float,
        data: bytes,
        seed: int,
        blocks: list[int] | None,
        found: PreciseMatch | None,
        held: dict[str, int] | None,
    ) -> tuple[int, int, list[int] | None]:
        """The admissible backend other than `primary` with the lowest estimated cost (its queued prefill
        plus this prompt's uncached tokens there, per unit of weight) below `limit`; ties go to the higher
        rendezvous rank. A match of at most `preamble` blocks is costed as no match (the returned match is
        the real one, for the ledger). Returns (its ring position or -1, its match, the block chain if
        computed)."""
        best_i, best_m, best_c, best_s = -1, 0, limit, -1.0
        info = ring.info
        get = bound.inflight.get
        uw = self._uw
        block_tokens = self._block_tokens
        idxs: list[PrefixIndex] | None = None
        for i, name in enumerate(ring.names):
            if name == primary:
                continue
            entry = info[name]
            if not entry[0] or name in bound.exclude or not _admits(
                    entry, get(name, _NO_INFLIGHT).requests, bound.share, bound.score_limit, bound.saturation):
                continue
            w = entry[1]
            queued = pending(name, get(name))
            # A lower bound of the cost first (the whole prompt cached): most candidates stop here.
            if queued / w > best_c or (queued / w == best_c and scores[i] < best_s):
                continue
            if idxs is None:
                if blocks is None:
                    blocks = self._fp.chain(data, seed)
                idxs = self._ring_indexes(ring)
                if held is None and found is not None:
                    held = self._held(found, ring, len(blocks))
            if held is not None and name in held:
                m = held[name]
            else:
                m = idxs[i].match(blocks, 1) if blocks else 0
            counted = m if m > preamble else 0
            uncached = max(0.0, prompt_tokens - counted * block_tokens)
            c = (queued + uw * uncached + _adapter_cost(bound.miss, bound.loaded, bound.adapter, name)) / w
            if c < best_c or (c == best_c and scores[i] > best_s):
                best_i, best_m, best_c, best_s = i, m, c, scores[i]
        return best_i, best_m, blocks

    def _place_new(
        self,
        found: PreciseMatch,
        ring: _Ring,
        scores: list[float],
        bound: _Bound,
        pending: Callable[[str, Inflight | None], float],
        prompt_tokens: float,
        blocks: list[int],
        held: dict[str, int],
        preamble: int,
    ) -> tuple[str, int] | None:
        """The eviction-aware placement's inputs (proxy/core/placement.py `place_new`): which ring members
        the bounded-load rule admits and this prompt's cost on each, as `_cheapest` counts it."""
        info = ring.info
        get = bound.inflight.get
        uw = self._uw
        block_tokens = self._block_tokens
        idxs = self._ring_indexes(ring)

        def can_take(name: str) -> bool:
            entry = info[name]
            return bool(entry[0]) and name not in bound.exclude and _admits(
                entry, get(name, _NO_INFLIGHT).requests, bound.share, bound.score_limit, bound.saturation)

        def cost_of(i: int) -> tuple[float, int]:
            name = ring.names[i]
            m = held[name] if name in held else (idxs[i].match(blocks, 1) if blocks else 0)
            counted = m if m > preamble else 0
            c = (pending(name, get(name)) + uw * max(0.0, prompt_tokens - counted * block_tokens)
                 + _adapter_cost(bound.miss, bound.loaded, bound.adapter, name))
            return c / info[name][1], m

        return place_new(found, ring.names, scores, can_take, cost_of, self._a.eviction_band_tokens)

    def _engine_load(self, ring: _Ring, inflight: Mapping[str, Inflight]) -> dict[str, Inflight]:
        """With `routing.shared_backends`: other proxy replicas route to these backends too, so this one's
        in-flight table holds only part of their load. Per backend, the running + waiting requests the
        engine itself reported in its last fresh scrape (every replica reads the same), moved by this
        process's own sends and completions since that scrape (its in-flight count now minus its count
        when it first read that scrape), and never below its own count. Without that correction a
        replica does not see its own sends until the next scrape, and sends a burst to the backend that
        looked cheapest. When the engine's count is larger, the requests are assumed to be like the
        ones this proxy sent there recently (the ledger then reads as many of its newest entries;
        tokens at its own per-request mean). Measured against R x own and against doing nothing:
        loadtest/results/scaleout.md."""
        out = dict(inflight)
        base = self._scrape_base
        for name, (seen, at) in ring.queued.items():
            own = inflight.get(name)
            mine = own.requests if own is not None else 0
            b = base.get(name)
            if b is None or b[0] != at:
                b = base[name] = (at, mine)
            count = int(seen) + mine - b[1]
            if count > mine:
                per = own.tokens / mine if own is not None and mine > 0 else 0
                out[name] = Inflight(count, int(per * count))
        return out

    @staticmethod
    def _with_peers(
        view: Mapping[str, PeerEntry],
        inflight: Mapping[str, Inflight],
        work: WorkLedger,
        weight: float = 1.0,
    ) -> tuple[dict[str, Inflight], Callable[[str, Inflight | None], float]]:
        """The load of the other replicas, as they last published it (`peer_load`: per backend, their
        in-flight requests, in-flight tokens and queued uncached prefill, and their newest ledger entries):
        added to this process's own, so the bound and the cost check read the fleet's load as one process
        would. The queued prefill of a backend whose entry carries the others' newest ledger entries is
        the fleet's newest K merged by age (`WorkLedger.fleet_pending`: summing each replica's own
        estimate instead cost R = 4 +11% TTFT mean on the multi-turn Mooncake load,
        loadtest/results/scaleout.md Round 4); without them (an older replica's row), this process's own
        estimate plus their published sum. A --workers worker (`inflight` its row of the host-wide shared
        table) reads its host-mates from the shared block, counts and ledger entries of one moment
        (`SharedInflightTable.mates`, `.mates_recent`), and the other hosts from the view (its mates' rows
        are not in it: peer_load's exchange skips them): instant where a published row lags by up to a
        refresh (R = 4 x W = 2 +9% TTFT mean with the mates' rows, scaleout.md Round 5), and a mate whose
        own exchange fails still counts. (The host-wide counts with the mates' *published* entries, tried
        in round 4b, cost +19%: counts newer than entries.) The estimates come from one
        `WorkLedger.fleet_view` per pick, which reads the shared block once and keeps each backend's
        estimate between picks until one of its inputs changes (round 5b: the same numbers, a fraction
        of the CPU)."""
        fleet = work.fleet_view(view, inflight, weight)  # `pending`: what it keeps between picks, see WorkLedger
        host = inflight if isinstance(inflight, SharedInflightTable) and inflight.row is not None else None
        if host is not None:
            # The bound: the host-wide counts now (its own row and its mates', every slot read at once)
            # plus the other hosts'.
            rs, ts = fleet.host_counts()
            out: dict[str, Inflight] = {n: sh for n, sh in host.items() if n not in view} if (
                host.keys() - view.keys()) else {}
            for name, entry in view.items():
                sh = host.get(name)
                if sh is None:
                    out[name] = Inflight(entry[0], entry[1])
                elif type(sh) is SharedInflight:
                    s = sh.slot
                    out[name] = Inflight(rs[s] + entry[0], ts[s] + entry[1])
                else:  # a backend without a slot: counted in this worker alone
                    out[name] = Inflight(sh.requests + entry[0], sh.tokens + entry[1])
            return out, fleet.queued
        out = dict(inflight)
        for name, entry in view.items():
            requests, tokens = entry[0], entry[1]
            own = inflight.get(name)
            if own is None:
                out[name] = Inflight(requests, tokens)
            else:
                out[name] = Inflight(own.requests + requests, own.tokens + tokens)
        return out, fleet.queued
