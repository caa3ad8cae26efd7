"""The affinity policy's cost check: queued prefill, cached prefix, LoRA adapters (pure, deterministic)."""

from __future__ import annotations

from dataclasses import replace

from proxy.core.affinity import AffinityPolicy
from proxy.core.decision import Inflight, Reason
from proxy.core.routing_config import AffinityConfig, RoutingConfig
from proxy.core.snapshot import Health, Signals, Snapshot
from proxy.core.work_ledger import WorkLedger

from .helpers import fleet, home_order, prompt, with_state

DOC = "".join(f"section {i} of the long shared document. " for i in range(2000))  # ~80 KiB, ~20k tokens


def policy(**affinity: object) -> AffinityPolicy:
    return AffinityPolicy(RoutingConfig(affinity=AffinityConfig(**affinity)))  # type: ignore[arg-type]  # knobs of several types by name


def test_ledger_sums_the_newest_live_entries():
    led = WorkLedger(depth=4)
    for t in (100, 200, 300, 400, 500):  # depth 4: 100 is forgotten
        led.record("a", t)
    assert led.pending("a", None) == 0 and led.pending("a", Inflight(requests=0)) == 0
    assert led.pending("a", Inflight(requests=2, tokens=9999)) == 900  # the two newest: 500 + 400
    assert led.pending("a", Inflight(requests=4)) == 1400
    # Live requests it never saw count at the data plane's own per-request average ...
    assert led.pending("a", Inflight(requests=6, tokens=6000)) == 1400 + 2 * 1000
    # ... or, without token counts, at the average of what it saw.
    assert led.pending("a", Inflight(requests=5)) == 1400 + 350
    assert led.pending("b", Inflight(requests=2, tokens=300)) == 300
    led.discard("a")
    assert led.pending("a", Inflight(requests=1)) == 0 and len(led) == 0


def test_long_queued_prefill_on_the_hash_home_sends_new_content_elsewhere():
    snap = fleet(4)
    pol = policy()
    doc = prompt(DOC + "first question")
    home = policy().pick(doc, snap, {}).backend
    # The home has a queued ~20k-token prefill that this policy sent it; the others are idle.
    first = pol.pick(doc, snap, {})
    assert first.backend == home and first.reason is Reason.HASH
    other = prompt("an unrelated new prompt " * 400)  # ~2.4k tokens
    d0 = policy().pick(other, snap, {})
    busy = {home: Inflight(requests=1, tokens=20_000)}
    d = pol.pick(other, snap, busy)
    if d0.backend == home:
        assert d.backend != home and d.reason is Reason.OVERLOAD_FALLBACK
    else:
        assert d.backend == d0.backend and d.reason is Reason.HASH


def test_near_equal_fleet_keeps_the_hash_placement():
    snap = fleet(4)
    ps = [prompt(f"prompt {i} " * 300) for i in range(40)]
    homes = {p.prompt: policy().pick(p, snap, {}).backend for p in ps}
    pol = policy()
    # Every backend has one small request in flight: no backend is clearly cheaper than another.
    inflight = {n: Inflight(requests=1, tokens=500) for n in snap.names}
    for p in ps:
        d = pol.pick(p, snap, inflight)
        assert d.backend == homes[p.prompt] and d.reason is Reason.HASH


