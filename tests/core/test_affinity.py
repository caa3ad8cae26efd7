"""The affinity policy: every reason, bounded loads, key movement, determinism across processes."""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.affinity import AffinityPolicy, rendezvous_order
from proxy.core.decision import Inflight, NoBackendAvailable, Reason
from proxy.core.kv_index import PreciseMatch
from proxy.core.routing_config import AffinityConfig, RoutingConfig
from proxy.core.snapshot import BackendSpec, Health, Snapshot

from .helpers import Ledger, chat, fleet, fresh, home_order, prompt, with_state

SYSTEM = "You are a meticulous assistant who answers in full sentences. " * 12  # ~750 bytes


def policy(**affinity: object) -> AffinityPolicy:
    return AffinityPolicy(RoutingConfig(affinity=AffinityConfig(**affinity)))  # type: ignore[arg-type]  # knobs of several types by name


def mapping(pol: AffinityPolicy, snap: Snapshot, prompts: list[str]) -> dict[str, str]:
    return {p: pol.pick(prompt(p), snap, {}).backend for p in prompts}


PROMPTS = [f"request number {i}: what is {i} squared?" for i in range(600)]


# ------------------------------------------------------------------------------------------- reasons


def test_repeated_prompts_stay_on_one_backend_each():
    pol, snap = policy(), fleet(4)
    seen: dict[int, set[str]] = collections.defaultdict(set)
    reasons = collections.Counter()
    for i in range(200):
        d = pol.pick(prompt(f"prompt {i % 20} " + "context " * 50, max_tokens=32), snap, {})
        seen[i % 20].add(d.backend)
        reasons[d.reason] += 1
    assert all(len(b) == 1 for b in seen.values())
    assert reasons == {Reason.HASH: 20, Reason.EXACT_HIT: 180}
    assert len({next(iter(b)) for b in seen.values()}) == 4  # and they spread over the fleet


def test_shared_system_prompt_does_not_collapse_onto_one_backend():
    pol, snap = policy(), fleet(4)
    counts = collections.Counter(
        pol.pick(chat([("system", SYSTEM), ("user", f"question {i}?")]), snap, {}).backend for i in range(400)
    )
    assert len(counts) == 4 and min(counts.values()) > 50, counts


def test_multi_turn_chats_stay_on_their_backend():
    pol, snap = policy(), fleet(5)
    for conv in range(30):
        messages = [("system", SYSTEM), ("user", f"conversation {conv}: first question")]
        homes = set()
        for turn in range(6):
            d = pol.pick(chat(messages), snap, {})
            homes.add(d.backend)
            assert d.reason in (Reason.HASH, Reason.PREFIX_HIT)
            messages += [("assistant", f"answer {turn} " * 30), ("user", f"follow-up {turn}")]
        assert len(homes) == 1


def test_prefix_hit_follows_the_kv_cache_after_a_fallback():
    pol, snap = policy(), fleet(4)
    messages = [("system", SYSTEM), ("user", "plan my trip to Kyoto"), ("assistant", "Day 1: ... " * 40)]
    first = pol.pick(chat(messages + [("user", "more")]), snap, {})
    home = first.backend
    # Home overloaded: the next turn falls back and builds its KV elsewhere...
    busy = {home: Inflight(requests=50)}
    messages += [("user", "more"), ("assistant", "Day 2: ... " * 40)]
    d2 = pol.pick(chat(messages + [("user", "and then?")]), snap, busy)
    assert d2.reason is Reason.OVERLOAD_FALLBACK and d2.backend != home
    # ...and the turn after that follows the longer cached prefix, even once home is idle again.
    messages += [("user", "and then?"), ("assistant", "Day 3: ... " * 40)]
    d3 = pol.pick(chat(messages + [("user", "thanks")]), snap, {})
    assert d3.reason is Reason.PREFIX_HIT and d3.backend == d2.backend
    assert d3.prefix_blocks_matched >= 6  # all of turn 2, more than home holds (turn 1: 4 blocks)


