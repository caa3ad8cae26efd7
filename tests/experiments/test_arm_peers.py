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


_FOUR = "".join(f"  - {{name: gpu-{i}, url: 'http://127.0.0.1:{9 + i}', models: [m]}}\n" for i in range(4))


def _four(peer_load: str = "") -> str:
    return ("listen: {port: 0}\nadmin: {port: 0}\ntelemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
            f"routing:\n  policy: affinity\n{peer_load}experiments:\n{EXPERIMENT}backends:\n{_FOUR}")


def _route_by_arm(proxy: AffinityProxy, text: str) -> tuple[str, float]:
    """A request the experiment's affinity arm routes (and the data plane then counts live): its backend
    and the queued prefill the process's ledger now holds for that backend."""
    arm = proxy.experiments._by_arm["exp/aff"].policy
    assert arm is not None and arm is not proxy.policy
    p = prompt(text)
    d = arm.pick(p, proxy.store.current, proxy.inflight)
    assert d.backend is not None
    proxy.inflight.acquire(d.backend, p.prompt_tokens_est)
    assert proxy._work is not None
    return d.backend, proxy._work.pending(d.backend, proxy.inflight[d.backend])


def test_an_arms_requests_are_published_with_the_processs_own_load() -> None:
    """With routing.peer_load, the row this process publishes (`_own_load`) holds the arm's live request
    and its ledger entry: the other replicas count the queued prefill an experiment arm sent, as they do
    the main policy's. (Each arm had a ledger of its own that was never published: the other replicas saw
    the request but not its prefill.)"""
    peer = "  peer_load: {redis_url: 'redis://127.0.0.1:1', refresh_ms: 20, key_prefix: t, replica_id: me}\n"
    proxy = AffinityProxy(parse_config(_four(peer)))
    backend, queued = _route_by_arm(proxy, "an arm's long new question " + "q" * 6000)
    assert queued > 1000  # a new prompt: all of it is uncached
    requests, _tokens, pending, entries = proxy._own_load()[backend]  # type: ignore[misc]  # a row with entries
    assert requests == 1 and pending == queued
    assert [tok for _age, tok in entries] == [queued]


def test_the_main_policy_counts_the_prefill_an_arm_queued() -> None:
    """Without peer load too: the main policy and the arms record into one process ledger, so the cost
    check of each reads the prefill the other queued on a backend (the in-flight count it is read
    against includes the other's requests). A ledger per policy read the arm's live request as one of its
    own older entries, or as the average request, not as the 6k-token prefill it is."""
    proxy = AffinityProxy(parse_config(_four()))
    arm = proxy.experiments._by_arm["exp/aff"].policy
    assert arm._work is proxy._work and proxy.policy._work is proxy._work  # type: ignore[union-attr]  # AffinityPolicy
    backend, queued = _route_by_arm(proxy, "another arm's long new question " + "q" * 6000)
    main = proxy.policy._work  # type: ignore[attr-defined]  # AffinityPolicy
    assert main.pending(backend, proxy.inflight[backend]) == queued > 1000


def test_the_ledger_outlives_a_reload() -> None:
    """A reload rebuilds the policies but not the requests in flight: the rebuilt policy reads the prefill
    they queued (a new ledger per reload forgot it until they finished)."""
    proxy = AffinityProxy(parse_config(_four()))
    backend, queued = _route_by_arm(proxy, "a question asked before the reload " + "q" * 6000)
    before = proxy.policy
    proxy.resilience.apply_config(parse_config(_four().replace("policy: affinity\n", "policy: affinity\n  affinity: {epsilon: 0.3}\n", 1)))
    assert proxy.policy is not before
    assert proxy.policy._work.pending(backend, proxy.inflight[backend]) == queued  # type: ignore[attr-defined]
