"""The request-aware cost (`least_cost`): a request's own prompt length and max_tokens price each backend."""

from __future__ import annotations

from dataclasses import replace

from proxy.core.decision import Inflight, Reason
from proxy.core.policies import LeastCost
from proxy.core.registry import POLICIES
from proxy.core.request import RequestSummary
from proxy.core.score import ScoreConfig, request_cost_s
from proxy.core.snapshot import Health, Signals, Snapshot
from tests.core.helpers import fleet


def _telemetry(snap: Snapshot, running: dict[str, float], waiting: dict[str, float]) -> Snapshot:
    out = [replace(b, health=Health.HEALTHY, stale=False, load_score=0.5,
                   signals=Signals(scraped_at=0.0, running=running[b.name], waiting=waiting[b.name]))
           for b in snap.backends]
    return snap.evolve(out)


def test_least_cost_is_a_policy() -> None:
    assert POLICIES["least_cost"] is not None


def test_long_generations_go_to_the_small_batch_short_ones_to_the_short_queue() -> None:
    # gpu-0: a big batch but nothing waiting; gpu-1: a small batch with a queue.
    snap = _telemetry(fleet(2), running={"gpu-0": 60, "gpu-1": 4}, waiting={"gpu-0": 0, "gpu-1": 2})
    p = LeastCost()
    long = p.pick(RequestSummary(prompt="x", prompt_tokens_est=500, max_tokens=2048), snap, {})
    short = p.pick(RequestSummary(prompt="x", prompt_tokens_est=500, max_tokens=128), snap, {})
    # 2048 tokens: 2048 * 0.012 * 0.01 * 56 = 13.8 s more decode on gpu-0 >> 0.4 s of queue on gpu-1
    assert long.backend == "gpu-1"
    # 128 tokens: 0.86 s more decode on gpu-0 vs 0.4 s of queue... still gpu-1; with a longer queue, gpu-0
    assert short.backend == "gpu-1"
    snap = _telemetry(fleet(2), running={"gpu-0": 60, "gpu-1": 4}, waiting={"gpu-0": 0, "gpu-1": 6})
    assert p.pick(RequestSummary(prompt="x", max_tokens=128), snap, {}).backend == "gpu-0"
    assert p.pick(RequestSummary(prompt="x", max_tokens=2048), snap, {}).backend == "gpu-1"


def test_the_proxys_own_inflight_counts_when_telemetry_lags_or_is_missing() -> None:
    cfg = ScoreConfig()
    stale = request_cost_s(100, 128, None, cfg, inflight_requests=10)
    assert stale > request_cost_s(100, 128, None, cfg, inflight_requests=0)
    lagging = Signals(scraped_at=0.0, running=2.0, waiting=0.0)
    assert request_cost_s(100, 128, lagging, cfg, inflight_requests=10) == stale
    p = LeastCost()
    d = p.pick(RequestSummary(prompt="x", max_tokens=512), fleet(3), {"gpu-0": Inflight(5, 5 * 600), "gpu-1": Inflight(1, 600)})
    assert d.backend == "gpu-2" and d.reason is Reason.BALANCED


def test_a_long_generation_avoids_a_batch_of_long_ones_a_short_one_does_not_care() -> None:
    # Two requests in flight on each: gpu-0's are 2,048-token generations, gpu-1's 128-token ones.
    inflight = {"gpu-0": Inflight(2, 2 * (500 + 2048)), "gpu-1": Inflight(2, 2 * (500 + 128)), "gpu-2": Inflight(3, 3 * 628)}
    snap = fleet(3)
    p = LeastCost()
    assert p.pick(RequestSummary(prompt="x", prompt_tokens_est=500, max_tokens=2048), snap, inflight).backend == "gpu-1"
    # a 128-token request overlaps all of them wholly: fewest requests wins (gpu-0 and gpu-1 tie, rotate)
    picks = {p.pick(RequestSummary(prompt="x", prompt_tokens_est=500, max_tokens=128), snap, inflight).backend
             for _ in range(4)}
    assert picks == {"gpu-0", "gpu-1"}
