"""The affinity policy: send a prompt where its KV cache lives, unless that GPU is overloaded.

One decision, in order:

1. **Session** — with `session_affinity` on and a session key on the request, the key is placed by
   rendezvous hashing (reason SESSION); the learned indexes are not consulted.
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
policy sent it that are still in flight (`WorkLedger`) plus `uncached_weight` x the prompt tokens it does
not hold (from its prefix index) plus `adapter_miss_tokens` when its fresh telemetry does not list the
request's LoRA adapter, per unit of weight. An admissible primary is kept unless another admissible
backend costs less than (cost - `cost_slack_tokens`) / (1 + `cost_epsilon`), or, when the primary holds
none of the prompt, less than cost - `new_prompt_slack_tokens`: a near-equal fleet keeps the deterministic
placement, a GPU with a long prefill queued sheds new work (OVERLOAD_FALLBACK). A
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
in-flight work) or a prefix hit one of them saw and the other did not. The exact index records the *primary*
choice, not the fallback, so keys shed by an overloaded backend return to it as soon as it recovers.
Learned state deliberately outlives a change of the backend set: after a backend is added, prompts already
cached somewhere keep going there (their KV is there) and the newcomer gets its ~1/N share of new prompts;
a removed backend's entries are dropped at once. The 1/N movement guarantee is a property of the hashing
layer (tested with fresh policies); the learned layer only ever moves fewer keys.
"""

from __future__ import annotations

import functools
import heapq
import math
from typing import Callable, Mapping

import xxhash

from proxy.core.decision import Decision, Inflight, NoBackendAvailable, Reason
from proxy.core.eligibility import eligible
from proxy.core.fingerprint import Fingerprinter
from proxy.core.load import effective_load, assumed_score, telemetry_score
from proxy.core.policies import LeastRequest
from proxy.core.prefix_index import GenerationalMap, PrefixIndex, holding
from proxy.core.request import BYTES_PER_TOKEN_ESTIMATE, RequestSummary
from proxy.core.routing_config import RoutingConfig
from proxy.core.snapshot import BackendSpec, BackendState, Snapshot
from proxy.core.work_ledger import WorkLedger

_xxh3 = xxhash.xxh3_64_intdigest
_SESSION_DOMAIN = b"affinity-proxy/session/v1\xff"
_BACKEND_DOMAIN = b"affinity-proxy/backend/v1\xff"
_TWO_POW_M64 = 2.0**-64
_NO_INFLIGHT = Inflight()


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
                 "score_sum", "score_n", "indexes", "adapters")

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
            return [_xxh3(kb, s) for s in self.seeds]
        log = math.log
        return [w / -log((_xxh3(kb, s) + 0.5) * _TWO_POW_M64) for s, w in zip(self.seeds, self.weights)]


def rendezvous_order(names: list[str], weights: list[float], key: int) -> list[str]:
    """Every backend in rendezvous order for `key` (used by tests and tools; the policy ranks lazily)."""
    ring = _Ring([BackendState(spec=BackendSpec(n, "", w)) for n, w in zip(names, weights)])
    scores = ring.scores(key)
    return [names[i] for i in sorted(range(len(names)), key=lambda i: scores[i], reverse=True)]


