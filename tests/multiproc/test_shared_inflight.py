"""The host-wide load block: rows per worker summed by every reader, the work ledger's queued prefill,
slots that follow the backend set, and exact sums under two processes writing at once."""

from __future__ import annotations

import select
import subprocess
import sys
import textwrap
import time
from typing import IO, Sequence

import pytest

from proxy.core.affinity import AffinityPolicy
from proxy.core.decision import Inflight, Reason
from proxy.core.inflight import InflightTable, SharedInflight, SharedInflightTable, SharedLayout
from proxy.core.request import RequestSummary
from proxy.core.work_ledger import WorkLedger
from proxy.multiproc.shared_load import SharedLoad, SlotMap
from tests.core.helpers import fleet


def _tables(rows: int = 2, slots: int = 8, names: tuple[str, ...] = ("a", "b")) -> list[SharedInflightTable]:
    layout = SharedLayout(rows=rows, slots=slots)
    buf = memoryview(bytearray(layout.size))
    tables = [SharedInflightTable(buf, layout, row) for row in range(rows)]
    tables.append(SharedInflightTable(buf, layout, None))
    for t in tables:
        t.assign({n: i for i, n in enumerate(names)})
    return tables


def test_every_reader_sees_the_sum_of_every_workers_row() -> None:
    w0, w1, view = _tables()
    w0.acquire("a", 100)
    w0.acquire("a", 50)
    w1.acquire("a", 7)
    w1.acquire("b", 1)
    for t in (w0, w1, view):
        assert (t["a"].requests, t["a"].tokens) == (3, 157)
        assert t.requests("b") == 1 and t.total_requests == 4
        assert isinstance(t.get("a"), SharedInflight) and t.get("zzz") is None
    w0.release("a", 100)
    w1.release("b", 1)
    assert (view["a"].requests, view["a"].tokens, view.total_requests) == (2, 57, 2)
    with pytest.raises(RuntimeError):
        view.acquire("a", 1)
    with pytest.raises(AttributeError):
        view.total_requests = 3


def test_queued_prefill_is_each_workers_ledger_estimate_summed() -> None:
    w0, w1, view = _tables()
    single = WorkLedger()
    # Worker 0 routes a 1000-token uncached prefill to "a", worker 1 a 300-token one (record, then acquire).
    for table, uncached, tokens in ((w0, 1000.0, 1200), (w1, 300.0, 400)):
        WorkLedger().record("a", uncached, table)
        table.acquire("a", tokens)
        single.record("a", uncached)
    entry = view["a"]
    assert isinstance(entry, SharedInflight) and entry.queued == 1300.0
    # Any worker's policy reads the whole host's queue, as one process's ledger would.
    assert WorkLedger().pending("a", entry) == single.pending("a", Inflight(requests=2, tokens=1600)) == 1300.0
    w0.release("a", 1200)
    assert entry.queued == 300.0
    w1.release("a", 400)
    assert entry.queued == 0.0 and WorkLedger().pending("b", view["b"]) == 0.0


def _doc(i: int, words: int) -> RequestSummary:
    return RequestSummary(prompt=f"document {i} " + " ".join(f"w{i}x{j}" for j in range(words)))


def _route(prompts: list[RequestSummary], policies: list[AffinityPolicy],
           tables: Sequence[InflightTable]) -> list[tuple[str, Reason]]:
    """Request i goes to worker i % len(policies); requests finish oldest first, two after every fourth."""
    snap = fleet(4)
    live: list[tuple[int, str, int]] = []
    out = []
    for i, req in enumerate(prompts):
        w = i % len(policies)
        d = policies[w].pick(req, snap, tables[w])
        tokens = req.prompt_tokens_est
        tables[w].acquire(d.backend, tokens)
        live.append((w, d.backend, tokens))
        out.append((d.backend, d.reason))
        if i % 4 == 3:
            for _ in range(2):
                w_old, b_old, t_old = live.pop(0)
                tables[w_old].release(b_old, t_old)
    return out


def test_two_workers_on_the_shared_table_decide_like_one_process() -> None:
    """Distinct prompts (nothing a worker learned could matter) of very different sizes, so the cost check
    and the bounded-load rule decide on the queued work: split over two workers on the shared table, every
    decision is the single process's; on tables of their own, they are not."""
    names = fleet(4).names
    prompts = [_doc(i, 30 if i % 3 else 3000) for i in range(60)]
    one = _route(prompts, [AffinityPolicy()], [InflightTable()])
    assert sum(1 for _, r in one if r is Reason.OVERLOAD_FALLBACK) >= 5  # the load really decided
    shared = _route(prompts, [AffinityPolicy(), AffinityPolicy()], _tables(names=names)[:2])
    assert shared == one
    apart = _route(prompts, [AffinityPolicy(), AffinityPolicy()], [InflightTable(), InflightTable()])
    assert apart != one