def test_unstructured_prompts_extending_a_prompt_get_prefix_hits():
    pol, snap = policy(), fleet(8)
    base = "".join(f"line {i} of a long shared document\n" for i in range(200))  # ~7 KiB
    d1 = pol.pick(prompt(base + "Q1"), snap, {})
    hits = [pol.pick(prompt(base + f"Q{j} and more text"), snap, {}) for j in range(2, 12)]
    assert all(d.backend == d1.backend and d.reason is Reason.PREFIX_HIT for d in hits)
    # A short shared preamble (under min_prefix_ratio of the prompt) is left to hashing.
    tails = [pol.pick(prompt(base[:1100] + f"{j}" * 3000), snap, {}) for j in range(10)]
    assert {d.reason for d in tails} == {Reason.HASH} and len({d.backend for d in tails}) > 1


def test_short_prefix_below_min_blocks_is_no_hit():
    pol, snap = policy(min_prefix_blocks=8, min_prefix_ratio=0.0), fleet(8)
    pol.pick(prompt("z" * 1500 + "first"), snap, {})  # 5 full blocks recorded
    reasons = {pol.pick(prompt("z" * 1500 + f"other {j}"), snap, {}).reason for j in range(10)}
    assert reasons == {Reason.HASH}


def test_session_header_keeps_a_session_on_one_backend():
    pol, snap = policy(), fleet(6)
    ds = [pol.pick(prompt(f"unrelated prompt {i}", session_key="user-42"), snap, {}) for i in range(30)]
    assert {d.reason for d in ds} == {Reason.SESSION} and len({d.backend for d in ds}) == 1
    spread = {pol.pick(prompt("same", session_key=f"user-{i}"), snap, {}).backend for i in range(60)}
    assert len(spread) == 6
    off = policy(session_affinity=False)
    assert off.pick(prompt("p", session_key="user-42"), snap, {}).reason is Reason.HASH


@pytest.mark.parametrize(
    "make_sick",
    [
        lambda s, n: (with_state(s, n, health=Health.UNHEALTHY), frozenset()),
        lambda s, n: (with_state(s, n, health=Health.DRAINING), frozenset()),
        lambda s, n: (s, frozenset({n})),
    ],
    ids=["unhealthy", "draining", "excluded"],
)
def test_unhealthy_draining_or_excluded_home_falls_back_to_next_in_order(make_sick):
    snap = fleet(5)
    home_pol = policy()
    d0 = home_pol.pick(prompt("where do I go?"), snap, {})
    sick, exclude = make_sick(snap, d0.backend)
    d = policy().pick(prompt("where do I go?"), sick, {}, exclude)
    assert d.reason is Reason.UNHEALTHY_FALLBACK
    order = home_order(prompt("where do I go?"), snap)
    assert order[0] == d0.backend and d.backend == order[1]  # the next backend in the prompt's rendezvous order


def test_health_flap_moves_only_that_backends_keys_and_they_come_back():
    pol, snap = policy(), fleet(5)
    before = mapping(pol, snap, PROMPTS[:300])
    victim = "gpu-2"
    during = mapping(pol, with_state(snap, victim, health=Health.UNHEALTHY), PROMPTS[:300])
    assert {p for p in before if before[p] != during[p]} == {p for p in before if before[p] == victim}
    assert mapping(pol, snap.evolve(snap.backends), PROMPTS[:300]) == before


def test_overload_by_inflight_sheds_to_next_in_order():
    pol, snap = policy(), fleet(4)
    d0 = pol.pick(prompt("hot prompt"), snap, {})
    home, second = home_order(prompt("hot prompt"), snap)[:2]
    assert d0.backend == home
    busy = {home: Inflight(requests=10), second: Inflight(requests=1)}
    d = pol.pick(prompt("hot prompt"), snap, busy)
    assert d.reason is Reason.OVERLOAD_FALLBACK and d.backend == second


