"""The work ledger's queued prefill as a backlog bound on the engines' KV events (issue 13, round 13).

The newest-k sum counts a live request's whole uncached prompt until it finishes, decoding included. With
the engines' events the proxy sees each engine store the blocks it computes (`KVIndex.progress`), so the
estimate is the most that the tokens sent from a counted entry on exceed what the backend stored since
that entry: in one process, across a --workers host's shared table, and across replicas (the fleet's
newest K by age). `routing.affinity.running_weight` says how much of the newest-k sum above the bound
counts: 1 the sum as without events, 0 the bound alone (0.5 by default)."""

from __future__ import annotations

import pytest

from dataclasses import replace

from proxy.core.affinity import AffinityPolicy
from proxy.core.decision import Inflight, Reason
from proxy.core.inflight import SharedInflight, SharedInflightTable, SharedLayout
from proxy.core.kv_index import BlockStored, KVIndex, block_keys, chain_seed
from proxy.core.routing_config import AffinityConfig, RoutingConfig
from proxy.core.work_ledger import WorkLedger

from .helpers import fleet, home_order, prompt


def test_the_bound_is_the_work_sent_since_the_oldest_counted_entry_less_the_work_done_since() -> None:
    progress: dict[str, int] = {}
    led, plain = WorkLedger(progress=progress), WorkLedger()
    for tokens, done_before in ((30000.0, 0), (8000.0, 20000), (4000.0, 26000)):
        progress["gpu"] = done_before
        led.record("gpu", tokens)
        plain.record("gpu", tokens)
    progress["gpu"] = 30000
    # Three live: all 42,000 sent since the first record, 30,000 of them computed since.
    assert plain.pending("gpu", Inflight(3, 50000)) == plain.pending("gpu", Inflight(3, 50000), 0.0) == 42000.0
    assert led.pending("gpu", Inflight(3, 50000), 0.0) == 12000.0
    # At weight 1 the sum, in between the bound plus that share of what the sum counts above it.
    assert led.pending("gpu", Inflight(3, 50000)) == 42000.0
    assert led.pending("gpu", Inflight(3, 50000), 0.25) == 12000.0 + 0.25 * 30000.0
    # Two live (the first finished): the newest two were sent when 20,000 were done; 10,000 done since.
    assert led.pending("gpu", Inflight(2, 20000), 0.0) == 2000.0
    # More done than sent since: nothing queued, never negative.
    progress["gpu"] = 60000
    assert led.pending("gpu", Inflight(2, 20000), 0.0) == 0.0
    # Another backend's progress is not this one's; nothing live is nothing.
    progress["other"] = 10**9
    assert led.pending("gpu", Inflight(0, 0), 0.0) == 0.0 and led.pending("other", Inflight(1, 100), 0.0) == 100.0


def test_a_long_prompt_sent_just_now_counts_however_much_was_stored_since_the_oldest_entry() -> None:
    """A conversation decoding for a minute keeps the oldest live entry old; every request's decode
    blocks since then count as stored. Since the oldest entry, a 30k-token prompt sent a moment ago would
    vanish under them; from its own record on, only the 5,000 stored since count against it."""
    progress = {"gpu": 0}
    led = WorkLedger(progress=progress)
    led.record("gpu", 1000.0)
    progress["gpu"] = 100000
    led.record("gpu", 30000.0)
    progress["gpu"] = 105000
    assert led.pending("gpu", Inflight(2, 40000), 0.0) == 25000.0
    # Two live, one recorded (the other from before a restart): the unrecorded one at the mean, on top.
    fresh = WorkLedger(progress=progress)
    fresh.record("gpu", 30000.0)
    progress["gpu"] = 110000
    assert fresh.pending("gpu", Inflight(2, 40000), 0.0) == 25000.0 + 20000.0


def _replicas(progress: dict[str, int]) -> tuple[WorkLedger, WorkLedger, WorkLedger]:
    """One process that saw every send, and replicas A and B that each saw theirs, ticked in step; the
    backend stores 1,000 tokens every epoch and each send is recorded at its epoch's start."""
    one, a, b = (WorkLedger(progress=progress) for _ in range(3))
    sends = [(0, "A", 50000.0), (1, "B", 6000.0), (2, "B", 5000.0), (3, "A", 4000.0), (4, "B", 3000.0)]
    epoch = 0
    for at, who, tokens in sends:
        while epoch < at:
            epoch += 1
            progress["gpu"] = 1000 * epoch
            for led in (one, a, b):
                led.tick()
        one.record("gpu", tokens)
        (a if who == "A" else b).record("gpu", tokens)
    for _ in range(2):
        epoch += 1
        progress["gpu"] = 1000 * epoch
        for led in (one, a, b):
            led.tick()
    return one, a, b