def test_backends_added_and_removed_at_run_time_get_and_free_slots() -> None:
    load = SharedLoad.create(workers=2, slots=3)
    slots = SlotMap(load)
    assert slots.follow(["a", "b"]) and slots.slots == {"a": 0, "b": 1}
    w0 = load.table(0)
    w0.assign(slots.slots)
    w0.acquire("b", 10)
    # "b" leaves the fleet while worker 0 still has a request on it; "c" and "d" arrive.
    assert slots.follow(["a", "c", "d"])
    assert slots.slots == {"a": 0, "c": 2}  # the never-used slot first; b's slot is still busy
    w0.assign(slots.slots)
    assert w0["b"].requests == 1  # its live request keeps its slot in this worker until it finishes
    w0.release("b", 10)
    assert "b" not in w0
    assert slots.follow(["a", "c", "d"]) and slots.slots["d"] == 1  # now idle: reused
    w0.assign(slots.slots)
    w0.acquire("d", 5)
    assert load.table(None).__class__ is SharedInflightTable
    view = load.table(None)
    view.assign(slots.slots)
    assert view["d"].requests == 1 and view.total_requests == 1


def test_a_backend_without_a_slot_is_counted_in_its_worker() -> None:
    load = SharedLoad.create(workers=1, slots=1)
    slots = SlotMap(load)
    slots.follow(["a", "b"])
    assert slots.slots == {"a": 0}
    w = load.table(0)
    w.assign(slots.slots)
    w.acquire("b", 3)
    assert w["b"].requests == 1 and w.total_requests == 1
    WorkLedger().record("b", 30.0, w)
    assert w.queued_local("b") == 30.0
    w.release("b", 3)
    assert w.total_requests == 0


_HAMMER = textwrap.dedent(
    """
    import sys
    from proxy.core.inflight import SharedLayout
    from proxy.multiproc.shared_load import SharedLoad
    fd, row, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    t = SharedLoad.attach(fd, SharedLayout(rows=2, slots=4)).table(row)
    t.assign({"a": 0, "b": 1})
    for i in range(rounds):
        t.acquire("a", 3)
        t.acquire("b", 5)
        t.release("a", 3)
        if i % 2:
            t.release("b", 5)
    # left in flight: rounds // 2 on "b" (plus one more when rounds is odd)
    print("done", flush=True)
    sys.stdin.read()  # hold the mapping until the test has read the sums
    """
)


def test_two_processes_writing_at_once_leave_exact_sums() -> None:
    load = SharedLoad.create(workers=2, slots=4)
    view = load.table(None)
    view.assign({"a": 0, "b": 1})
    rounds = 20_001
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _HAMMER, str(load.fd), str(row), str(rounds)],
            pass_fds=(load.fd,), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        for row in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        pending: set[IO[str]] = {p.stdout for p in procs if p.stdout is not None}
        reads = 0
        while pending and time.monotonic() < deadline:
            total = view.total_requests  # read while both write
            assert 0 <= total <= 2 * (rounds + 2)  # never torn, whatever the interleaving
            reads += 1
            ready, _, _ = select.select(list(pending), [], [], 0)
            for out in ready:
                assert out.readline().strip() == "done"
                pending.discard(out)
        assert not pending and reads > 0
        held = 2 * (rounds // 2 + 1)
        assert (view["a"].requests, view["a"].tokens) == (0, 0)
        assert (view["b"].requests, view["b"].tokens) == (held, 5 * held)
        assert view.total_requests == held
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
            p.wait(timeout=30)


def test_recent_work_estimates_like_the_ledgers_deque() -> None:
    import random
    from collections import deque

    from proxy.core.inflight import RecentWork, newest_sum

    rng = random.Random(7)
    recent, entries = RecentWork(depth=16), deque(maxlen=16)  # type: ignore[var-annotated]
    for _ in range(200):
        x = rng.randrange(0, 40_000) / 4  # token estimates are quarter tokens (bytes / 4)
        recent.append(x)
        entries.append(x)
        for live in (0, 1, 5, 16, 17, 40):
            for tokens in (0, 12_345):
                assert recent.estimate(live, tokens) == newest_sum(entries, live, tokens)
