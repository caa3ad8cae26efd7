"""The one interface between the data planes and every routing policy.

A policy is a small deterministic state machine (round-robin position, affinity index): it is fed a
request summary, the current snapshot and the data plane's in-flight counts, and answers a `Decision`;
the data plane reports back what became of each attempt as an `Outcome`.
It does no I/O and reads no clock, so every policy can be tested by feeding it plain values, and the
offline replay can run the very same objects in virtual time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Protocol

from proxy.core.frozen import fast_init
from proxy.core.request import RequestSummary
from proxy.core.snapshot import Snapshot


class Reason(str, enum.Enum):
    """Why a backend was chosen; exported as a metric label, so keep the set small and stable."""

    EXACT_HIT = "exact_hit"  # the same fingerprint was routed there recently
    PREFIX_HIT = "prefix_hit"  # it holds the longest cached prefix of this prompt
    SESSION = "session"  # sticky on the configured session header
    HASH = "hash"  # consistent hash of the prompt's distinguishing prefix
    OVERLOAD_FALLBACK = "overload_fallback"  # the affine backend was above the bounded-load limit
    UNHEALTHY_FALLBACK = "unhealthy_fallback"  # the affine backend was unhealthy, draining or excluded
    BALANCED = "balanced"  # a load-balancing policy with no affinity (round robin, least load, ...)


@dataclass(slots=True)
class Inflight:
    """The proxy's own accounting of work it has sent to one backend and not yet seen finish.

    Owned and mutated by the data plane only; policies read it. It is always fresh, unlike telemetry,
    which is why it is the load signal of last resort for stale backends.
    """

    requests: int = 0
    tokens: int = 0  # estimated prompt tokens + max_tokens of the in-flight requests


@fast_init  # one per pick (proxy/core/frozen.py)
@dataclass(frozen=True, slots=True)
class Decision:
    backend: str
    reason: Reason
    policy: str
    prefix_blocks_matched: int = 0
    # With a precise lookup (`telemetry.kv_events`): the backend whose engine held the most of this prompt
    # at the pick, by its KV events, and how many of the prompt's leading tokens (0 with nothing cached
    # anywhere: then no holder). None without such a lookup, or when it could not tell (a long prompt not
    # tokenised in time, no tokenizer for the model). Why a request went where it went: a `hash` pick beside
    # a holder with cached tokens means the holder held less than `routing.affinity.min_prefix_ratio`.
    kv_holder: str | None = None
    kv_cached: int | None = None


class Outcome(str, enum.Enum):
    """What the data plane saw of one attempt on a backend (fed to outlier detection and retries)."""

    SUCCESS = "success"  # a complete answer with a non-5xx status
    STATUS_5XX = "5xx"
    CONNECT_FAILURE = "connect_failure"  # refused, unreachable or timed out while connecting
    RESET = "reset"  # the connection was lost before a response status arrived
    STREAM_FAILURE = "stream_failure"  # the response started, then the backend broke off


class NoBackendAvailable(Exception):
    """Nothing routable: the data plane answers 503 with Retry-After (gRPC UNAVAILABLE)."""


class Policy(Protocol):
    @property
    def name(self) -> str:
        """The policy's registry name (a class attribute of each policy class)."""
        ...

    def pick(
        self,
        req: RequestSummary,
        snapshot: Snapshot,
        inflight: Mapping[str, Inflight],
        exclude: frozenset[str] = frozenset(),
    ) -> Decision:
        """Choose a routable backend not in `exclude`, or raise NoBackendAvailable."""
        ...
