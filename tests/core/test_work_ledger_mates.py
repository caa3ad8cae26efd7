"""The host-mates' part of the shared load block (issue 13, round 5): each worker's newest ledger entries
in a ring stamped with its refresh epoch, and its live counts, read by the other workers of the host at
once (`SharedInflightTable.mates`, `.mates_recent`), so that a worker's policy merges its mates' entries
as of now rather than as they last published them to Redis."""

from __future__ import annotations

from proxy.core.inflight import SharedInflightTable, SharedLayout, clear_row
from proxy.core.work_ledger import WorkLedger


def _host(rows: int = 3, recent: int = 4) -> tuple[memoryview, SharedLayout, list[SharedInflightTable]]:
    layout = SharedLayout(rows=rows, slots=4, recent=recent)
    buf = memoryview(bytearray(layout.size))
    tables = [SharedInflightTable(buf, layout, r) for r in range(rows)]
    for t in tables:
        t.assign({"a": 0, "b": 1})
    return buf, layout, tables


def _send(table: SharedInflightTable, ledger: WorkLedger, backend: str, uncached: float, tokens: int = 10) -> None:
    ledger.record(backend, uncached, table)
    table.acquire(backend, tokens)


def test_a_worker_reads_its_mates_counts_and_entries_now_newest_first_with_their_ages() -> None:
    _buf, _layout, (w0, w1, w2) = _host()
    l0, l1, l2 = WorkLedger(), WorkLedger(), WorkLedger()
    _send(w1, l1, "a", 100.0)
    w1.tick()  # w1's refresh: its entry is one epoch old
    _send(w2, l2, "a", 200.0)
    _send(w1, l1, "a", 300.0)
    _send(w0, l0, "a", 999.0)  # its own: not a mate's
    assert w0.mates("a") == (3, 30) and w0.mates("b") == (0, 0)
    assert w0.mates_recent("a", 10) == [(0, 300.0), (0, 200.0), (1, 100.0)]  # ties: the lower row first
    assert w0.mates_recent("a", 2) == [(0, 300.0), (0, 200.0)]
    assert w1.mates("a") == (2, 20) and w1.mates_recent("a", 10) == [(0, 999.0), (0, 200.0)]
    assert w0.mates_recent("b", 10) == [] and w0.mates_recent("zzz", 10) == [] and w0.mates("zzz") == (0, 0)
    w1.release("a", 10)
    assert w0.mates("a") == (2, 20)  # the counts are live; the entries stay (the newest K decides)


def test_the_ring_keeps_the_newest_entries_of_each_worker() -> None:
    _buf, _layout, (w0, w1, _w2) = _host(recent=4)
    l1 = WorkLedger()
    for k in range(7):
        _send(w1, l1, "a", float(k))
        w1.tick()
    assert w0.mates_recent("a", 10) == [(1, 6.0), (2, 5.0), (3, 4.0), (4, 3.0)]


def test_a_slot_given_to_another_backend_starts_an_empty_ring_and_a_dead_row_is_cleared() -> None:
    buf, layout, (w0, w1, _w2) = _host()
    l1 = WorkLedger()
    _send(w1, l1, "a", 500.0)
    _send(w1, l1, "b", 40.0)
    w1.release("a", 10)
    for t in (w0, w1):  # "a" leaves the fleet; "c" gets its slot
        t.assign({"b": 1, "c": 0})
    assert w0.mates_recent("c", 10) == [] and w0.mates_recent("b", 10) == [(0, 40.0)]
    clear_row(buf, layout, 1)  # w1 died
    assert w0.mates("b") == (0, 0) and w0.mates_recent("b", 10) == []


def test_the_supervisors_read_only_view_has_no_mates() -> None:
    layout = SharedLayout(rows=2, slots=2)
    view = SharedInflightTable(memoryview(bytearray(layout.size)), layout, None)
    view.assign({"a": 0})
    assert view.mates("a") == (0, 0) and view.mates_recent("a", 5) == []


def test_a_mates_new_entry_or_tick_is_read_at_once() -> None:
    """The last read of a mate's ring is kept until the mate records or ticks (then read again)."""
    _buf, _layout, (w0, w1, _w2) = _host(recent=4)
    l1 = WorkLedger()
    _send(w1, l1, "a", 10.0)
    assert w0.mates_recent("a", 10) == [(0, 10.0)]
    _send(w1, l1, "a", 20.0)
    assert w0.mates_recent("a", 10) == [(0, 20.0), (0, 10.0)]
    w1.tick()
    assert w0.mates_recent("a", 10) == [(1, 20.0), (1, 10.0)]
    assert w0.mates_recent("a", 1) == [(1, 20.0)]
