"""The lifecycle's pieces fed plain values: one token formula, one duration, one outcome rule, retries."""

from __future__ import annotations

import json

import pytest

from proxy.control.store import SnapshotStore
from proxy.core.decision import Outcome
from proxy.core.retry_policy import RetryConfig
from proxy.core.inflight import InflightTable
from proxy.core.registry import build_policy
from proxy.core.request import RequestSummary
from proxy.core.routing_config import RoutingConfig
from proxy.core.snapshot import BackendSpec, Snapshot
from proxy.dataplane.openai import MAX_JSON_DEPTH, JsonTooDeep, parse_json
from proxy.dataplane.request_ids import request_id_source
from proxy.dataplane.retry import Attempts, RetryController, RetryableFailure
from proxy.dataplane.router import Router, tokens_of
from proxy.metrics import ProxyMetrics


def _router(outcomes: list[tuple[str, Outcome]], grpc: bool = True) -> Router:
    specs = [BackendSpec(name="a", url="http://127.0.0.1:1", grpc_address="127.0.0.1:2" if grpc else None),
             BackendSpec(name="b", url="http://127.0.0.1:3")]
    store = SnapshotStore(Snapshot.initial(specs))
    return Router(store, build_policy(RoutingConfig(policy="round_robin")), InflightTable(), ProxyMetrics(),
                  on_outcome=lambda name, outcome: outcomes.append((name, outcome)))


def _series(metrics: ProxyMetrics) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            if s.name.startswith("affinity_proxy_request"):
                out[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
    return out


async def test_a_lease_charges_one_token_formula_and_counts_from_the_request_head() -> None:
    outcomes: list[tuple[str, Outcome]] = []
    router = _router(outcomes)
    summary = RequestSummary(prompt="x" * 40, max_tokens=7)
    lease = router.route(summary, received_at=0.0)  # a head received long ago (time.monotonic() >> 0)
    lease.try_pick()
    name = lease.decision.backend
    assert lease.tokens == tokens_of(summary) == summary.prompt_tokens_est + 7
    assert router.inflight.get(name).tokens == lease.tokens  # type: ignore[union-attr]
    lease.status = 200
    lease.finish()
    lease.finish()  # idempotent: one release, one record
    assert router.inflight.get(name).requests == 0  # type: ignore[union-attr]
    series = _series(router.metrics)
    assert series[f'affinity_proxy_requests_total{{"backend": "{name}", "status": "200"}}'] == 1
    # The duration counts from received_at, not from the pick.
    assert series[f'affinity_proxy_request_duration_seconds_sum{{"backend": "{name}"}}'] > 1.0
    assert outcomes == [(name, Outcome.SUCCESS)]


async def test_outcomes_client_left_client_deadline_and_backend_failures() -> None:
    outcomes: list[tuple[str, Outcome]] = []
    router = _router(outcomes)
    for status, client_chosen, outcome in ((499, False, None), (504, True, None), (503, False, None),
                                           (503, False, Outcome.RESET)):
        lease = router.route(RequestSummary(prompt=""))
        lease.try_pick()
        lease.status, lease.client_chosen, lease.outcome = status, client_chosen, outcome
        lease.finish()
    # 499 and a client-chosen 504 say nothing of the backend; a 503 is a 5xx; an explicit outcome wins.
    assert [o for _, o in outcomes] == [Outcome.STATUS_5XX, Outcome.RESET]


async def test_grpc_leases_pick_only_backends_with_a_grpc_address() -> None:
    router = _router([])
    picked = set()
    for _ in range(6):
        lease = router.route(RequestSummary(prompt=""), grpc=True)
        lease.try_pick()
        picked.add(lease.decision.backend)
        lease.finish()
    assert picked == {"a"}


def test_attempts_follow_the_shared_policy_and_budget() -> None:
    ctl = RetryController(RetryConfig(max_attempts=2, backoff_base_ms=0, backoff_max_ms=0))
    attempts = Attempts(ctl)
    assert attempts.retry(RetryableFailure(Outcome.CONNECT_FAILURE, None), frozenset({"a"})) == 0
    assert attempts.exclude == {"a"} and attempts.count == 2 and ctl.retried == 1
    # max_attempts reached: no third attempt.
    assert attempts.retry(RetryableFailure(Outcome.CONNECT_FAILURE, None), frozenset({"a", "b"})) is None
    # Not a retryable kind (a mid-stream failure).
    assert Attempts(ctl).retry(RetryableFailure(Outcome.STREAM_FAILURE, None), frozenset({"a"})) is None
    assert Attempts(None).retry(RetryableFailure(Outcome.CONNECT_FAILURE, None), frozenset({"a"})) is None


def test_json_nesting_is_bounded_without_recursion() -> None:
    assert parse_json(b'{"a": [[1]], "s": "' + b"[" * 500 + b'"}') == {"a": [[1]], "s": "[" * 500}
    ok = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert parse_json(ok) is not None
    for depth in (MAX_JSON_DEPTH + 1, 900, 10_000, 100_000):
        with pytest.raises(JsonTooDeep):
            parse_json(b"[" * depth + b"]" * depth)
        with pytest.raises(JsonTooDeep):
            parse_json(b'{"a":' * depth + b"1" + b"}" * depth)


@pytest.mark.parametrize("body", [
    b'{"model":"m","prompt":"hi","max_tokens":16,"temperature":0.7,"stream":false}',
    b'{"a":1,"a":2}', b'{"a":-0.0,"b":-0}', b'{"a":123456789012345678901234567890}', b'{"a":18446744073709551616}',
    b'{"a":"\xc3\xa9 \\u2603 \\ud83d\\ude00"}', b'{"a":1e5,"b":1E-7,"c":0.1}',
    # What msgspec refuses goes to json.loads: json's value, as before.
    b'{"a":NaN,"b":Infinity}', b'{"a":1e400}', b'{"a":"\\ud800"}', b'{"a":"\xed\xa0\x80"}',
])
def test_json_values_are_json_loads_values(body: bytes) -> None:
    import json
    import math

    got, want = parse_json(body), json.loads(body.decode("utf-8", "surrogatepass"))
    assert repr(got) == repr(want)  # same types, same float signs (nan != nan, so compare the spelling)
    assert [type(v) for v in got.values()] == [type(v) for v in want.values()]
    assert all(math.copysign(1, g) == math.copysign(1, w) for g, w in zip(got.values(), want.values())
               if isinstance(g, float) and g == g)


@pytest.mark.parametrize("body", [b'{"a":', b'{"a":1,}', b"{'a':1}", b'{"a":1} x', b'{"a":"\xff"}', b'{"a":"\x01"}'])
def test_json_errors_are_json_loads_errors(body: bytes) -> None:
    import json

    with pytest.raises(ValueError) as got:
        parse_json(body)
    try:
        json.loads(body.decode("utf-8", "surrogatepass"))
    except ValueError as want:
        assert str(got.value) == str(want)  # the 400's message is what it was
    else:
        raise AssertionError("json.loads accepted it")


def test_request_ids_are_unique_within_and_across_processes() -> None:
    first, second = request_id_source(), request_id_source()  # two interpreters draw two prefixes
    ids = {first() for _ in range(10_000)} | {second() for _ in range(10_000)}
    assert len(ids) == 20_000 and all(len(i) == 32 for i in ids)
