"""A multi-turn conversation stays on its backend under affinity, unless the bounded-load rule sheds a turn.

The core-level reproduction of the live A/B check (tests/experiments/test_ab_live.py): the same chat
shape (a system prompt, a first user turn naming the conversation, then assistant + user turns appended
turn by turn), every conversation's turns in order, conversations concurrently, through the affinity
policy with the data plane's in-flight accounting fed back; half the conversations routed by round robin
into the same in-flight table, as the experiment's other arm is.

What moved conversations in the live run since the round-12 merges is not a routing change (this file
passes on the code before and after them): the new HTTP/1.1 server lets the simulator's engine steps
synchronise the clients into waves, so each wave's first picks see a nearly empty fleet, where the request
cap ceil((1 + request_epsilon) * (fleet in-flight + 1) / N) is 2 for a third request on one backend of
four. `test_wave_starts_shed_only_by_the_request_cap` reproduces exactly that.
"""

from __future__ import annotations

import collections
import math
import random
from collections import deque
from typing import Iterator

import pytest

from proxy.core.affinity import AffinityPolicy
from proxy.core.decision import Decision, Inflight, Reason
from proxy.core.policies import RoundRobin
from proxy.core.request import RequestSummary, summary_from_openai
from proxy.core.routing_config import AffinityConfig, RoutingConfig
from proxy.core.snapshot import Snapshot

from .helpers import Ledger, fleet, home_order

SYSTEM = "You are a concise assistant. Answer in one short paragraph."
EPS_R = AffinityConfig().request_epsilon


def turn(conv: int, t: int, opening: str = "") -> RequestSummary:
    """Turn `t` of conversation `conv`: the live test's messages (tests/experiments/helpers.py)."""
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Conversation {conv}: tell me about rivers number {conv}.{opening}"}]
    for k in range(1, t + 1):
        msgs.append({"role": "assistant", "content": f"Here is part {k} about rivers {conv}. " * 3})
        msgs.append({"role": "user", "content": f"Go on with part {k + 1}, please."})
    return summary_from_openai("/v1/chat/completions", {"model": "m", "max_tokens": 2, "messages": msgs})


def cost(req: RequestSummary) -> int:
    """What the data plane charges a request in the in-flight table (proxy/dataplane/router.tokens_of)."""
    return req.prompt_tokens_est + (req.max_tokens or 0)


def at_cap(inflight: dict[str, Inflight], name: str, n: int) -> bool:
    """The bounded-load rule's request cap (equal weights): `name` cannot take one more request."""
    total = sum(i.requests for i in inflight.values())
    mine = inflight[name].requests if name in inflight else 0
    return mine + 1 > math.ceil((1 + EPS_R) * (total + 1) / n - 1e-9)


class Run:
    """Conversations `turns` turns each, every other one in the round-robin arm; `order` yields the
    turns as a client would send them, `complete` chooses which in-flight requests finish."""

    def __init__(self, n_convs: int, turns: int = 5, *, opening: str = "", snap: Snapshot | None = None) -> None:
        self.snap = snap if snap is not None else fleet(4)
        self.affinity = AffinityPolicy(RoutingConfig())
        self.rr = RoundRobin(RoutingConfig())
        self.ledger = Ledger()
        self.turns = turns
        self.opening = opening
        self.n_convs = n_convs
        # conv -> [(turn, decision, home at cap when picked)]
        self.seen: dict[int, list[tuple[int, Decision, bool]]] = collections.defaultdict(list)

    def pick(self, conv: int, t: int) -> tuple[str, int]:
        req = turn(conv, t, self.opening)
        if conv % 2:
            d = self.rr.pick(req, self.snap, self.ledger.inflight)
        else:
            home = home_order(req, self.snap)[0]
            capped = at_cap(self.ledger.inflight, home, len(self.snap.names))
            d = self.affinity.pick(req, self.snap, self.ledger.inflight)
            self.seen[conv].append((t, d, capped))
        self.ledger.start(d, cost(req))
        return d.backend, cost(req)

    def steady(self, concurrency: int) -> None:
        """A FIFO queue of client turns (a conversation's next turn queues behind the others), at most
        `concurrency` in flight, the oldest finishing first: a fleet under steady load."""
        waiting: deque[tuple[int, int]] = deque((c, 0) for c in range(self.n_convs))
        live: deque[tuple[int, int, str, int]] = deque()
        while waiting or live:
            while waiting and len(live) < concurrency:
                c, t = waiting.popleft()
                live.append((c, t, *self.pick(c, t)))
            c, t, backend, tokens = live.popleft()
            self.ledger.finish(backend, tokens)
            if t + 1 < self.turns:
                waiting.append((c, t + 1))

    def waves(self, size: int, seed: int) -> None:
        """`size` requests picked one after the other, in an order shuffled by a seeded generator (the
        order they reach the proxy), then all of them finish together (an engine step ending every
        request of the batch), then the next wave: the shape of the live run."""
        rng = random.Random(seed)
        pending = deque((c, 0) for c in range(self.n_convs))
        while pending:
            wave = [pending.popleft() for _ in range(min(size, len(pending)))]
            rng.shuffle(wave)
            picked = [(c, t, *self.pick(c, t)) for c, t in wave]
            for c, t, backend, tokens in picked:
                self.ledger.finish(backend, tokens)
                if t + 1 < self.turns:
                    pending.append((c, t + 1))

    def affinity_backends(self) -> Iterator[tuple[int, set[str]]]:
        for conv, picks in self.seen.items():
            yield conv, {d.backend for _, d, _ in picks}


