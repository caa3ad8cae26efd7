"""Scale-out load views of the affinity policy (issue 13, item 4): what a replica that sees 1/R of the
traffic reads as a backend's load. `routing.shared_backends` (the engines' counts, moved by this process's
own sends since the scrape) and the `peers` input (the other replicas' published load, a shared ledger)."""

from __future__ import annotations

from dataclasses import replace

from proxy.core.affinity import AffinityPolicy
from proxy.core.decision import Inflight, Reason
from proxy.core.routing_config import RoutingConfig
from proxy.core.snapshot import Health, Signals, Snapshot

from .helpers import fleet, home_order, prompt


def _scraped(snap: Snapshot, queues: dict[str, float], at: float) -> Snapshot:
    """Fresh telemetry from one scrape at `at`: equal load scores, the engines' running + waiting counts."""
    return snap.evolve([
        replace(b, health=Health.HEALTHY, load_score=0.2, stale=False,
                signals=Signals(scraped_at=at, running=queues.get(b.name, 0.0), waiting=0.0))
        for b in snap.backends
    ])


def test_own_sends_since_the_scrape_are_added_to_the_engine_count():
    """The engine reported 2 requests on every backend; since then this process sent 2 more to one of
    them. It must read 4 there (the engine's 2 + its own 2 new ones), not max(2, 2) = 2: a replica that
    cannot see its own sends until the next scrape sends a burst to whichever backend looked cheapest."""
    snap = fleet(4)
    target = snap.names[0]
    shared = AffinityPolicy(RoutingConfig(shared_backends=True))
    scraped = _scraped(snap, {n: 2.0 for n in snap.names}, at=1.0)
    ring = shared._ring(scraped, None)
    assert shared._engine_load(ring, {})[target].requests == 2  # first read of this scrape: own count 0
    now = {target: Inflight(requests=2, tokens=200)}
    view = shared._engine_load(ring, now)
    assert view[target].requests == 4
    assert view[target].tokens == 400  # the extra requests at this process's per-request mean
    assert all(view[n].requests == 2 for n in snap.names[1:])
    # Its own requests finishing lower the count again; never below its own.
    assert shared._engine_load(ring, {target: Inflight(requests=1, tokens=100)})[target].requests == 3
    # A new scrape already holds those sends: the engine's count is read as it is.
    rescraped = _scraped(snap, {n: (4.0 if n == target else 2.0) for n in snap.names}, at=1.2)
    ring2 = shared._ring(rescraped, None)
    assert shared._engine_load(ring2, now)[target].requests == 4


def test_a_stale_low_engine_count_never_hides_the_own_requests():
    snap = fleet(4)
    target = snap.names[0]
    shared = AffinityPolicy(RoutingConfig(shared_backends=True))
    own = {target: Inflight(requests=5, tokens=500)}
    ring = shared._ring(_scraped(snap, {target: 1.0}, at=3.0), None)
    assert shared._engine_load(ring, own).get(target, own[target]).requests == 5


def test_peer_load_is_added_to_the_own_load():
    """The other replicas' published load (a shared ledger): a backend they filled with queued prefill is
    costed as loaded by this replica, which never sent it anything; an empty view changes nothing."""
    snap = fleet(4)
    p = prompt("a fresh question for the peers " + "q" * 3000)
    home = home_order(p, snap)[0]
    alone = AffinityPolicy(RoutingConfig()).pick(p, snap, {})
    assert alone.backend == home and alone.reason is Reason.HASH
    view = {home: (3, 9000, 30000.0)}
    with_peers = AffinityPolicy(RoutingConfig(), peers=lambda: view)
    d = with_peers.pick(p, snap, {})
    assert d.backend != home and d.reason is Reason.OVERLOAD_FALLBACK
    quiet = AffinityPolicy(RoutingConfig(), peers=lambda: {})
    assert quiet.pick(p, snap, {}).backend == home
    down = AffinityPolicy(RoutingConfig(), peers=lambda: None)
    assert down.pick(p, snap, {}).backend == home


def test_peer_requests_count_towards_the_request_bound():
    """The bounded-load rule reads the fleet's in-flight count: peers' requests on the home make it the
    most loaded backend by far, so a prompt with no cached prefix there leaves it."""
    snap = fleet(4)
    p = prompt("bound check " + "b" * 200)
    home = home_order(p, snap)[0]
    view = {home: (12, 1200, 0.0)}
    d = AffinityPolicy(RoutingConfig(), peers=lambda: view).pick(p, snap, {})
    assert d.backend != home and d.reason is Reason.OVERLOAD_FALLBACK


def test_peers_win_over_the_engine_estimate_and_fall_back_to_it():
    """With both inputs, a published peer view is used (it knows the queued tokens); when the shared
    ledger is unreachable (None) the engines' counts are the fallback."""
    snap = fleet(4)
    p = prompt("a fresh question about fallbacks " + "f" * 3000)
    home = home_order(p, snap)[0]
    loaded = _scraped(snap, {home: 6.0}, at=7.0)
    view: dict[str, tuple[int, int, float]] = {}
    state = {"view": view}
    pol = AffinityPolicy(RoutingConfig(shared_backends=True), peers=lambda: state["view"])
    # Peers publish an idle fleet: the engine's (stale) 6 is not read.
    state["view"] = {n: (0, 0, 0.0) for n in snap.names}
    assert pol.pick(p, loaded, {}).backend == home
    state["view"] = None  # type: ignore[assignment]  # the shared ledger is unreachable
    assert pol.pick(p, loaded, {}).backend != home