def test_overload_fallback_prefers_a_backend_holding_the_prefix():
    pol, snap = policy(), fleet(8)
    doc = "".join(f"clause {i} of the shared contract\n" for i in range(150))  # ~5 KiB, 20 blocks
    first = pol.pick(prompt(doc + "question A"), snap, {})
    holder = first.backend
    # A prompt sharing the document but hashing elsewhere, whose home is overloaded: it should fall back
    # to the backend that already holds the document, not merely the next one in its hash order.
    for j in range(200):
        p = prompt(doc[:2600] + f"variant {j} " * 300)  # 10 shared blocks of ~22: below min_prefix_ratio
        d0 = policy().pick(p, snap, {})
        if d0.backend != holder and home_order(p, snap)[1] != holder:
            break
    else:
        pytest.fail("no prompt with a suitable hash order")
    d = pol.pick(p, snap, {d0.backend: Inflight(requests=9)})
    assert d.reason is Reason.OVERLOAD_FALLBACK and d.backend == holder


@pytest.mark.parametrize(
    "scores_for_home, max_inflight, home_inflight",
    [(0.97, None, 0), (0.8, None, 0), (0.1, 2, 2)],
    ids=["saturated-score", "score-above-mean", "max-inflight"],
)
def test_overload_by_telemetry_or_limit(scores_for_home, max_inflight, home_inflight):
    snap = fleet(4)
    home = policy().pick(prompt("q"), snap, {}).backend
    snap = fresh(snap, {n: (scores_for_home if n == home else 0.2) for n in snap.names})
    if max_inflight is not None:
        snap = with_state(snap, home, spec=replace(snap.get(home).spec, max_inflight=max_inflight))
    inflight = {home: Inflight(requests=home_inflight)} if home_inflight else {}
    d = policy().pick(prompt("q"), snap, inflight)
    assert d.reason is Reason.OVERLOAD_FALLBACK and d.backend != home


def test_scores_within_margin_keep_affinity():
    snap = fleet(4)
    home = policy().pick(prompt("q"), snap, {}).backend
    snap = fresh(snap, {n: (0.3 if n == home else 0.2) for n in snap.names})
    assert policy().pick(prompt("q"), snap, {}).reason is Reason.HASH


def test_everything_saturated_goes_to_least_loaded():
    snap = fresh(fleet(3), {"gpu-0": 0.99, "gpu-1": 0.96, "gpu-2": 0.98})
    d = policy().pick(prompt("q"), snap, {})
    assert d.backend == "gpu-1" and d.reason in (Reason.OVERLOAD_FALLBACK, Reason.UNHEALTHY_FALLBACK)


def test_slow_backend_sheds_its_keys_and_takes_them_back():
    pol, snap = policy(), fresh(fleet(4), {f"gpu-{i}": 0.2 for i in range(4)})
    prompts = [f"distinct prompt {i} " + "x" * 40 for i in range(40)]
    before = mapping(pol, snap, prompts)
    slow = "gpu-1"
    assert list(before.values()).count(slow) > 0
    degraded = fresh(snap, {slow: 0.9})
    during = {p: pol.pick(prompt(p), degraded, {}) for p in prompts}
    assert all(d.backend != slow for d in during.values())
    assert {d.reason for p, d in during.items() if before[p] == slow} == {Reason.OVERLOAD_FALLBACK}
    assert all(during[p].backend == before[p] for p in prompts if before[p] != slow)
    recovered = fresh(degraded, {slow: 0.2})
    assert mapping(pol, recovered, prompts) == before


def test_retries_follow_the_rendezvous_order_past_unhealthy_and_tried_backends():
    snap = with_state(fleet(6), "gpu-3", health=Health.UNHEALTHY)
    order = [n for n in home_order(prompt("alt"), snap) if n != "gpu-3"]
    pol, tried = policy(), frozenset[str]()
    for expected in order:
        d = pol.pick(prompt("alt"), snap, {}, tried)
        assert d.backend == expected
        tried |= {d.backend}


def test_no_backend_available():
    snap = fleet(2)
    with pytest.raises(NoBackendAvailable):
        policy().pick(prompt("q"), snap, {}, frozenset(snap.names))
    with pytest.raises(NoBackendAvailable):
        policy().pick(prompt("q"), with_state(with_state(snap, "gpu-0", weight=0.0), "gpu-1", weight=0.0), {})