def test_replicas_subtract_the_progress_since_the_epoch_of_the_fleets_kth_entry() -> None:
    progress: dict[str, int] = {}
    one, a, b = _replicas(progress)
    # Epoch 6, 6,000 stored. Three live (A's 50k decoding, A's 4k, B's 3k): the fleet's newest three
    # (3k, 4k, 5k) were sent from epoch 2 on, when 2,000 were stored: 12,000 sent, 4,000 done since.
    assert one.pending("gpu", Inflight(3, 3000), 0.0) == 8000.0
    assert a.fleet_pending("gpu", Inflight(2, 2000), 1, 1000, b.recent("gpu", 3), 0.0) == 8000.0
    assert b.fleet_pending("gpu", Inflight(1, 1000), 2, 2000, a.recent("gpu", 3), 0.0) == 8000.0
    assert a.fleet_pending("gpu", Inflight(2, 2000), 1, 1000, b.recent("gpu", 3), 0.5) == 8000.0 + 0.5 * 4000.0
    assert a.fleet_pending("gpu", Inflight(2, 2000), 1, 1000, b.recent("gpu", 3)) == 12000.0
    # Every entry counted (six live, five known): since the oldest's epoch 0, all 6,000 done.
    sent = 68000.0 + 68000.0 / 6  # the unrecorded sixth at the fleet's mean
    got = a.fleet_pending("gpu", Inflight(2, 34000), 4, 34000, b.recent("gpu", 5), 0.0)
    assert got == pytest.approx(sent - 6000.0)
    # Without progress: the newest-K sum alone, whatever the weight.
    plain = WorkLedger()
    plain.record("gpu", 5000.0)
    assert plain.fleet_pending("gpu", Inflight(1, 10), 0, 0, (), 0.0) == 5000.0


def test_an_age_beyond_the_history_counts_the_progress_since_the_oldest_epoch_kept() -> None:
    progress = {"gpu": 0}
    led = WorkLedger(progress=progress, history=4)
    led.record("gpu", 9000.0)
    for epoch in range(1, 11):
        progress["gpu"] = 100 * epoch
        led.tick()
    # Ten epochs old, four kept: the progress since epoch 7's start (700 of 1,000).
    assert led.progress_since("gpu", 10) == 300
    assert led.progress_since("gpu", 0) == 0 and led.progress_since("unseen", 3) == 0
    assert led.fleet_pending("gpu", Inflight(1, 9000), 0, 0, (), 0.0) == 9000.0 - 300
    led.discard("gpu")
    assert led.progress_since("gpu", 2) == 0
    with pytest.raises(ValueError):
        WorkLedger(history=0)


def test_a_host_subtracts_its_oldest_workers_progress_whatever_each_workers_own_count() -> None:
    layout = SharedLayout(rows=2, slots=4)
    buf = memoryview(bytearray(layout.size))
    w0, w1, view = (SharedInflightTable(buf, layout, row) for row in (0, 1, None))
    for t in (w0, w1, view):
        t.assign({"gpu": 0})
    # Each worker's index heard of the engine at a different time: counts offset by 1,000,000.
    p0, p1 = {"gpu": 0}, {"gpu": 1_000_000}
    w0.follow_progress(p0)
    w1.follow_progress(p1)
    with pytest.raises(RuntimeError):
        view.follow_progress(p0)

    def events(tokens: int) -> None:  # each worker's subscriber applies them and publishes its count
        p0["gpu"] += tokens
        p1["gpu"] += tokens
        w0.publish_count("gpu")
        w1.publish_count("gpu")

    WorkLedger(progress=p0).record("gpu", 20000.0, w0)
    w0.acquire("gpu", 20000)
    events(5000)
    WorkLedger(progress=p1).record("gpu", 10000.0, w1)
    w1.acquire("gpu", 10000)
    events(4000)
    # 30,000 sent since worker 0's entry, 9,000 done since: each worker reads 21,000; `queued` the sum.
    assert isinstance(w0["gpu"], SharedInflight)
    assert w0["gpu"].backlog() == (30000.0, 21000.0) and w0["gpu"].queued == 30000.0
    assert WorkLedger().pending("gpu", w1["gpu"], 0.0) == 21000.0
    assert WorkLedger().pending("gpu", w1["gpu"], 0.5) == 25500.0
    assert WorkLedger().pending("gpu", w1["gpu"]) == 30000.0
    # The supervisor's view (which routes nothing) reads the parts each worker published at its last send
    # or completion there: both at their sends, with nothing done since.
    assert view["gpu"].backlog() == (30000.0, 30000.0)
    w0.release("gpu", 20000)
    # Worker 1's entry alone: 10,000 sent, 4,000 done since.
    assert w1["gpu"].backlog() == (10000.0, 6000.0)
    w1.release("gpu", 10000)
    assert view["gpu"].backlog() == (0.0, 0.0)