class AffinityPolicy:
    name = "affinity"

    def __init__(self, cfg: RoutingConfig = RoutingConfig()) -> None:
        self._cfg = cfg
        a = cfg.affinity
        self._a = a
        self._fp = Fingerprinter(a)
        self._exact: GenerationalMap[str] = GenerationalMap(a.exact_entries)
        self._indexes: dict[str, PrefixIndex] = {}
        self._snapshot: Snapshot | None = None
        self._rings: dict[str | None, _Ring] = {}
        self._bound_factor = 1.0 + a.epsilon
        self._request_factor = 1.0 + a.request_epsilon
        self._work = WorkLedger()
        self._cost_factor = 1.0 + a.cost_epsilon
        self._block_tokens = a.block_bytes / BYTES_PER_TOKEN_ESTIMATE
        # A request with no routable content (a GET, an unparsed path, an empty input) has no cache to
        # find: placed by load, never all on the hash home of the empty prompt.
        self._no_content = LeastRequest(cfg)

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

    def _ring(self, snapshot: Snapshot, model: str | None) -> _Ring:
        ring = self._rings.get(model)
        if ring is None:
            if len(self._rings) >= 1024:  # model names come from clients: keep the cache bounded
                self._rings.clear()
            ring = self._rings[model] = _Ring(
                [
                    b
                    for b in snapshot.backends
                    if b.effective_weight > 0 and (model is None or not b.spec.models or model in b.spec.models)
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

    def _top(self, scores: list[float]) -> list[int]:
        """Indexes of the best-ranked backends, best first (the hash home is the first)."""
        k = 2
        if len(scores) <= k:
            return sorted(range(len(scores)), key=scores.__getitem__, reverse=True)
        return heapq.nlargest(k, range(len(scores)), key=scores.__getitem__)

    # ------------------------------------------------------------------------------------------- pick

    def pick(
        self,
        req: RequestSummary,
        snapshot: Snapshot,
        inflight: Mapping[str, Inflight],
        exclude: frozenset[str] = frozenset(),
    ) -> Decision:
        if not req.prompt and not (self._a.session_affinity and req.session_key is not None):
            return Decision(self._no_content.pick(req, snapshot, inflight, exclude).backend, Reason.BALANCED,
                            self.name)
        self._sync(snapshot)
        ring = self._ring(snapshot, req.model)
        if not ring.names:
            eligible(req, snapshot, exclude)  # raises with the precise reason
        a = self._a
        keys = self._fp.keys(req)
        blocks: list[int] | None = None  # computed only when needed: the one cost that grows with the prompt
        matched = 0
        record_exact = True

        if a.session_affinity and req.session_key is not None:
            key = _xxh3(_SESSION_DOMAIN + req.session_key.encode("utf-8", "surrogatepass"))
            scores = ring.scores(key)
            top = self._top(scores)
            primary = ring.names[top[0]]
            reason = Reason.SESSION
            record_exact = False
        else:
            exact = self._exact.get(keys.fingerprint)
            scores = ring.scores(keys.hash_key)
            top = self._top(scores)
            if exact is not None and exact in ring.members:
                primary, reason = exact, Reason.EXACT_HIT
            else:
                blocks = self._fp.blocks(keys)
                need = a.min_prefix_blocks
                if keys.structured:
                    # The match must reach past the end of the first user turn, i.e. include the block
                    # holding its last byte: a run that stops inside the shared system prompt is no hit.
                    need = max(need, keys.key_blocks + 1)
                else:
                    need = max(need, math.ceil(a.min_prefix_ratio * len(blocks)))
                best_i = -1
                if 0 < need <= len(blocks):
                    idxs = self._ring_indexes(ring)
                    best_m, best_s = need, -1.0
                    for i in holding(idxs, blocks[need - 1]):
                        # Only a longer match, or an equal one ranked higher, can win: one lookup
                        # rejects the rest (most backends share the system prompt and nothing more).
                        tie_ok = scores[i] > best_s
                        m = idxs[i].match(blocks, best_m if tie_ok else best_m + 1)
                        if m:
                            best_i, best_m, best_s = i, m, scores[i]
                    if best_i >= 0:
                        matched = best_m
                if best_i >= 0:
                    primary, reason = ring.names[best_i], Reason.PREFIX_HIT
                else:
                    primary = ring.names[top[0]]
                    reason = Reason.HASH

        def get_blocks() -> list[int]:
            nonlocal blocks
            if blocks is None:
                blocks = self._fp.blocks(keys)
            return blocks

        prompt_tokens = len(keys.data) / BYTES_PER_TOKEN_ESTIMATE
        if reason is Reason.EXACT_HIT:
            matched = -1  # the whole prompt is cached there
        elif reason is not Reason.PREFIX_HIT:
            matched = -2  # not looked up yet
        chosen, reason, matched = self._bounded(
            primary, reason, matched, prompt_tokens, ring, scores, top, snapshot, inflight, exclude, req,
            get_blocks,
        )
        self._work.record(chosen, self._uncached(prompt_tokens, matched), inflight)
        if record_exact:
            self._exact.put(keys.fingerprint, primary)
        if reason is not Reason.EXACT_HIT:
            # An exact hit's chain was recorded when the prompt was first routed; any other decision
            # (fallbacks included: the KV is built where the request actually goes) teaches the index.
            chain = get_blocks()
            idx = self._indexes.get(chosen)
            if idx is not None and chain:
                idx.add(chain)
        return Decision(chosen, reason, self.name, max(matched, 0))

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
        scores: list[float],
        top: list[int],
        snapshot: Snapshot,
        inflight: Mapping[str, Inflight],
        exclude: frozenset[str],
        req: RequestSummary,
        get_blocks: Callable[[], list[int]],
    ) -> tuple[str, Reason, int]:
        """Apply the bounded-load rule and the cost check to `primary`.

        Returns the chosen backend, the decision's reason and the prefix blocks it holds (-1: the whole
        prompt, an exact hit).
        """
        a = self._a
        info = ring.info
        get = inflight.get
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
        total_req = sum([get(n, _NO_INFLIGHT).requests for n in names_now])
        score_limit = self._bound_factor * (score_sum / score_n) + a.overload_margin if score_n else math.inf
        share = self._request_factor * (total_req + 1) / total_w
        saturation = a.saturation

        def can_take(name: str) -> bool:
            routable, w, s, mx = info[name]
            if not routable or name in exclude:
                return False
            r = get(name, _NO_INFLIGHT).requests
            if mx is not None and r >= mx:
                return False
            if s is not None and (s >= saturation or s > score_limit):
                return False
            return r + 1 <= math.ceil(share * w - 1e-9)

        names = ring.names
        pending = self._work.pending
        block_tokens = self._block_tokens
        idxs: list[PrefixIndex] | None = None
        uw = a.uncached_weight
        adapter = req.adapter
        loaded = ring.adapters
        miss = float(a.adapter_miss_tokens) if adapter is not None else 0.0

        def adapter_cost(name: str) -> float:
            """The shared LoRA pool: a backend whose fresh telemetry does not list the request's adapter
            as loaded must load it first (tokens of prefill it is worth); unknown telemetry, no penalty."""
            if not miss:
                return 0.0
            have = loaded.get(name)
            return miss if have is not None and adapter not in have else 0.0

        def cheapest(limit: float) -> tuple[int, int]:
            """The admissible backend other than `primary` with the lowest estimated cost (its queued
            prefill plus this prompt's uncached tokens there, per unit of weight) below `limit`; ties go
            to the higher rendezvous rank. (-1, 0) if none."""
            nonlocal idxs
            best_i, best_m, best_c, best_s = -1, 0, limit, -1.0
            chain: list[int] | None = None
            for i, name in enumerate(names):
                if name == primary or not can_take(name):
                    continue
                w = info[name][1]
                queued = pending(name, get(name))
                # A lower bound of the cost first (the whole prompt cached): most candidates stop here.
                if queued / w > best_c or (queued / w == best_c and scores[i] < best_s):
                    continue
                if chain is None:
                    chain = get_blocks()
                    idxs = self._ring_indexes(ring)
                m = idxs[i].match(chain, 1) if chain else 0  # type: ignore[index]  # idxs is set on the first iteration that needs it
                c = (queued + uw * max(0.0, prompt_tokens - m * block_tokens) + adapter_cost(name)) / w
                if c < best_c or (c == best_c and scores[i] > best_s):
                    best_i, best_m, best_c, best_s = i, m, c, scores[i]
            return best_i, best_m

        if info[primary][0] and primary not in exclude:
            if can_take(primary):
                if not a.cost_aware:
                    return primary, reason, matched
                if matched == -2:
                    chain = get_blocks()
                    m = self._indexes[primary].match(chain, 1) if chain else 0
                    matched = m
                w = info[primary][1]
                cost = (
                    pending(primary, get(primary)) + uw * self._uncached(prompt_tokens, matched)
                    + adapter_cost(primary)
                ) / w
                if matched > 0 or matched == -1:
                    # The affine backend holds part of the prompt: leave it only for one clearly cheaper,
                    # by a factor (1 + cost_epsilon) plus cost_slack_tokens.
                    limit = (cost - a.cost_slack_tokens) / self._cost_factor
                else:
                    # New content: the hash home is only the deterministic tie-break (a near-equal fleet
                    # keeps it); any backend cheaper by new_prompt_slack_tokens takes the prompt instead.
                    limit = cost - a.new_prompt_slack_tokens
                if limit > 0:
                    best_i, best_m = cheapest(limit)
                    if best_i >= 0:
                        return names[best_i], Reason.OVERLOAD_FALLBACK, best_m
                return primary, reason, matched
            fallback = Reason.OVERLOAD_FALLBACK
        else:
            fallback = Reason.UNHEALTHY_FALLBACK
        # The primary cannot take it: the cheapest admissible backend (the KV it holds of the prompt
        # saves part of the prefill; ties in rendezvous order).
        best_i, best_m = cheapest(math.inf)
        if best_i >= 0:
            return names[best_i], fallback, best_m
        # Everything eligible is saturated: the least-loaded one, by telemetry plus in-flight work.
        load_cfg = self._cfg.load
        states = [b for n in names_now if (b := snapshot.get(n)) is not None]
        assumed = assumed_score(states, load_cfg)
        best = min(
            states,
            key=lambda b: effective_load(b, inflight.get(b.name), load_cfg, assumed=assumed) / b.effective_weight,
        )
        return best.name, fallback, 0