@pytest.mark.parametrize("concurrency", [1, 4, 16, 64])
def test_a_growing_conversation_stays_on_its_backend(concurrency):
    """Short chats (hash placement every turn): idle, lightly and heavily loaded fleets."""
    run = Run(400)
    run.steady(concurrency)
    assert len(run.seen) == 200 and all(len(p) == 5 for p in run.seen.values())
    moved = {c: b for c, b in run.affinity_backends() if len(b) > 1}
    assert not moved, moved
    reasons = collections.Counter(d.reason for p in run.seen.values() for _, d, _ in p)
    assert set(reasons) == {Reason.HASH}, reasons
    assert len({next(iter(b)) for _, b in run.affinity_backends()}) == 4  # and they spread over the fleet


@pytest.mark.parametrize("concurrency", [1, 16])
def test_a_long_conversation_follows_its_prefix_and_stays(concurrency):
    """A first turn long enough for the prefix index (> min_prefix_blocks blocks): once the turns before
    hold a run of whole blocks past the first user turn (the fourth turn here), each turn is a prefix hit
    on the backend that served them, and the cost check, which sees that backend holding most of the
    prompt, keeps it there."""
    run = Run(200, opening=" Some background: " + "the river bends past the old mill. " * 40)
    run.steady(concurrency)
    moved = {c: b for c, b in run.affinity_backends() if len(b) > 1}
    assert not moved, moved
    for picks in run.seen.values():
        assert [d.reason for _, d, _ in picks] == [Reason.HASH] * 3 + [Reason.PREFIX_HIT] * 2
        assert all(d.prefix_blocks_matched > 0 for _, d, _ in picks[3:])
    assert len({next(iter(b)) for _, b in run.affinity_backends()}) == 4


@pytest.mark.parametrize("seed", range(4))
def test_wave_starts_shed_only_by_the_request_cap(seed):
    """The live run's shape: waves of 16 requests that finish together. A wave's third request for one
    backend sees it holding 2 of a fleet's 2 in flight: 3 > ceil(2.5 * 3 / 4) = 2, so the bounded-load
    rule sheds that turn (OVERLOAD_FALLBACK). Every turn is either on the conversation's home or shed
    while the home was at its cap, and the conversation is back home on its next turn under the cap."""
    run = Run(400)
    run.waves(16, seed)
    shed = 0
    for conv, picks in run.seen.items():
        home = home_order(turn(conv, 0), run.snap)[0]
        for t, d, capped in picks:
            if d.backend == home:
                assert d.reason is Reason.HASH and not capped
            else:
                assert d.reason is Reason.OVERLOAD_FALLBACK and capped, (conv, t, d)
                shed += 1
    assert 0 < shed < 0.05 * 1000  # the mechanism is real, and rare


def test_one_turn_at_the_cap_is_shed_and_the_next_comes_back():
    """The smallest case: two requests in flight, both on the conversation's home, none elsewhere."""
    pol, snap = AffinityPolicy(RoutingConfig()), fleet(4)
    first = pol.pick(turn(7, 0), snap, {})
    home = first.backend
    assert first.reason is Reason.HASH and home == home_order(turn(7, 0), snap)[0]
    assert pol.pick(turn(7, 1), snap, {home: Inflight(requests=1)}).backend == home  # 2 <= ceil(2.5*2/4)
    shed = pol.pick(turn(7, 2), snap, {home: Inflight(requests=2)})  # 3 > ceil(2.5*3/4) = 2
    assert shed.backend != home and shed.reason is Reason.OVERLOAD_FALLBACK
    # Two in flight on the home among five in the fleet: 3 <= ceil(2.5*6/4) = 4, the turn stays.
    others = [n for n in snap.names if n != home]
    loaded = {home: Inflight(requests=2), others[0]: Inflight(requests=2), others[1]: Inflight(requests=1)}
    assert pol.pick(turn(7, 3), snap, loaded).backend == home
    back = pol.pick(turn(7, 4), snap, {})
    assert back.backend == home and back.reason is Reason.HASH
