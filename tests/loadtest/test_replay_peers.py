"""The offline replay's model of two proxy behaviours under scale-out (issue 13): the shared ledger load
view (`--load-view peers`) and the data plane's precise lookup: a long first sighting waits for its
tokenisation off the event loop (`--precise-lookup proxy`, the default), or, as before that wait, is
routed by the learned index meanwhile (`--precise-lookup proxy-nowait`)."""

from __future__ import annotations

from dataclasses import replace

from loadtest.replay import ReplayConfig, replay, scaleout_label
from loadtest.workloads import load_workload
from loadtest.workloads.model import Workload
from proxy.dataplane.tokenize import ModelTokenizer
from sim.tokenizer import TOKENIZER_DIR

BASE = ReplayConfig(policy="affinity", backends=3, speed=1.0, max_model_len=131072, index="precise")


def long_prompts() -> Workload:
    """Two system prompts of ~9k words (far over the tokenizer's 32k-character offload threshold)."""
    return load_workload(
        "sysprompt:requests=24,rate=4,system_prompts=2,system_tokens=9000-9500,users=6,question_tokens=20-40,"
        "answer_tokens=4-8",
        seed=5,
    )


def short_prompts() -> Workload:
    return load_workload(
        "sysprompt:requests=24,rate=8,system_prompts=2,system_tokens=200-300,users=6,question_tokens=10-20,"
        "answer_tokens=4-8",
        seed=5,
    )


async def test_long_first_sightings_are_routed_by_the_learned_index_without_the_wait() -> None:
    """The threshold is the data plane's own (`ModelTokenizer.offload_chars`): with precise_wait_ms 0 a
    prompt whose untokenised part is longer is deferred once per process (its chunks are then cached), a
    short one never."""
    assert ModelTokenizer.from_dir(TOKENIZER_DIR).offload_chars == 32768
    nowait = replace(BASE, precise_lookup="proxy-nowait")
    one = await replay(long_prompts(), nowait)
    assert 1 <= one.meta["precise_deferred"] <= 2  # each system prompt's first sighting, at most
    assert one.meta["precise_errors"] == 0
    four = await replay(long_prompts(), replace(nowait, replicas=4))
    assert four.meta["precise_deferred"] > one.meta["precise_deferred"]  # every replica tokenises for itself
    short = await replay(short_prompts(), nowait)
    assert short.meta["precise_deferred"] == 0
    # The proxy as it is: each of those first sightings waits for its tokenisation, none is deferred.
    waits = await replay(long_prompts(), replace(BASE, replicas=4))
    assert waits.meta["precise_deferred"] == 0
    assert waits.meta["precise_waited"] >= four.meta["precise_deferred"]
    inline = await replay(long_prompts(), replace(BASE, precise_lookup="inline"))
    assert "precise_deferred" not in inline.meta
    assert scaleout_label(replace(BASE, precise_lookup="inline")).endswith("lookup inline")
    assert all(r.status == 200 for r in one.records + four.records)


async def test_shared_ledger_view_reaches_every_replica() -> None:
    """Under load (the shipped Mooncake sample, 4 GPUs), replicas that read each other's published queued
    prefill place requests differently from replicas that see only their own; the replay stays
    deterministic."""
    w = load_workload("mooncake", prefer_sample=True).window(0, 60, None)
    base = replace(BASE, backends=4, replicas=3, precise_lookup="inline")
    own = await replay(w, base)
    peers = await replay(w, replace(base, load_view="peers", peer_refresh_ms=10))
    assert peers.meta["label"].endswith("load peers every 10ms")
    assert [r.backend for r in own.records] != [r.backend for r in peers.records]
    again = await replay(w, replace(base, load_view="peers", peer_refresh_ms=10))
    assert [(r.backend, r.ttft) for r in peers.records] == [(r.backend, r.ttft) for r in again.records]


async def test_replicas_that_publish_their_ledger_entries_route_like_one_process() -> None:
    """Round 4: the fleet's queued prefill is the newest K ledger entries of every replica merged by age.
    With it (at round 4's 20 ms refresh; at round 5's 10 ms default 104 of 118), 3 replicas on the Mooncake sample make exactly the decisions
    of one process; with the sums of each replica's own estimate (round 3's peer load) they do not, and on
    a busier window the entries keep far more decisions equal to one process's."""
    base = replace(BASE, backends=4, precise_lookup="inline")

    async def agreement(window: tuple[float, float], speed: float, recent: bool) -> tuple[int, int]:
        w = load_workload("mooncake", prefer_sample=True).window(window[0], window[1], None)
        one = [r.backend for r in (await replay(w, replace(base, speed=speed))).records]
        cfg = replace(base, speed=speed, replicas=3, load_view="peers", peer_recent=recent, peer_refresh_ms=20.0)
        assert replace(base).peer_refresh_ms == 10.0  # the default since round 5
        many = [r.backend for r in (await replay(w, cfg)).records]
        return sum(a == b for a, b in zip(one, many)), len(one)

    same, n = await agreement((0, 60), 1.0, True)
    assert same == n > 100
    same_sums, _ = await agreement((0, 60), 1.0, False)
    assert same_sums <= n - 10
    busy, _ = await agreement((0, 60), 2.0, True)
    busy_sums, _ = await agreement((0, 60), 2.0, False)
    assert busy >= busy_sums + 30
    assert scaleout_label(replace(base, load_view="peers", peer_recent=False, peer_refresh_ms=20.0)).endswith("every 20ms sums only")


async def test_workers_hosts_whose_workers_publish_their_entries_route_like_one_process() -> None:
    """Rounds 4b and 5: 2 hosts of `--workers 2` as the proxy runs them (a SharedInflightTable per host, a
    work ledger per worker), each worker publishing its own part with its ledger entries, reading the
    other host's rows and its host-mate's counts and entries from the shared block: on the Mooncake
    sample they make exactly one process's
    decisions; with the same rows without the entries they do not (round 4's --workers host published
    its sums only, and its workers' estimate was the sum of each one's newest k_w)."""
    base = replace(BASE, backends=4, precise_lookup="inline")
    w = load_workload("mooncake", prefer_sample=True).window(0, 60, None)
    one = [r.backend for r in (await replay(w, base)).records]
    hosts = replace(base, replicas=2, workers=2, load_view="peers")
    assert hosts.shared_worker_load and hosts.peer_refresh_ms == 10.0
    many = [r.backend for r in (await replay(w, hosts)).records]
    assert sum(a == b for a, b in zip(one, many)) == len(one) > 100
    sums = [r.backend for r in (await replay(w, replace(hosts, peer_recent=False))).records]
    assert sum(a == b for a, b in zip(one, sums)) <= len(one) - 30