def test_a_hosts_bound_counts_every_workers_entries_sent_after_one_as_one_process_does() -> None:
    """Worker 0 sent a short prompt long ago (computed; it is decoding), then worker 1 and worker 0 one
    long prompt each at the same moment; the engine has computed 10,000 tokens since. One process holding
    the three entries reads 60,000 sent since the long ones, 10,000 done: 50,000 queued. Each worker's own
    bound sees only its own long prompt (20,000) and the sum less the oldest entry's progress counts the
    short one alone (1,000): a worker's read merges both rows (the counts offset, as two indexes started
    at different times) and counts the host's newest entries, as one process."""
    layout = SharedLayout(rows=2, slots=1)
    buf = memoryview(bytearray(layout.size))
    w0, w1 = (SharedInflightTable(buf, layout, row) for row in (0, 1))
    for t in (w0, w1):
        t.assign({"gpu": 0})
    p0, p1 = {"gpu": 0}, {"gpu": 1_000_000}
    w0.follow_progress(p0)
    w1.follow_progress(p1)
    l0, l1 = WorkLedger(progress=p0), WorkLedger(progress=p1)
    one = WorkLedger(progress=p0)  # one process that sent all three

    def send(ledger: WorkLedger, table: SharedInflightTable, tokens: float) -> None:
        ledger.record("gpu", tokens, table)
        table.acquire("gpu", int(tokens))
        one.record("gpu", tokens)

    def events(tokens: int) -> None:  # each worker's subscriber applies them and publishes its count
        p0["gpu"] += tokens
        p1["gpu"] += tokens
        w0.publish_count("gpu")
        w1.publish_count("gpu")

    send(l0, w0, 1000.0)
    events(50000)
    send(l1, w1, 30000.0)
    send(l0, w0, 30000.0)
    events(10000)
    assert one.pending("gpu", Inflight(3, 61000), 0.0) == 50000.0
    assert w0["gpu"].backlog() == (61000.0, 50000.0)
    assert w1["gpu"].backlog() == (61000.0, 50000.0)
    assert WorkLedger().pending("gpu", w1["gpu"], 0.5) == 50000.0 + 0.5 * 11000.0
    # Worker 1's long prompt finished. Two live: like one process, the host counts its newest two
    # entries (the two long prompts: which request finished is not known), not worker 0's own two.
    w1.release("gpu", 30000)
    assert one.pending("gpu", Inflight(2, 31000), 0.0) == 50000.0
    assert w0["gpu"].backlog() == w1["gpu"].backlog() == (60000.0, 50000.0)


@pytest.mark.parametrize("seed", range(8))
def test_a_hosts_estimate_is_one_processs_over_every_workers_entries(seed: int) -> None:
    """Random sends from three workers (each ring 8 deep, so they wrap), random completions, random
    progress: each worker reads the queued prefill and the bound one process that sent everything reads,
    at every weight, whenever the host's live requests fit one ring (8 here). (Without KV events a worker reads the sum of each worker's own
    estimate: tests/control/test_peer_load_workers.py.)"""
    import random

    rng = random.Random(seed)
    layout = SharedLayout(rows=3, slots=1, recent=8)
    progress = {"gpu": 0}
    buf = memoryview(bytearray(layout.size))
    tables = [SharedInflightTable(buf, layout, row) for row in range(3)]
    ledgers = [WorkLedger(progress=progress) for _ in range(3)]
    for t in tables:
        t.assign({"gpu": 0})
        t.follow_progress(progress)
    one = WorkLedger(progress=progress)
    live: list[tuple[int, int]] = []  # (worker, tokens) of the requests in flight
    for step in range(80):
        if live and rng.random() < 0.4:
            w, tokens = live.pop(rng.randrange(len(live)))
            tables[w].release("gpu", tokens)
        else:
            w = rng.randrange(3)
            tokens = rng.choice((500, 2000, 8000, 30000))
            ledgers[w].record("gpu", float(tokens), tables[w])
            tables[w].acquire("gpu", tokens)
            one.record("gpu", float(tokens))
            live.append((w, tokens))
        progress["gpu"] += rng.choice((0, 0, 1000, 5000, 20000))
        for t in tables:
            t.publish_count("gpu")
        flight = Inflight(len(live), sum(tokens for _w, tokens in live))
        for weight in (0.0, 0.5, 1.0):
            expect = one.pending("gpu", flight, weight)
            for t in tables:
                got = WorkLedger().pending("gpu", t["gpu"], weight)
                if len(live) <= 8:
                    assert got == expect, (seed, step, weight)