# ---------------------------------------------------------------------------------------- bounded load


@given(
    n=st.integers(min_value=2, max_value=12),
    eps=st.sampled_from([0.1, 0.25, 0.5, 1.0, 1.5]),
    keys=st.lists(st.integers(min_value=0, max_value=4), min_size=1, max_size=150),
)
@settings(max_examples=80, deadline=None)
def test_bounded_load_guarantee_with_inflight_fed_back(n, eps, keys):
    """A batch of picks (skewed to at most 5 hot prompts): no backend above ceil((1+eps) * mean)."""
    pol, snap, ledger = policy(request_epsilon=eps), fleet(n), Ledger()
    for assigned, k in enumerate(keys, start=1):
        d = pol.pick(prompt(f"hot key {k}"), snap, ledger.inflight)
        ledger.start(d)
        bound = math.ceil((1 + eps) * assigned / n)
        assert max(ledger.requests(b) for b in snap.names) <= bound


@given(
    weights=st.lists(st.integers(min_value=1, max_value=4), min_size=2, max_size=6),
    count=st.integers(min_value=1, max_value=120),
)
@settings(max_examples=60, deadline=None)
def test_bounded_load_guarantee_is_weighted(weights, count):
    eps = 0.25
    pol, snap, ledger = policy(request_epsilon=eps), fleet(len(weights), weights=weights), Ledger()
    total_w = sum(weights)
    for assigned in range(1, count + 1):
        ledger.start(pol.pick(prompt("one very hot prompt"), snap, ledger.inflight))
        for i, w in enumerate(weights):
            assert ledger.requests(f"gpu-{i}") <= math.ceil((1 + eps) * assigned * w / total_w)


def test_bounded_load_with_completions_keeps_hot_key_mostly_home():
    pol, snap, ledger = policy(), fleet(4), Ledger()
    homes = collections.Counter()
    for i in range(400):
        d = pol.pick(prompt("hot"), snap, ledger.inflight)
        ledger.start(d)
        homes[d.backend] += 1
        if i % 2:
            for name in snap.names:
                if ledger.requests(name):
                    ledger.finish(name)
    assert homes.most_common(1)[0][1] > 100  # affinity kept while within the bound
    assert len(homes) > 1  # and the overflow spread


# -------------------------------------------------------------------------------------- key movement


@given(n=st.integers(min_value=3, max_value=16), victim=st.integers(min_value=0, max_value=15))
@settings(max_examples=25, deadline=None)
def test_removing_one_backend_moves_only_its_keys(n, victim):
    victim %= n
    snap = fleet(n)
    before = mapping(policy(), snap, PROMPTS)
    removed = f"gpu-{victim}"
    smaller = Snapshot.initial(b.spec for b in snap.backends if b.name != removed)
    after = mapping(policy(), smaller, PROMPTS)
    moved = {p for p in PROMPTS if before[p] != after[p]}
    assert moved == {p for p in PROMPTS if before[p] == removed}
    assert len(moved) < 2.0 * len(PROMPTS) / n + 25


@given(n=st.integers(min_value=2, max_value=16))
@settings(max_examples=15, deadline=None)
def test_adding_one_backend_moves_about_one_in_n_plus_one(n):
    snap = fleet(n)
    before = mapping(policy(), snap, PROMPTS)
    bigger = Snapshot.initial([b.spec for b in snap.backends] + [BackendSpec("newcomer", "http://new")])
    after = mapping(policy(), bigger, PROMPTS)
    moved = [p for p in PROMPTS if before[p] != after[p]]
    assert all(after[p] == "newcomer" for p in moved)
    expected = len(PROMPTS) / (n + 1)
    assert 0.5 * expected < len(moved) < 1.6 * expected


def test_weights_shape_the_key_share():
    snap = fleet(3, weights=[1, 2, 1])
    counts = collections.Counter(mapping(policy(), snap, PROMPTS).values())
    assert 240 < counts["gpu-1"] < 360 and counts["gpu-0"] > 100 and counts["gpu-2"] > 100


