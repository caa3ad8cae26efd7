"""The shared ledger (routing.peer_load) with a `--workers 2` host (issue 13, rounds 4b and 5): each
worker publishes its own part of the host (its own row of the shared table, its own ledger entries) under
its own id; it reads the other hosts' rows from Redis and its host-mates' counts and entries from the
host's shared block (round 5: instant, and there whether or not the mate's own exchange works). Then
every process's estimate of a backend's queued prefill is the one a single process holding every ledger
entry reads, and its in-flight count is the fleet's, each request counted once. (Before round 4b: a
--workers host published its sums only, and its own workers read the sum of each one's newest k_w: not
additive, loadtest/results/scaleout.md; without routing.peer_load they still do without KV events.)"""

from __future__ import annotations

from typing import Any

from proxy.control.peer_load import encode_row, host_view, merge_rows, own_load, worker_replica_id
from proxy.core.affinity import AffinityPolicy
from proxy.core.decision import Inflight, Reason
from proxy.core.inflight import InflightTable, SharedInflightTable, SharedLayout
from proxy.core.routing_config import RoutingConfig
from proxy.core.work_ledger import WorkLedger
from tests.core.helpers import fleet, home_order, prompt

# (epoch, process, uncached tokens, still live) sent to one backend, in order: worker 0's first request
# (a 50k-token first turn) is still decoding; of the short ones after it, the last three are live.
SENDS = [(0, "w0", 50000.0, True), (1, "w1", 600.0, False), (2, "B", 500.0, False), (3, "w1", 400.0, True),
         (4, "B", 300.0, True), (5, "w0", 200.0, True)]
TOKENS = 1000  # in-flight tokens per request


class _World:
    """One host of two workers (a shared load block) and one plain replica B, plus the reference: one
    process that routed every request itself."""

    def __init__(self, backend: str, names: list[str]) -> None:
        self.backend = backend
        self.names = names
        layout = SharedLayout(rows=2, slots=8)  # the host's load block (a memfd in the proxy)
        buf = memoryview(bytearray(layout.size))
        self.tables = {"w0": SharedInflightTable(buf, layout, 0), "w1": SharedInflightTable(buf, layout, 1),
                       "B": InflightTable()}
        for t in (self.tables["w0"], self.tables["w1"]):
            assert isinstance(t, SharedInflightTable)
            t.assign({n: i for i, n in enumerate(names)})
        self.ledgers = {w: WorkLedger() for w in self.tables}
        self.one, self.one_table = WorkLedger(), InflightTable()
        epoch = 0
        for at, who, tokens, live in SENDS:
            while epoch < at:
                for led in (self.one, *self.ledgers.values()):
                    led.tick()
                for t in (self.tables["w0"], self.tables["w1"]):
                    assert isinstance(t, SharedInflightTable)
                    t.tick()  # the epoch of the shared block's entries, ticked with the ledger by own_load
                epoch += 1
            for led, table in ((self.one, self.one_table), (self.ledgers[who], self.tables[who])):
                led.record(backend, tokens, table)
                table.acquire(backend, TOKENS)
                if not live:
                    table.release(backend, TOKENS)

    def rows(self) -> dict[str, str]:
        """Every process's published row after two refreshes (each ledger ticked once per refresh, as
        `own_load` does): on the second each knows how many entries the fleet's newest K may take of it."""
        seen: dict[str, Any] = {w: None for w in self.tables}
        for _ in range(2):
            self.one.tick()
            rows = {w: encode_row(own_load(self.ledgers[w], self.tables[w], self.names, seen[w])) for w in self.tables}
            seen = views(rows)
        return rows


HOST = {"w0": "a", "w1": "a", "B": "B"}


def views(rows: dict[str, str]) -> dict[str, dict[str, Any]]:
    """What each process reads from Redis: every other host's rows (a worker's exchange skips its
    host-mates', `peer_load._EXCHANGE`), for a worker with an empty entry for each of its backends
    none of them published (`host_view`)."""
    out: dict[str, dict[str, Any]] = {}
    for w in rows:
        merged = merge_rows([row for o, row in rows.items() if HOST[o] != HOST[w]])
        out[w] = merged if w == "B" else host_view(merged, merge_rows([rows[w]]))
    return out


