"""A 50/50 experiment of `affinity` vs `round_robin` through the proxy, on the simulator, multi-turn chats.

Checked against the client's own view: every conversation stays in one arm, the shares are 50% +/- 5 over
2,000 requests, a second replica with the same config assigns identically, and the per-arm series count
exactly what the client sent and what the backends' usage reported. In the affinity arm every turn of a
conversation goes to its backend unless the bounded-load rule shed it: the simulator's engine steps end
the requests of a batch together, so the clients arrive in waves and a wave's first picks see a nearly
empty fleet, where the request cap is ceil(2.5 * 3 / 4) = 2 for a third request on one backend of four
(reproduced at the core level in tests/core/test_sticky_conversations.py).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import AsyncIterator

import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.core.affinity import rendezvous_order
from proxy.core.experiments import assign, assignment_key, assignment_point, experiment_seed
from proxy.core.decision import Decision, Reason
from proxy.core.fingerprint import Fingerprinter
from proxy.core.request import RequestSummary, summary_from_openai
from proxy.experiments.runtime import ArmRuntime
from loadtest.policy_spy import spy_on_policy
from sim.fleet import Fleet, start_fleet
from tests.experiments.helpers import admin_json, body, conversations, proxy_yaml, run_turns, sample, scrape

AB = """  evaluate_every_s: 1
  definitions:
    - name: policy-ab
      control: affinity
      arms:
        - {name: affinity}
        - {name: rr, share: 0.5, routing: {policy: round_robin}}