def test_removed_backend_is_forgotten_by_the_learned_state():
    pol, snap = policy(), fleet(3)
    p = "remember me " + "y" * 600
    home = pol.pick(prompt(p), snap, {}).backend
    assert pol.pick(prompt(p), snap, {}).reason is Reason.EXACT_HIT
    smaller = Snapshot(version=snap.version + 1, backends=tuple(b for b in snap.backends if b.name != home))
    d = pol.pick(prompt(p), smaller, {})
    assert d.backend != home and d.reason is Reason.HASH and pol.index_of(home) is None


def test_index_is_sized_from_reported_kv_capacity_and_bounded():
    cfg = AffinityConfig(index_blocks=1000, index_max_blocks=5000, index_capacity_factor=1.0)
    pol = AffinityPolicy(RoutingConfig(affinity=cfg))
    snap = fresh(fleet(2), {"gpu-0": 0.1}, kv_capacity_tokens=64_000)  # 64k tokens * 4 B / 256 B = 1000
    pol.pick(prompt("x"), snap, {})
    assert pol.index_of("gpu-0").capacity == 1000 and pol.index_of("gpu-1").capacity == 1000
    big = fresh(snap, {"gpu-0": 0.1}, kv_capacity_tokens=10_000_000)
    pol.pick(prompt("x"), big, {})
    assert pol.index_of("gpu-0").capacity == 5000
    small = fresh(snap, {"gpu-0": 0.1}, kv_capacity_tokens=6_400)
    pol.pick(prompt("x"), small, {})
    assert pol.index_of("gpu-0").capacity == 100
    for i in range(200):
        pol.pick(prompt(f"{i} " * 2000), small, {})
    assert len(pol.index_of("gpu-0")) <= 100 and len(pol.index_of("gpu-1")) <= 1000
    # Telemetry going quiet does not shrink/grow (and so drop) what the index learned.
    quiet = small.replace_backend("gpu-0", signals=None, stale=True)
    pol.pick(prompt("x"), quiet, {})
    assert pol.index_of("gpu-0").capacity == 100 and len(pol.index_of("gpu-0")) > 0


# ------------------------------------------------------------------------------------- determinism

_CHILD = r"""
import json, sys
from proxy.core.affinity import AffinityPolicy
from proxy.core.request import RequestSummary
from proxy.core.snapshot import BackendSpec, Snapshot
snap = Snapshot.initial(BackendSpec(f"gpu-{i}", "http://x", 1.0 + (i % 3)) for i in range(7))
pol = AffinityPolicy()
prompts = json.loads(sys.stdin.read())
print(json.dumps([pol.pick(RequestSummary(prompt=p, session_key=None), snap, {}).backend for p in prompts]))
"""


def _in_child(prompts: list[str], hashseed: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], input=json.dumps(prompts), capture_output=True, text=True, check=True,
        env=env, cwd=root, timeout=60,
    )
    return json.loads(out.stdout)


def test_same_mapping_in_processes_with_different_hash_seeds():
    prompts = PROMPTS[:200] + ["é日本" * i for i in range(1, 30)]
    snap = Snapshot.initial(BackendSpec(f"gpu-{i}", "http://x", 1.0 + (i % 3)) for i in range(7))
    here = [AffinityPolicy().pick(prompt(p), snap, {}).backend for p in prompts]
    assert _in_child(prompts, "1") == here
    assert _in_child(prompts, "4242") == here
    assert len(set(here)) == 7


def test_rendezvous_is_pinned_across_releases():
    """Changing the hashing scheme remaps every key during a rolling upgrade: make it a deliberate act."""
    names = [f"gpu-{i}" for i in range(4)]
    assert [rendezvous_order(names, [1.0] * 4, k)[0] for k in (0, 1, 2, 3, 2**63)] == PINNED_HOMES


PINNED_HOMES = ["gpu-3", "gpu-1", "gpu-2", "gpu-1", "gpu-0"]


# ------------------------------------------------------------------------------ the learned index follows the KV

LONG_SYSTEM = " ".join(f"rule{i % 37} applies to every shipment" for i in range(120))  # 600 words