def _one_worker_host(progress: dict[str, int]) -> SharedInflightTable:
    """The shared table of a --workers host's only worker, with one backend "gpu", following `progress`."""
    layout = SharedLayout(rows=1, slots=1)
    host = SharedInflightTable(memoryview(bytearray(layout.size)), layout, 0)
    host.assign({"gpu": 0})
    host.follow_progress(progress)
    return host


def test_a_kept_host_estimate_follows_every_change_of_its_inputs() -> None:
    """A worker keeps the host's estimate of a backend between reads (`host_estimate`); it sees every
    change of what it was read from: the engine's count, a send, a completion."""
    progress = {"gpu": 0}
    led = WorkLedger(progress=progress)
    host = _one_worker_host(progress)
    led.record("gpu", 10000.0, host)
    host.acquire("gpu", 10000)
    progress["gpu"] = 4000
    assert host["gpu"].backlog() == (10000.0, 6000.0)
    assert host["gpu"].backlog() == (10000.0, 6000.0)
    progress["gpu"] = 7000  # an event: seen on the next read
    assert host["gpu"].backlog() == (10000.0, 3000.0)
    led.record("gpu", 5000.0, host)  # a send: 15,000 sent, 7,000 done since the first entry
    host.acquire("gpu", 5000)
    assert host["gpu"].backlog() == (15000.0, 8000.0)
    host.release("gpu", 10000)  # the first finished: the second alone, nothing done since it
    assert host["gpu"].backlog() == (5000.0, 5000.0)
    progress["gpu"] = 9000
    assert host["gpu"].backlog() == (5000.0, 3000.0)


def test_the_bound_counts_the_engines_tokens_not_the_policys_estimates() -> None:
    """The policy estimates prompt bytes / 4, the events count the engine's tokens: calibrated on 5,000
    estimated tokens that were 4,000, an entry of 12,500 estimated is 10,000 engine tokens, gone once the
    engine stored 10,000, in one process, across replicas and in a --workers host alike."""
    progress = {"gpu": 0}
    led = WorkLedger(progress=progress)
    led.calibrate(5000.0, 4000)
    led.calibrate(0.0, 10)  # nothing to learn from
    assert led.ratio == 1.25
    host = _one_worker_host(progress)
    led.record("gpu", 12500.0, host)
    host.acquire("gpu", 12500)
    progress["gpu"] = 6000
    assert led.pending("gpu", Inflight(1, 12500), 0.0) == 12500.0 - 1.25 * 6000
    assert led.fleet_pending("gpu", Inflight(1, 12500), 0, 0, (), 0.0) == 12500.0 - 1.25 * 6000
    assert led.pending("gpu", host["gpu"], 0.0) == 12500.0 - 1.25 * 6000
    progress["gpu"] = 10000
    assert led.pending("gpu", Inflight(1, 12500), 0.0) == 0.0
    assert led.fleet_pending("gpu", Inflight(1, 12500), 0, 0, (), 0.0) == 0.0
    assert led.pending("gpu", host["gpu"], 0.0) == 0.0


def test_a_weight_under_one_keeps_a_new_prompt_home_when_the_events_show_its_queue_computed() -> None:
    """Every backend has two requests live. The home's sent 50,000 uncached tokens, and its engine has
    stored 50,000 since:
    they are decoding. The newest-k sum still reads 50,000 queued there and moves a new prompt off its
    hash home; at weight 0 the home reads nothing queued and keeps it; at 0.5 half of it, still moved."""
    snap = fleet(4)
    p = prompt("a new question about a document " + "d" * 4000)
    home = home_order(p, snap)[0]

    def pick(weight: float) -> tuple[str, Reason]:
        progress = {home: 0}
        led = WorkLedger(progress=progress)
        led.record(home, 25000.0)
        led.record(home, 25000.0)
        progress[home] = 50000
        cfg = replace(RoutingConfig(), affinity=AffinityConfig(running_weight=weight))
        live = {n: Inflight(2, 50000 if n == home else 200) for n in snap.names}  # the bound admits home
        d = AffinityPolicy(cfg, work=led).pick(p, snap, live)
        return d.backend, d.reason

    assert pick(0.0) == (home, Reason.HASH)
    for weight in (1.0, 0.5):
        backend, reason = pick(weight)
        assert backend != home and reason is Reason.OVERLOAD_FALLBACK
    with pytest.raises(ValueError):
        AffinityConfig(running_weight=1.5)