def test_a_prompt_stays_where_its_prefix_is_cached_despite_a_longer_queue():
    snap = fleet(4)
    pol = policy()
    holder = pol.pick(prompt(DOC + "question one"), snap, {}).backend
    # The holder still has the first question's ~20k-token prefill queued (the ledger's entry for its one
    # live request), the others one small request each (so the request-count bound admits every backend);
    # re-prefilling the ~20k-token document elsewhere costs 3x that: stay (prefix hit).
    light = {n: Inflight(requests=1, tokens=100) for n in snap.names}
    d = pol.pick(prompt(DOC + "question two"), snap, {**light, holder: Inflight(requests=1, tokens=6_000)})
    assert d.backend == holder and d.reason is Reason.PREFIX_HIT and d.prefix_blocks_matched > 0
    # With uncached tokens weighed like queued ones and a deep queue, it leaves.
    pol2 = policy(uncached_weight=1.0)
    pol2.pick(prompt(DOC + "question one"), snap, {})
    deep = {**{n: Inflight(requests=3, tokens=300) for n in snap.names}, holder: Inflight(requests=3, tokens=200_000)}
    d2 = pol2.pick(prompt(DOC + "question three"), snap, deep)
    assert d2.backend != holder and d2.reason is Reason.OVERLOAD_FALLBACK


def test_cost_check_off_keeps_the_affine_choice():
    snap = fleet(4)
    pol = policy(cost_aware=False)
    holder = pol.pick(prompt(DOC + "q1"), snap, {}).backend
    light = {n: Inflight(requests=1, tokens=100) for n in snap.names}
    d = pol.pick(prompt(DOC + "q2"), snap, {**light, holder: Inflight(requests=1, tokens=10**7)})
    assert d.backend == holder and d.reason is Reason.PREFIX_HIT


def _with_adapters(snap: Snapshot, loaded: dict[str, frozenset[str]]) -> Snapshot:
    out = []
    for b in snap.backends:
        out.append(replace(b, health=Health.HEALTHY, load_score=0.2, stale=False,
                           signals=Signals(scraped_at=0.0, loaded_adapters=loaded.get(b.name, frozenset()))))
    return snap.evolve(out)


def test_fallback_prefers_a_backend_with_the_adapter_loaded():
    base = fleet(4)
    req = prompt("a LoRA request " * 50, adapter="sql-lora", model="m")
    order = home_order(req, base)
    assert policy().pick(req, base, {}).backend == order[0]
    home, last = order[0], order[-1]
    snap = with_state(_with_adapters(base, {last: frozenset({"sql-lora"})}), home, health=Health.UNHEALTHY)
    d = policy().pick(req, snap, {})
    assert d.backend == last and d.reason is Reason.UNHEALTHY_FALLBACK
    # Without the preference it is the next in rendezvous order.
    d = policy(adapter_miss_tokens=0).pick(req, snap, {})
    assert d.backend == order[1]
    # Stale telemetry says nothing about adapters: no preference either.
    stale = snap.evolve(replace(b, stale=True) for b in snap.backends)
    assert policy().pick(req, stale, {}).backend == order[1]


def test_new_prompt_leaves_its_hash_home_for_a_cheaper_backend_beyond_the_small_slack():
    snap = fleet(4)
    req = prompt("a prompt no backend has seen " * 100)  # ~750 tokens
    home = policy().pick(req, snap, {}).backend
    idle = {n: Inflight(requests=1, tokens=0) for n in snap.names}  # every backend admissible
    # 1,000 tokens queued at home: within new_prompt_slack_tokens (2,048), the hash placement holds.
    d = policy().pick(req, snap, {**idle, home: Inflight(requests=1, tokens=1_000)})
    assert d.backend == home and d.reason is Reason.HASH
    # 3,000 tokens queued: another backend is cheaper by more than the slack and takes the new prompt.
    d = policy().pick(req, snap, {**idle, home: Inflight(requests=1, tokens=3_000)})
    assert d.backend != home and d.reason is Reason.OVERLOAD_FALLBACK
    # A prompt whose prefix a backend holds stays there with far more queued: here the ~20k-token
    # prefill of the document itself (the ledger's newest entry), against re-prefilling it elsewhere.
    pol = policy()
    holder = pol.pick(prompt(DOC + "q1"), snap, {}).backend
    d = pol.pick(prompt(DOC + "q2"), snap, {**idle, holder: Inflight(requests=1, tokens=3_000)})
    assert d.backend == holder and d.reason is Reason.PREFIX_HIT