def _sightings(pol: AffinityPolicy, snap: Snapshot, order: list[int]) -> tuple[dict[int, list[str]], collections.Counter]:
    """Send chat prompts one at a time (each finishes before the next starts: an idle fleet)."""
    seen: dict[int, list[str]] = collections.defaultdict(list)
    reasons: collections.Counter = collections.Counter()
    for i in order:
        d = pol.pick(chat([("system", LONG_SYSTEM), ("user", f"Where is shipment {i}?")]), snap, {})
        seen[i].append(d.backend)
        reasons[d.reason] += 1
    return seen, reasons


@pytest.mark.parametrize("interleaved", [False, True], ids=["prompt-by-prompt", "interleaved"])
@pytest.mark.parametrize("telemetry", [False, True], ids=["no-telemetry", "fresh-telemetry"])
def test_twenty_prompts_sharing_a_long_system_prompt_stay_put_and_spread(interleaved, telemetry):
    assert len(LONG_SYSTEM.split()) == 600
    snap = fleet(4)
    if telemetry:
        snap = fresh(snap, {n: 0.0 for n in snap.names}, kv_capacity_tokens=500_000)
    order = [i for _ in range(5) for i in range(20)] if interleaved else [i for i in range(20) for _ in range(5)]
    seen, reasons = _sightings(policy(), snap, order)
    assert all(len(set(b)) == 1 for b in seen.values()), seen
    assert len({b[0] for b in seen.values()}) >= 3, seen
    assert reasons[Reason.EXACT_HIT] == 80


def test_repeat_goes_where_the_kv_was_computed_after_a_cost_fallback():
    """A first sighting placed off its hash home by the cost check (the home has a long prefill queued)
    is computed where it went: its repeat follows it there, even once the hash home is idle again."""
    snap = fleet(4)
    p = prompt("a new document " + "z" * 4000)
    home = policy().pick(p, snap, {}).backend
    big = next(q for j in range(500) if policy().pick(q := prompt(f"big {j} " + "w" * 200_000), snap, {}).backend == home)
    pol = policy()
    assert pol.pick(big, snap, {}).backend == home  # ~50k uncached tokens queued on the home
    first = pol.pick(p, snap, {home: Inflight(requests=1, tokens=50_000)})
    assert first.backend != home and first.reason is Reason.OVERLOAD_FALLBACK
    again = pol.pick(p, snap, {})
    assert again.backend == first.backend and again.reason is Reason.EXACT_HIT


def test_repeat_shed_by_an_overloaded_holder_returns_to_it():
    """Only a first sighting teaches the exact index where the KV is: a repeat shed while its holder is
    overloaded does not move the entry, so the key goes back when the holder recovers."""
    pol, snap = policy(), fleet(4)
    p = prompt("keep me " + "k" * 3000)
    holder = pol.pick(p, snap, {}).backend
    shed = pol.pick(p, snap, {holder: Inflight(requests=50)})
    assert shed.backend != holder and shed.reason is Reason.OVERLOAD_FALLBACK
    back = pol.pick(p, snap, {})
    assert back.backend == holder and back.reason is Reason.EXACT_HIT


# ------------------------------------------------------------------------- replicas and the engines' own view


def _with_queue(snap: Snapshot, queues: dict[str, float]) -> Snapshot:
    """Fresh telemetry, equal load scores, and the engines' own running + waiting counts."""
    from proxy.core.snapshot import Signals

    out = []
    for b in snap.backends:
        b = replace(b, health=Health.HEALTHY, load_score=0.2, stale=False,
                    signals=Signals(scraped_at=0.0, running=queues.get(b.name, 0.0), waiting=0.0))
        out.append(b)
    return snap.evolve(out)


def test_replica_reads_the_engines_queue_the_other_replicas_filled():
    """With routing.shared_backends, a backend whose engine reports requests this replica never sent is
    loaded: a new prompt placed there by hashing goes elsewhere. Off (the default), the proxy reads its
    own in-flight table only, as before."""
    snap = fleet(4)
    p = prompt("a fresh question " + "q" * 3000)
    home = policy().pick(p, snap, {}).backend
    loaded = _with_queue(snap, {home: 6.0})
    alone = policy().pick(p, loaded, {})
    assert alone.backend == home and alone.reason is Reason.HASH
    shared = AffinityPolicy(RoutingConfig(shared_backends=True))
    d = shared.pick(p, loaded, {})
    assert d.backend != home and d.reason is Reason.OVERLOAD_FALLBACK


