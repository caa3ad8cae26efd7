"""routing.peer_load through the app: off by default (the policy gets no peers input), and a reload turns
it on (the rebuilt policy reads the other replicas' load), changes it (restarted) or off again."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.control.peer_load import PeerLoadExchange
from proxy.core.decision import Reason
from proxy.core.routing_config import PeerLoadConfig
from tests.core.helpers import home_order, prompt
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401  # the fixture
from tests.support.wait import until

_BASE = ("listen: {port: 0}\nadmin: {port: 0}\ntelemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
         "backends:\n" + "".join(f"  - {{name: gpu-{i}, url: 'http://127.0.0.1:{9 + i}'}}\n" for i in range(4)))


def _with_peer_load(url: str | None, replica: str = "me") -> str:
    if url is None:
        return _BASE + "routing: {policy: affinity}\n"
    return _BASE + (f"routing:\n  policy: affinity\n  peer_load: {{redis_url: '{url}', refresh_ms: 20, "
                    f"key_prefix: t, replica_id: {replica}}}\n")


async def test_a_reload_turns_the_peer_load_on_changes_it_and_off(redis_server: RedisServer) -> None:
    proxy = AffinityProxy(parse_config(_with_peer_load(None)))
    await proxy.start()
    p = prompt("a fresh question for the peers " + "q" * 3000)
    snap = proxy.store.current
    home = home_order(p, snap)[0]
    other = PeerLoadExchange(PeerLoadConfig(redis_url=redis_server.url, refresh_ms=20, key_prefix="t",
                                            replica_id="other"),
                             lambda: {home: (3, 9000, 30000.0)}, registry=CollectorRegistry())
    await other.start()
    try:
        exchange = proxy.peer_load
        assert exchange is not None and exchange.peers() is None
        assert proxy.policy.pick(p, snap, proxy.inflight).backend == home  # off: no peers input
        proxy.resilience.apply_config(parse_config(_with_peer_load(redis_server.url)))
        assert await until(lambda: exchange.peers() == {home: (3, 9000, 30000.0)}, timeout=5)
        # The rebuilt policy (fresh learned state) reads the peer's load on the prompt's home: moved off.
        d = proxy.policy.pick(p, snap, proxy.inflight)
        assert d.backend != home and d.reason is Reason.OVERLOAD_FALLBACK
        # A changed section restarts the exchange (a new replica id); the view comes back.
        proxy.resilience.apply_config(parse_config(_with_peer_load(redis_server.url, "me-too")))
        assert await until(lambda: exchange.replica_id == "me-too" and exchange.peers() is not None, timeout=5)
        # Off again: the policy is rebuilt without peers and the exchange stops.
        proxy.resilience.apply_config(parse_config(_with_peer_load(None)))
        assert await until(lambda: exchange.peers() is None and exchange._task is None, timeout=5)
        d = proxy.policy.pick(p, snap, proxy.inflight)
        assert d.backend == home and d.reason is Reason.HASH
    finally:
        await other.stop()
        await proxy.stop()