def test_an_uncached_token_weighs_two_queued_ones_against_the_bound_and_three_against_the_sum() -> None:
    """A ~20k-token document's repeat, its holder with another 50,000 tokens sent and nothing stored
    since (so the bound and the sum agree on 70,000 queued), the others idle. Re-prefilling the document
    elsewhere costs 3 x 20k against the sum (stay), 2 x 20k against the bound (leave): by default
    `uncached_weight` is 2 only where the ledger follows the engines' progress at running_weight < 1."""
    snap = fleet(4)
    doc = "".join(f"section {i} of the long shared document. " for i in range(2000))

    def leaves(events: bool, **affinity: float) -> bool:
        led = WorkLedger(progress={n: 0 for n in snap.names} if events else None)
        cfg = replace(RoutingConfig(), affinity=AffinityConfig(**affinity))  # type: ignore[arg-type]  # by name
        pol = AffinityPolicy(cfg, work=led)
        holder = pol.pick(prompt(doc + "question one"), snap, {}).backend
        led.record(holder, 50000.0)
        live = {n: Inflight(1, 100) for n in snap.names}
        live[holder] = Inflight(2, 70000)
        d = pol.pick(prompt(doc + "question two"), snap, live)
        assert (d.backend == holder) == (d.reason is not Reason.OVERLOAD_FALLBACK)
        return d.backend != holder

    assert leaves(True)
    assert leaves(True, uncached_weight=2.0) and leaves(False, uncached_weight=2.0)
    assert not leaves(True, uncached_weight=3.0)
    assert not leaves(False)
    assert not leaves(True, running_weight=1.0)
    with pytest.raises(ValueError):
        AffinityConfig(uncached_weight=-1.0)


def test_the_index_counts_the_prefill_each_engine_stored_once() -> None:
    idx = KVIndex()
    idx.track("gpu", model="m")
    ids = list(range(80))
    idx.apply("gpu", BlockStored(block_hashes=(1, 2), parent_block_hash=None, token_ids=tuple(ids[:32]), block_size=16))
    assert idx.progress == {"gpu": 32}
    # The same blocks again (a replay's overlap): not computed again.
    idx.apply("gpu", BlockStored(block_hashes=(1, 2), parent_block_hash=None, token_ids=tuple(ids[:32]), block_size=16))
    assert idx.progress["gpu"] == 32
    # Children whose parent is unknown are not keyed, but the engine computed them.
    idx.apply("gpu", BlockStored(block_hashes=(8, 9), parent_block_hash=777, token_ids=tuple(ids[:32]), block_size=16))
    assert idx.progress["gpu"] == 64 and idx.stats("gpu")["orphans"] == 2
    idx.apply("gpu", BlockStored(block_hashes=(3, 4), parent_block_hash=2, token_ids=tuple(ids[32:64]), block_size=16))
    assert idx.progress["gpu"] == 96
    # One block at a time is what a decode step stores: indexed, not counted as prefill.
    idx.apply("gpu", BlockStored(block_hashes=(5,), parent_block_hash=4, token_ids=tuple(ids[64:]), block_size=16))
    assert idx.progress["gpu"] == 96 and idx.num_blocks("gpu") == 5
    assert idx.match_keys(block_keys(ids, 16, chain_seed("m")), 16) == {}  # stale: progress counts anyway
    idx.clear("gpu")
    assert idx.progress["gpu"] == 96  # a count of work done: a clear does not undo it


def test_the_backlog_bound_is_the_brute_force_maximum_over_every_window_of_newest_entries() -> None:
    import random

    from proxy.core.inflight import BacklogBound

    rng = random.Random(13)
    for depth in (1, 3, 50):
        bound = BacklogBound(depth)
        sent: list[tuple[float, int]] = []
        mark = 0
        for _ in range(400):
            mark += rng.choice((0, 0, 16, 512, 4096))
            tokens = float(rng.choice((16, 300, 8000, 30000)))
            bound.append(tokens, mark)
            sent.append((tokens, mark))
            now = mark + rng.choice((0, 100, 5000, 40000))
            for k in (0, 1, 2, depth, depth + 5):
                window = sent[-min(k, depth):] if k else []
                brute = max([sum(t for t, _ in window[j:]) - (now - m) for j, (_t, m) in enumerate(window)] + [0.0])
                assert bound.backlog(k, now) == brute
