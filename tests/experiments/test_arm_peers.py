"""An experiment arm's policy is built with what the main policy reads (issue 13): with routing.peer_load
on, an arm's affinity policy counts the other replicas' published load exactly as the main one does (a
backend they filled is left), and with KV events it gets the precise lookup. Against a real redis-server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.control.peer_load import PeerLoadExchange
from proxy.core.decision import Reason
from proxy.core.routing_config import PeerLoadConfig
from sim.tokenizer import TOKENIZER_DIR
from tests.core.helpers import fleet, home_order, prompt
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401  # the fixture
from tests.support.wait import until

EXPERIMENT = """\
  definitions:
    - name: exp
      control: base
      arms:
        - {name: base, routing: {policy: round_robin}}
        - {name: aff, share: 0.5, routing: {policy: affinity}}
"""


def _yaml(redis_url: str, prefix: str, extra: str = "") -> str:
    return ("listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\nhealth_checks: {enabled: false}\n"
            f"routing:\n  policy: affinity\n  peer_load: {{redis_url: '{redis_url}', refresh_ms: 20, "
            f"key_prefix: '{prefix}', replica_id: me}}\n"
            f"experiments:\n{EXPERIMENT}"
            "backends:\n  - {name: b0, url: 'http://127.0.0.1:1', models: [m]}\n" + extra)


async def test_an_arms_affinity_policy_sees_the_peers_load(redis_server: RedisServer) -> None:  # noqa: F811
    snap = fleet(4)
    p = prompt("a fresh question for the peers " + "q" * 3000)
    home = home_order(p, snap)[0]
    prefix = f"test:{redis_server.port}"
    proxy = AffinityProxy(parse_config(_yaml(redis_server.url, prefix)))
    arm = proxy.experiments._by_arm["exp/aff"].policy
    assert arm is not None and arm is not proxy.policy
    other = PeerLoadExchange(PeerLoadConfig(redis_url=redis_server.url, refresh_ms=20, key_prefix=prefix,
                                            replica_id="other"),
                             lambda: {home: (3, 9000, 30000.0)}, registry=CollectorRegistry())
    await proxy.start()
    await other.start()
    try:
        assert proxy.peer_load is not None
        assert await until(lambda: proxy.peer_load.peers() == {home: (3, 9000, 30000.0)}, timeout=5)
        main = proxy.policy.pick(p, snap, {})
        assert main.backend != home and main.reason is Reason.OVERLOAD_FALLBACK
        d = arm.pick(p, snap, {})  # the arm's policy: the same peers, the same decision
        assert (d.backend, d.reason) == (main.backend, main.reason)
    finally:
        await other.stop()
        await proxy.stop()


def test_an_arms_affinity_policy_gets_the_precise_lookup(redis_server: RedisServer) -> None:  # noqa: F811
    kv = ("telemetry:\n  kv_events:\n    tokenizers: {m: '%s'}\n    backends:\n      b0: {endpoint: 'tcp://127.0.0.1:5557'}\n"
          % TOKENIZER_DIR)
    proxy = AffinityProxy(parse_config(_yaml(redis_server.url, "unused", kv)))
    assert proxy.precise is not None
    arm = proxy.experiments._by_arm["exp/aff"].policy
    assert arm is not None and arm._precise is proxy.precise.matcher  # type: ignore[attr-defined]  # AffinityPolicy
