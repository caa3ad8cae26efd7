"""The `routing:` section of the configuration, owned by the routing core.

Plain frozen dataclasses with defaults, so that proxy/config.py can parse YAML into them by field names
and types alone, and so that tests and the offline replay can build a policy without any YAML. Bounds sit
in field metadata and cross-field rules in `validate()`, both checked by proxy/core/bounds.py in
`__post_init__` (a policy built directly in code must be just as impossible to misconfigure) and reported
by the config parser at the offending YAML line. The policy name is checked against the table of
policies, proxy/core/registry.py (which imports the policies, which import this module).

Everything that shapes the deterministic part of a routing decision (block size, fingerprint fields, the
distinguishing-prefix cap, the seed) lives here: two proxy replicas with the same `RoutingConfig` and the
same backend set hash every prompt to the same backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from proxy.core.bounds import check_config

# Request fields that can take part in the exact fingerprint. "prompt" is the prompt bytes; the others are
# the RequestSummary attributes of the same name.
FINGERPRINT_FIELDS: tuple[str, ...] = ("prompt", "model", "adapter", "max_tokens", "temperature")


@dataclass(frozen=True)
class LoadConfig:
    """How the proxy's own in-flight accounting is turned into load, next to the telemetry score.

    The telemetry score (0 idle .. 1 full) is at best one scrape interval old; the in-flight counts are
    exact and current. `effective_load` adds them, normalised by these figures, so that a burst of requests
    sent since the last scrape already counts, and a backend whose telemetry is stale or missing is ranked
    by what the proxy knows it sent there plus an assumed score, never as idle.
    """

    # In-flight requests that count as one full backend (load 1.0) when the backend has no max_inflight.
    inflight_requests_full: int = field(default=64, metadata={"gt": 0})
    # In-flight estimated tokens that count as one full backend when telemetry reports no KV capacity.
    inflight_tokens_full: int = field(default=262144, metadata={"gt": 0})
    # Telemetry score assumed for a backend whose metrics are stale or were never scraped, when no fresh
    # backend gives a fleet mean to assume instead. Deliberately not 0: missing data is not an idle GPU.
    stale_score: float = field(default=0.5, metadata={"ge": 0.0, "le": 1.0})

    def __post_init__(self) -> None:
        check_config(self)


@dataclass(frozen=True)
class AffinityConfig:
    """Knobs of the affinity policy (see proxy/core/affinity.py for the algorithm)."""

    # Bounded-load slack (Mirrokni et al., "Consistent Hashing with Bounded Loads"): a backend takes new
    # affine work only while its telemetry load score stays within (1+epsilon) * fleet mean
    # (+ overload_margin) ...
    epsilon: float = field(default=0.25, metadata={"gt": 0.0})
    # ... and its in-flight requests within ceil((1+request_epsilon) * fair share): the hard cap. Looser
    # than epsilon because with a few requests in flight per GPU a tight cap sheds reuses off their cache
    # (the cost check balances the work finely; see loadtest/results/affinity-tuning.md).
    request_epsilon: float = field(default=1.5, metadata={"gt": 0.0})
    # Prefix block size in prompt bytes; the default is justified in proxy/core/fingerprint.py.
    block_bytes: int = field(default=256, metadata={"ge": 16})
    # A prefix match shorter than this many blocks is not worth leaving the hash home for.
    min_prefix_blocks: int = field(default=4, metadata={"ge": 1})
    # For prompts without chat structure, a prefix hit must also cover this share of the prompt's blocks;
    # a mere shared preamble is left to consistent hashing (for chat, the match must cover the first user
    # turn instead). Keeps one backend from collecting every prompt that shares a long system prompt.
    min_prefix_ratio: float = field(default=0.5, metadata={"ge": 0.0, "le": 1.0})
    # Request fields combined into the exact fingerprint.
    fingerprint_fields: tuple[str, ...] = ("prompt", "model", "adapter", "max_tokens", "temperature")
    # Exact fingerprints remembered (fleet-wide, approximate LRU).
    exact_entries: int = field(default=65536, metadata={"ge": 1})
    # Prefix blocks remembered per backend when telemetry reports no KV capacity.
    index_blocks: int = field(default=16384, metadata={"ge": 1})
    # Upper bound per backend when sized from the reported KV capacity (bounds memory whatever it reports).
    index_max_blocks: int = field(default=65536, metadata={"ge": 1})
    # Index slots per KV-capacity block: >1 remembers a little more than the cache can hold, because the
    # proxy's byte blocks only approximate the engine's token blocks.
    index_capacity_factor: float = field(default=2.0, metadata={"gt": 0.0})
    # Cap, in blocks, on the distinguishing prefix hashed for prompts without chat structure.
    hash_prefix_max_blocks: int = field(default=64, metadata={"ge": 1})
    # Load score at or above which a backend is saturated and gets no affine work.
    saturation: float = field(default=0.95, metadata={"gt": 0.0})
    # Absolute slack added to (1+epsilon) * mean load score, so near-idle fleets do not flap on noise.
    overload_margin: float = field(default=0.2, metadata={"ge": 0.0})
    # Cost check on top of the bounded-load rule: a request's estimated cost on a backend is the prefill
    # queued there (uncached prompt tokens of its in-flight requests, see proxy/core/work_ledger.py) plus
    # this prompt's tokens that backend does not hold. The affine choice is kept unless another admissible
    # backend is cheaper by more than a factor (1 + cost_epsilon) plus cost_slack_tokens (when the affine
    # backend holds none of the prompt: cheaper by more than new_prompt_slack_tokens).
    # Uncached tokens weigh `uncached_weight` x queued ones: moving a request off the backend holding its
    # prefix costs its own prefill now, and again the KV duplicated on a second GPU evicts other prompts.
    # A LoRA request on a backend whose telemetry does not list its adapter as loaded costs
    # `adapter_miss_tokens` more (the design's shared LoRA pool: prefer where the adapter already is).
    cost_aware: bool = True
    cost_epsilon: float = field(default=0.25, metadata={"ge": 0.0})
    cost_slack_tokens: int = field(default=8192, metadata={"ge": 0})
    # null (the default): 3 when the queued prefill is the newest-k sum (no KV events, or running_weight
    # 1), 2 when it is the backlog bound the engines' KV events allow plus running_weight x the rest. The
    # sum overstates the queue (it counts decoding requests' prompts), so an uncached token weighed 3
    # queued ones against it; against the bound at running_weight 0.5, 3 left multi-turn repeats and
    # prefix-sharing prompts on backends full of decoding requests, where 2 measured TTFT mean -1.3% to
    # -6.8% on both multi-turn Mooncake loads (R = 1 to 4 x 2, eight seeds) and the single-turn ones
    # unchanged; 1.5, 2.5 and 4 were worse: loadtest/results/scaleout.md Round 14.
    uncached_weight: float | None = field(default=None, metadata={"ge": 0.0})
    # A prompt that no backend holds any of leaves its hash home for any backend cheaper by this much.
    new_prompt_slack_tokens: int = field(default=2048, metadata={"ge": 0})
    adapter_miss_tokens: int = field(default=2048, metadata={"ge": 0})
    # With KV events: the prefill queued on a backend is the work ledger's newest-k sum, which counts every
    # live request's whole uncached prompt until it finishes, or the backlog bound the engines' events
    # allow (what was sent since an entry less what the engine stored since; proxy/core/work_ledger.py,
    # "Progress"). This is how much of the sum above the bound counts (the prompts of live requests the
    # engine has already computed, i.e. requests now decoding): 1 the sum (without KV events always),
    # 0 the bound alone. 0.5, measured on both Mooncake windows at ~80% and ~96% busy over eight seeds,
    # R = 1 and R = 4 x W = 2: TTFT mean -11% to -13% on the busiest load, -2% to -4% on two others,
    # +2% to +4% on the multi-turn one at ~80% (1 and 0.75 lose the first; 0.25, the second's tail):
    # loadtest/results/scaleout.md Round 13; with uncached_weight's default 2 there, +0.2% to +2.1% (Round 14).
    running_weight: float = field(default=0.5, metadata={"ge": 0.0, "le": 1.0})
    # Eviction-aware placement (with KV events only; proxy/core/placement.py): a prompt no backend holds
    # goes, among the admissible backends whose cost is within this many tokens of the cheapest, to the
    # one whose engine evicts the oldest KV blocks. 0: off (the hash home or the cheapest, as before).
    # The KV index keeps the eviction ages only if this is on at start (a reload turning it on later
    # leaves the rule abstaining until the next start). Measured: loadtest/results/scaleout.md Round 5.
    eviction_band_tokens: int = field(default=0, metadata={"ge": 0})
    # Keep requests carrying the session header on one backend (hash of the session key).
    session_affinity: bool = True

    def __post_init__(self) -> None:
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        if not self.fingerprint_fields:
            yield "fingerprint_fields", "must not be empty"
        for name in self.fingerprint_fields:
            if name not in FINGERPRINT_FIELDS:
                yield "fingerprint_fields", f"unknown field {name!r} (known: {', '.join(FINGERPRINT_FIELDS)})"
        if len(set(self.fingerprint_fields)) != len(self.fingerprint_fields):
            yield "fingerprint_fields", "must not repeat a field"
        if self.index_max_blocks < self.index_blocks:
            yield "index_max_blocks", f"must be >= index_blocks ({self.index_blocks}), got {self.index_max_blocks}"


@dataclass(frozen=True)
class PeerLoadConfig:
    """`routing.peer_load`: share each replica's live load with the others through Redis (optional).

    Off while `redis_url` is null. When set, every routing process publishes its per-backend in-flight
    requests, in-flight tokens and queued uncached prefill every `refresh_ms` and reads the other
    replicas' (proxy/control/peer_load.py); the affinity policy adds them to its own load (the `peers`
    input). A replica that stops publishing drops out after max(3 x refresh_ms, 1 s)."""

    redis_url: str | None = None  # redis://host:6379/0, rediss://... (TLS), unix:///path.sock; null: off
    refresh_ms: int = field(default=10, metadata={"ge": 10, "le": 60000})  # 20 -> 10: scaleout.md Round 5
    key_prefix: str = field(default="affinity-proxy:peer-load", metadata={"min_len": 1})
    # This process's row name; null: hostname:pid (the --workers supervisor's pid in a worker, whose host
    # shares its load in memory and so publishes one host-wide row).
    replica_id: str | None = None

    def __post_init__(self) -> None:
        check_config(self)

    @property
    def enabled(self) -> bool:
        return self.redis_url is not None

    @property
    def ttl_ms(self) -> int:
        """How long a published row lives without a refresh (and how long a view read stays usable)."""
        return max(1000, 3 * self.refresh_ms)

    def validate(self) -> Iterable[tuple[str, str]]:
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            yield "redis_url", f"must be a redis://, rediss:// or unix:// URL, got {self.redis_url!r}"
        if self.replica_id is not None and not self.replica_id.strip():
            yield "replica_id", "must be a non-empty name or null"


@dataclass(frozen=True)
class RoutingConfig:
    """The `routing:` section."""

    policy: str = "affinity"  # a name in proxy/core/registry.py's POLICIES (checked there and by the parser)
    # Request header whose value keeps a session on one backend; null disables session stickiness.
    session_header: str | None = "x-session-id"
    # Seed of the policies that draw random numbers (random, power_of_two). Every worker and replica uses
    # the same seed; nothing in routing is salted per process.
    seed: int = 0
    # Other proxy replicas route to the same backends (a Service spreading requests over R replicas): the
    # affinity policy then reads a backend's load as the larger of its own in-flight count and the running
    # + waiting requests the engine reports. Best with the engines' KV events; with learned indexes only
    # it lost hits in the replay (loadtest/results/scaleout.md), so it is off by default.
    shared_backends: bool = False
    # The other replicas' live load through Redis (optional, off by default): see PeerLoadConfig.
    peer_load: PeerLoadConfig = PeerLoadConfig()
    load: LoadConfig = LoadConfig()
    affinity: AffinityConfig = AffinityConfig()

    def __post_init__(self) -> None:
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        if self.session_header is not None and not self.session_header.strip():
            yield "session_header", "must be a header name or null"
