"""The work ledger across proxy replicas (issue 13, round 4): the fleet's queued prefill is the newest K
entries of every replica's ledger merged by age (K the fleet's live requests), as one process holding
every entry would read it, not the sum of each replica's own newest k_r. Requests do not finish in the
order they were sent: a replica that still has one old long request decoding would count it as queued
prefill in its own newest k_r, where the fleet's newest K has long moved past it."""

from __future__ import annotations

from proxy.core.affinity import AffinityPolicy
from proxy.core.decision import Inflight, Reason
from proxy.core.routing_config import RoutingConfig
from proxy.core.work_ledger import WorkLedger

from .helpers import fleet, home_order, prompt

# (epoch, replica, uncached tokens) sent to one backend, in order. The first request (a 50k-token first
# turn) is still decoding; of the later short ones, three are live: A's 400 and B's 300, and A's 50k.
SENDS = [(0, "A", 50000.0), (1, "B", 600.0), (2, "B", 500.0), (3, "A", 400.0), (4, "B", 300.0)]


def _ledgers(backend: str) -> tuple[WorkLedger, WorkLedger, WorkLedger]:
    """One process that saw every send, and the two replicas that each saw theirs, ticked in step."""
    one, a, b = WorkLedger(), WorkLedger(), WorkLedger()
    epoch = 0
    for at, who, tokens in SENDS:
        while epoch < at:
            for led in (one, a, b):
                led.tick()
            epoch += 1
        one.record(backend, tokens)
        (a if who == "A" else b).record(backend, tokens)
    return one, a, b


def test_the_fleet_estimate_is_what_one_process_would_read() -> None:
    one, a, b = _ledgers("gpu")
    # A holds 2 live requests (its 50k and 400), B 1 (its 300): the fleet's 3 newest entries are 300, 400, 500.
    assert one.pending("gpu", Inflight(3, 3000)) == 1200.0
    published = b.recent("gpu", 3)
    assert published == ((0, 300.0), (2, 500.0), (3, 600.0))  # newest first, ages in B's epochs
    assert a.fleet_pending("gpu", Inflight(2, 2000), 1, 1000, published) == 1200.0
    # The sum of each replica's own newest k_r counts A's decoding 50k-token request as queued.
    assert a.pending("gpu", Inflight(2, 2000)) + b.pending("gpu", Inflight(1, 1000)) == 50700.0
    # Seen from B, the same fleet estimate.
    assert b.fleet_pending("gpu", Inflight(1, 1000), 2, 2000, a.recent("gpu", 3)) == 1200.0


def test_live_requests_beyond_the_entries_count_at_the_mean_and_nothing_live_is_nothing() -> None:
    _one, a, b = _ledgers("gpu")
    assert a.fleet_pending("gpu", None, 0, 0, b.recent("gpu", 3)) == 0.0
    # 7 live, 5 entries known: the 2 unrecorded at the fleet's mean tokens per live request (700 / 7).
    assert a.fleet_pending("gpu", Inflight(2, 200), 5, 500, b.recent("gpu", 3)) == 51800.0 + 2 * 100.0
    assert a.recent("gpu", 0) == () and a.recent("other", 3) == ()
    a.discard("gpu")
    assert a.recent("gpu", 3) == ()


def test_the_policy_reads_the_fleet_estimate_when_the_peers_publish_their_entries() -> None:
    """Replica A's view of its home backend: its own 2 live requests there (the old 50k-token one still
    decoding) and B's 1. With B's entries the fleet has 1,200 tokens queued there, less than the
    new-prompt slack: a new prompt stays on its hash home. With the sums only (round 3's view, and what
    an older replica publishes) the home reads 50,700 queued and the prompt is moved off it."""
    snap = fleet(4)
    p = prompt("a new question for the fleet ledger " + "n" * 2000)
    home = home_order(p, snap)[0]
    _one, a, b = _ledgers(home)
    own = {home: Inflight(2, 2000)}
    others = {n: (3, 300, 0.0, ((0, 0.0), (0, 0.0), (0, 0.0))) for n in snap.names if n != home}
    entries = {home: (1, 1000, b.pending(home, Inflight(1, 1000)), b.recent(home, 3)), **others}
    d = AffinityPolicy(RoutingConfig(), work=a, peers=lambda: entries).pick(p, snap, own)
    assert d.backend == home and d.reason is Reason.HASH
    _one, a2, _b = _ledgers(home)
    sums = {n: v[:3] for n, v in entries.items()}
    d2 = AffinityPolicy(RoutingConfig(), work=a2, peers=lambda: sums).pick(p, snap, own)
    assert d2.backend != home and d2.reason is Reason.OVERLOAD_FALLBACK


def test_unsorted_peer_entries_give_the_same_estimate() -> None:
    _one, a, b = _ledgers("gpu")
    published = b.recent("gpu", 3)
    assert a.fleet_pending("gpu", Inflight(2, 2000), 1, 1000, tuple(reversed(published))) == 1200.0