def test_engine_counts_limit_the_fleet_and_never_lower_the_own_count():
    """A backend's max_inflight then limits every replica's requests together; an engine reporting fewer
    requests than this proxy has in flight there (a stale scrape) never hides its own."""
    snap = fleet(4)
    p = prompt("another fresh question " + "r" * 3000)
    home = policy().pick(p, snap, {}).backend
    snap = with_state(snap, home, spec=replace(snap.get(home).spec, max_inflight=4))
    shared = AffinityPolicy(RoutingConfig(shared_backends=True))
    three = {n: 3.0 for n in snap.names}
    assert shared.pick(p, _with_queue(snap, three), {}).backend == home
    d = shared.pick(p, _with_queue(snap, {**three, home: 4.0}), {})
    assert d.backend != home and d.reason is Reason.OVERLOAD_FALLBACK
    stale_low = shared.pick(p, _with_queue(snap, {**three, home: 0.0}), {home: Inflight(requests=4, tokens=400)})
    assert stale_low.backend != home


def test_precise_view_finds_a_prefix_this_process_never_routed():
    snap = fleet(4)
    doc = "".join(f"clause {i} of the shared contract\n" for i in range(150))
    p = prompt(doc + "question A")
    home = policy().pick(p, snap, {}).backend
    holder = next(n for n in snap.names if n != home)
    pol = AffinityPolicy(RoutingConfig(), precise=lambda req: PreciseMatch(1000, {holder: 1000, home: 0}, 16))
    d = pol.pick(p, snap, {})
    assert d.backend == holder and d.reason is Reason.PREFIX_HIT and d.prefix_blocks_matched > 0
    # A view that leaves every backend out (stale or no events): the learned index and hashing decide.
    blind = AffinityPolicy(RoutingConfig(), precise=lambda req: PreciseMatch(1000, {}, 16))
    assert blind.pick(p, snap, {}).backend == home


def test_precise_view_costs_a_fallback_by_what_the_engines_hold():
    """The cost check reads the engines' view too: a prompt whose home is overloaded goes to the backend
    whose engine holds most of it, although this process never routed it there."""
    snap = fleet(4)
    p = prompt("fresh document " + "d" * 8000)
    home, nxt = home_order(p, snap)[:2]
    holder = next(n for n in snap.names if n not in (home, nxt))
    view = PreciseMatch(2000, {holder: 900, home: 0, nxt: 0}, 16)  # 45%: no prefix hit, a cheaper holder
    pol = AffinityPolicy(RoutingConfig(), precise=lambda req: view)
    d = pol.pick(p, snap, {home: Inflight(requests=9)})
    assert d.backend == holder and d.reason is Reason.OVERLOAD_FALLBACK


def test_idle_fleet_still_follows_a_users_own_preamble_past_the_system_prompt():
    """Only the system messages are discounted: a new question from a user whose long personal preamble
    (inside the user turn) is cached on one backend still goes there, in an idle fleet too."""
    snap = fleet(4)
    preamble = "my account notes: " + " ".join(f"order{i} shipped late" for i in range(150))  # ~3 KiB
    pol = policy()
    first = pol.pick(chat([("system", LONG_SYSTEM), ("user", preamble + " question 0?")]), snap, {})
    for j in range(1, 60):
        req = chat([("system", LONG_SYSTEM), ("user", preamble + f" question {j}?")])
        if policy().pick(req, snap, {}).backend != first.backend:
            break
    else:
        pytest.fail("no question hashing away from the first backend")
    d = pol.pick(req, snap, {})
    assert d.backend == first.backend and d.reason is Reason.OVERLOAD_FALLBACK and d.prefix_blocks_matched > 20
    assert req.shared_prefix_chars == len("system\n" + LONG_SYSTEM + "\n")