"""


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(4, host="127.0.0.1", port=0, speed=50.0)
    yield f
    await f.stop()


def spy(proxy: AffinityProxy) -> dict[bytes, list[str]]:
    """Record the arm of every routed request, by assignment key (the runtime's own answer)."""
    seen: dict[bytes, list[str]] = defaultdict(list)
    runtime = proxy.experiments
    real = runtime.arm_for

    def arm_for(summary: RequestSummary) -> ArmRuntime | None:
        arm = real(summary)
        if arm is not None:
            seen[assignment_key(summary)].append(arm.name)
        return arm

    runtime.arm_for = arm_for  # type: ignore[method-assign]  # a test spy on the runtime's answer
    return seen


def decisions(proxy: AffinityProxy) -> list[tuple[str, Decision, dict[str, int]]]:
    """Record every pick of the router's own policy (the affinity arm's): the prompt, the decision and the
    in-flight requests per backend the policy read (the table before this request's slot is taken)."""
    out: list[tuple[str, Decision, dict[str, int]]] = []
    spy_on_policy(proxy.router, lambda summary, decision, before: out.append((summary.prompt, decision, before)))
    return out


async def test_fifty_fifty_affinity_vs_round_robin(fleet: Fleet) -> None:
    model = fleet.servers[0].backend.engine.model_name
    config = parse_config(proxy_yaml(fleet, AB))
    exp = config.experiments.definitions[0]
    seed = experiment_seed(exp.name)
    first = AffinityProxy(config)
    second = AffinityProxy(config)  # a second replica with the same configuration
    await first.start()
    await second.start()
    try:
        seen = spy(first)
        seen2 = spy(second)
        picks = decisions(first)
        convs = conversations(400, 5)
        replies = await run_turns(first.http_url, model, convs)
        assert len(replies) == 2000 and all(r.status == 200 for r in replies)

        # The arm the pure core gives each conversation (its first turn's key); the proxy's answers agree.
        expected: dict[int, str] = {}
        for conv in convs:
            summary = summary_from_openai("/v1/chat/completions", body(model, conv, 0))
            expected[conv.index] = assign(exp, {"rr": 0.5}, assignment_point(assignment_key(summary), seed))
        assert len(seen) == 400  # one assignment key per conversation, all its turns
        assert all(len(set(arms)) == 1 and len(arms) == 5 for arms in seen.values())
        per_arm = defaultdict(int)
        for r in replies:
            per_arm[expected[r.conversation]] += 1
        observed = defaultdict(int)
        for arms in seen.values():
            observed[arms[0]] += len(arms)
        assert observed == per_arm
        assert 0.45 <= per_arm["rr"] / 2000 <= 0.55, per_arm

        # Per-arm series against the client's own counts and the backends' usage.
        m = await scrape(first.admin_url)
        for arm in ("affinity", "rr"):
            assert sample(m, "affinity_proxy_experiment_requests_total", experiment="policy-ab", arm=arm) == per_arm[arm]
            assert sample(m, "affinity_proxy_experiment_duration_seconds_count", experiment="policy-ab",
                          arm=arm) == per_arm[arm]
            prompt = sum(r.prompt_tokens for r in replies if expected[r.conversation] == arm)
            cached = sum(r.cached_tokens for r in replies if expected[r.conversation] == arm)
            assert prompt > 0
            assert sample(m, "affinity_proxy_experiment_prompt_tokens_total", experiment="policy-ab", arm=arm) == prompt
            assert sample(m, "affinity_proxy_experiment_cached_tokens_total", experiment="policy-ab", arm=arm) == cached
        assert not any(name == "affinity_proxy_experiment_errors_total" for name, _ in m)
        # Each arm picked with its own policy.
        assert sample(m, "affinity_proxy_routing_decisions_total", policy="round_robin", reason="balanced") == per_arm["rr"]
        affinity_decisions = sum(v for (name, labels), v in m.items()
                                 if name == "affinity_proxy_routing_decisions_total" and ("policy", "affinity") in labels)
        assert affinity_decisions == per_arm["affinity"]
        # Affinity keeps a conversation on one backend, unless the bounded-load rule sheds a turn: its
        # backend then held in-flight + 1 > ceil((1 + request_epsilon) * (fleet in-flight + 1) / 4).
        turn_of = {summary_from_openai("/v1/chat/completions", body(model, conv, t)).prompt: (conv.index, t)
                   for conv in convs for t in range(conv.turns)}
        eps_r = config.routing.affinity.request_epsilon
        fp = Fingerprinter(config.routing.affinity)
        names = [srv.name for srv in fleet.servers]
        home = {conv.index: rendezvous_order(names, [1.0] * len(names), fp.keys(
            summary_from_openai("/v1/chat/completions", body(model, conv, 0))).hash_key)[0] for conv in convs}
        shed: dict[tuple[int, int], Decision] = {}
        for text, decision, before in picks:
            conv_index, t = turn_of[text]
            if expected[conv_index] != "affinity":
                continue
            own = home[conv_index]
            if decision.reason is Reason.OVERLOAD_FALLBACK:
                cap = math.ceil((1 + eps_r) * (sum(before.values()) + 1) / len(names) - 1e-9)
                assert before.get(own, 0) + 1 > cap and decision.backend != own, (conv_index, t, decision, before)
                shed[(conv_index, t)] = decision
            else:  # short chats: placed by hashing, on the home of their first turn, every turn
                assert decision.reason is Reason.HASH and decision.backend == own, (conv_index, t, decision)
        assert len(picks) == per_arm["affinity"]  # the rr arm picks with its own policy (counted above)
        assert len(shed) <= 0.05 * per_arm["affinity"], len(shed)  # the waves make it possible, not common
        for r in replies:  # the client's own view agrees
            if expected[r.conversation] == "affinity":
                d = shed.get((r.conversation, r.turn))
                assert r.backend == (home[r.conversation] if d is None else d.backend), (r.conversation, r.turn)
        # Round robin spreads its turns.
        by_conv = defaultdict(set)
        for r in replies:
            by_conv[r.conversation].add(r.backend)
        assert sum(len(by_conv[c]) > 1 for c, arm in expected.items() if arm == "rr") > per_arm["rr"] / 5 / 3
        # ...so the affinity arm's cache hit ratio is the higher one.
        data = await admin_json(first.admin_url)
        arms = {a["name"]: a for a in data["experiments"][0]["arms"]}
        assert arms["affinity"]["window"]["hit_ratio"] > arms["rr"]["window"]["hit_ratio"]
        assert arms["rr"]["weight"] == 0.5 and arms["rr"]["policy"] == "round_robin"

        # The second replica assigns the same conversations to the same arms.
        await run_turns(second.http_url, model, convs[:100])
        for key, arms in seen2.items():
            assert set(arms) == set(seen[key]), key
        assert len(seen2) == 100
    finally:
        await first.stop()
        await second.stop()