def test_each_process_reads_the_one_ledger_estimate_and_counts_each_request_once() -> None:
    world = _World("gpu", ["gpu", "other"])
    rows = world.rows()
    w0, w1, b = world.tables["w0"], world.tables["w1"], world.tables["B"]
    # The reference: 4 live requests, the fleet's newest 4 entries are 200, 300, 400 and 500.
    one = world.one.pending("gpu", world.one_table["gpu"])
    assert world.one_table["gpu"].requests == 4 and one == 1400.0
    # A worker publishes its own part: its own row of the shared table, not the host's sum.
    assert w0["gpu"].requests == 3 and w0.own("gpu") == Inflight(2, 2 * TOKENS)
    for who, view in views(rows).items():
        merged, pending = AffinityPolicy._with_peers(view, world.tables[who], world.ledgers[who])
        assert merged["gpu"].requests == 4 and merged["gpu"].tokens == 4 * TOKENS, who  # no double count
        assert pending("gpu", merged["gpu"]) == one, who
    # The host-wide table alone (no peer load, no KV events) reads the sum of each worker's newest k_w:
    # the old decoding 50k-token request counted as queued prefill (with KV events a worker reads the
    # host's newest K from the shared block: tests/core/test_work_ledger_progress.py).
    assert world.ledgers["w0"].pending("gpu", w0["gpu"]) == 50000.0 + 200.0 + 400.0


def test_a_host_alone_reads_its_workers_entries_as_one_process() -> None:
    """R = 1 x W = 2 with routing.peer_load on: no other host's row, the host-mate's entries from the
    shared block make the workers' estimate the single process's."""
    world = _World("gpu", ["gpu"])
    rows = world.rows()
    # Without B: drop its request from the reference by reading the host's own entries only.
    host_only = WorkLedger()
    for _at, who, tokens, _live in SENDS:
        if who != "B":
            host_only.record("gpu", tokens)
    view = host_view({}, merge_rows([rows["w0"]]))
    assert view  # fresh and not empty: the policy reads it (an empty view reads as none)
    for who in ("w0", "w1"):
        merged, pending = AffinityPolicy._with_peers(view, world.tables[who], world.ledgers[who])
        assert merged["gpu"].requests == 3, who
        assert pending("gpu", merged["gpu"]) == host_only.pending("gpu", Inflight(3, 3 * TOKENS)) == 1200.0, who


def test_a_mate_without_a_row_in_redis_still_counts() -> None:
    """A worker whose exchange with Redis fails (its row expired after its TTL) used to vanish from its
    host-mates' load: they counted their own row of the shared table plus the rows in Redis. Now the
    mates' counts and entries come from the shared block: w0 reads only B's row and still sees w1's
    live requests and their prefill, now, the one-ledger estimate (round 4b's code: 2 requests, 700)."""
    world = _World("gpu", ["gpu", "other"])
    rows = world.rows()
    one = world.one.pending("gpu", world.one_table["gpu"])
    view = host_view(merge_rows([rows["B"]]), merge_rows([rows["w0"]]))  # no row of w1 anywhere
    merged, pending = AffinityPolicy._with_peers(view, world.tables["w0"], world.ledgers["w0"])
    assert merged["gpu"].requests == 4 and merged["gpu"].tokens == 4 * TOKENS
    assert pending("gpu", merged["gpu"]) == one == 1400.0
    # And a request w1 sends now, before any refresh, is in w0's next pick at once.
    w1 = world.tables["w1"]
    world.ledgers["w1"].record("other", 900.0, w1)
    w1.acquire("other", TOKENS)
    merged, pending = AffinityPolicy._with_peers(view, world.tables["w0"], world.ledgers["w0"])
    assert merged["other"].requests == 1 and pending("other", merged["other"]) == 900.0


def test_the_workers_policy_keeps_a_new_prompt_home_where_the_host_sums_move_it() -> None:
    snap = fleet(4)
    p = prompt("a new question for the host's workers " + "n" * 2000)
    home = home_order(p, snap)[0]
    world = _World(home, list(snap.names))
    rows = world.rows()
    # The other backends busy elsewhere (so that the request bound lets the home take one more).
    others = {n: (3, 300, 0.0, ((0, 0.0), (0, 0.0), (0, 0.0))) for n in snap.names if n != home}
    view = {**merge_rows([rows["B"]]), **others}  # w0's view: the other host; its mate w1 from the block
    pol = AffinityPolicy(RoutingConfig(), work=world.ledgers["w0"], peers=lambda: view)
    d = pol.pick(p, snap, world.tables["w0"])
    assert d.backend == home and d.reason is Reason.HASH
    # Rows without entries (the sums only: an older replica's, or round 4's --workers host's).
    world = _World(home, list(snap.names))  # afresh: the pick above recorded its request
    rows = world.rows()
    sums = {n: v[:3] for n, v in {**merge_rows([rows["B"]]), **others}.items()}
    old = AffinityPolicy(RoutingConfig(), work=world.ledgers["w0"], peers=lambda: sums)
    d2 = old.pick(p, snap, world.tables["w0"])
    assert d2.backend != home and d2.reason is Reason.OVERLOAD_FALLBACK


def test_worker_ids_name_the_host_and_the_worker() -> None:
    assert worker_replica_id("host-a", None) == "host-a"
    assert worker_replica_id("host-a", 1) == "host-a/1"
