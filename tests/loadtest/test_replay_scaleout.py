"""The offline replay's scale-out model (issue 13): R replicas x W workers, each with its own policy and
load view, the engines' KV events feeding the precise index, and the replica-count-aware load estimate."""

from __future__ import annotations

import collections
from dataclasses import replace

import pytest

from loadtest.replay import ReplayConfig, main as replay_main, replay, scaleout_label
from loadtest.report import summarize
from loadtest.workloads import load_workload
from loadtest.workloads.model import Workload


def workload() -> Workload:
    return load_workload(
        "sysprompt:requests=60,rate=30,system_prompts=2,system_tokens=600-900,users=10,question_tokens=20-60,"
        "answer_tokens=4-12",
        seed=3,
    )


BASE = ReplayConfig(policy="affinity", backends=3, speed=1.0, max_model_len=None)


async def test_precise_index_mirrors_what_the_engines_hold() -> None:
    """Every BlockStored/BlockRemoved the engines emitted reached the index and was re-keyed from its
    token ids: at the end, each backend's index holds exactly as many blocks as its engine has cached."""
    result = await replay(workload(), replace(BASE, index="precise", replicas=2, kv_event_delay_ms=20))
    kv = result.meta["kv_index"]
    assert set(kv) == {"sim-0", "sim-1", "sim-2"}
    assert sum(v["index_blocks"] for v in kv.values()) > 100
    for stats in kv.values():
        assert stats["index_blocks"] == stats["engine_cached_blocks"], kv
        assert stats["orphans"] == 0 and stats["rejected"] == 0
    assert all(r.status == 200 for r in result.records)


async def test_scale_out_is_deterministic_and_spreads_over_every_process() -> None:
    cfg = replace(BASE, replicas=2, workers=2, index="precise")
    a, b = await replay(workload(), cfg), await replay(workload(), cfg)
    assert [(r.backend, r.ttft) for r in a.records] == [(r.backend, r.ttft) for r in b.records]
    assert a.meta["label"] == "replay:affinity R2xW2 precise shared-load delay 50ms"
    assert len(a.records) == 60


async def test_one_replica_one_worker_is_the_single_process_replay() -> None:
    """The defaults model one process: one worker's load is the replica's, whether "shared" or not."""
    plain = await replay(workload(), BASE)
    alone = await replay(workload(), replace(BASE, replicas=1, workers=1, shared_worker_load=False))
    assert [r.backend for r in plain.records] == [r.backend for r in alone.records]
    assert plain.meta["label"] == "replay:affinity"


async def test_engines_load_view_is_the_cores_shared_backends_setting() -> None:
    w = workload()
    own = await replay(w, replace(BASE, replicas=4, index="precise"))
    engines = await replay(w, replace(BASE, replicas=4, index="precise", load_view="engines"))
    assert engines.meta["label"].endswith("load engines")
    assert [r.backend for r in own.records] != [r.backend for r in engines.records]


async def test_replicas_with_learned_state_disagree_and_precise_events_restore_the_hits() -> None:
    """The shipped Mooncake sample, 2 minutes on 4 GPUs (measured: hit 21.4% in one process, 16.0% with
    4 replicas learning apart, 21.0% with 4 replicas reading the engines' events)."""
    w = load_workload("mooncake", prefer_sample=True).window(0, 120, None)
    base = replace(BASE, backends=4, max_model_len=131072)
    one = summarize(await replay(w, base), w)
    learned = summarize(await replay(w, replace(base, replicas=4)), w)
    # The index's view, tokenised before each pick (the proxy's own lookup defers long first sightings
    # per process: tests/loadtest/test_replay_peers.py, loadtest/results/scaleout.md round 2).
    precise = summarize(await replay(w, replace(base, replicas=4, index="precise", precise_lookup="inline")), w)
    assert learned["hit_ratio"] < 0.9 * one["hit_ratio"]  # each replica learned only its quarter
    assert precise["hit_ratio"] > 0.95 * one["hit_ratio"]  # one view of the caches, in every replica


async def test_workers_without_shared_load_each_see_only_their_own_requests() -> None:
    w = workload()
    shared = await replay(w, replace(BASE, workers=2, shared_worker_load=True))
    separate = await replay(w, replace(BASE, workers=2, shared_worker_load=False))
    assert "separate-load" in separate.meta["label"] and "shared-load" in shared.meta["label"]
    assert [r.backend for r in shared.records] != [r.backend for r in separate.records]
    assert collections.Counter(r.status for r in separate.records) == {200: 60}


async def test_a_host_table_replays_each_worker_on_its_own_row_of_the_shared_block() -> None:
    """host_table: a --workers host as the Deployment runs it (no routing.peer_load): each worker its own
    row of the proxy's SharedInflightTable and its own ledger, the host's queued prefill read from the
    block; not the idealised host whose workers share one table and ledger."""
    w = workload()
    cfg = replace(BASE, workers=2, index="precise", speed=10.0)
    ideal, host = await replay(w, cfg), await replay(w, replace(cfg, host_table=True))
    assert host.meta["label"] == "replay:affinity R1xW2 precise shared-load shm-host delay 50ms"
    assert [r.backend for r in ideal.records] != [r.backend for r in host.records]
    assert collections.Counter(r.status for r in host.records) == {200: 60}
    again = await replay(w, replace(cfg, host_table=True))
    assert [(r.backend, r.ttft) for r in host.records] == [(r.backend, r.ttft) for r in again.records]
    # Only with shared load and the own load view (load_view "peers" always runs the shared block).
    assert "shm-host" not in scaleout_label(replace(cfg, host_table=True, load_view="peers"))


def test_labels_name_the_scale_out_shape() -> None:
    assert scaleout_label(ReplayConfig()) == ""
    assert scaleout_label(ReplayConfig(replicas=4, load_view="engines")) == " R4xW1 learned load engines"
    assert scaleout_label(ReplayConfig(workers=2, shared_worker_load=False)) == " R1xW2 learned separate-load"


@pytest.mark.parametrize("bad", [["--replicas", "0"], ["--workers", "0"], ["--kv-event-delay-ms", "-1"],
                                 ["--index", "exact"], ["--load-view", "guess"]])
def test_cli_rejects_bad_scale_out_flags(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        replay_main(["--workload", "chat", "--policies", "affinity", *bad])
    assert exc.value.code == 2
    assert "--" in capsys.readouterr().err


async def test_kv_events_arrive_after_the_configured_delay() -> None:
    """Events a minute late are a view a minute old: the replicas miss the caches built meanwhile."""
    w = load_workload("mooncake", prefer_sample=True).window(0, 120, None)
    base = replace(BASE, backends=4, max_model_len=131072, replicas=4, index="precise", precise_lookup="inline")
    prompt = summarize(await replay(w, base), w)
    late = summarize(await replay(w, replace(base, kv_event_delay_ms=60_000)), w)
    assert late["hit_ratio"] < 0.8 * prompt["hit_ratio"]


async def test_the_proxys_lookup_waits_for_long_first_sightings_as_the_proxy_does() -> None:
    """lookup proxy: a long prompt another replica tokenised waits for its own tokenisation (no virtual
    time) and is routed precisely, as inline; proxy-nowait (the proxy before the wait) routes it by the
    learned index that time and loses hits at R = 4."""
    w = load_workload("mooncake", prefer_sample=True).window(0, 120, None)
    base = replace(BASE, backends=4, max_model_len=131072, replicas=4, index="precise", load_view="engines")
    waits = await replay(w, base)
    nowait = await replay(w, replace(base, precise_lookup="proxy-nowait"))
    inline = await replay(w, replace(base, precise_lookup="inline"))
    assert waits.meta["precise_waited"] > 0 and waits.meta["precise_deferred"] == 0
    assert nowait.meta["precise_waited"] == 0 and nowait.meta["precise_deferred"] > 0
    assert nowait.meta["label"].endswith("lookup proxy-nowait load engines")
    hit = {k: summarize(r, w)["hit_ratio"] for k, r in (("proxy", waits), ("nowait", nowait), ("inline", inline))}
    assert hit["proxy"] > hit["nowait"]
    assert abs(hit["proxy"] - hit["inline"]) < 0.05 * hit["inline"], hit


async def test_a_tokenise_wait_picks_a_waited_first_sighting_later_and_the_others_first() -> None:
    """`tokenise_wait_ms`: a first sighting that waits for its tokenisation reaches its engine that much
    later, requests arriving meanwhile are routed first, and no request is lost or sent twice; what the
    client sent (and when) is unchanged."""
    w = load_workload("mooncake", prefer_sample=True).window(0, 15, None)
    base = replace(BASE, backends=4, max_model_len=131072, index="precise")
    orders: dict[float, list[int]] = {0.0: [], 400.0: []}
    runs = {}
    for wait, order in orders.items():
        runs[wait] = await replay(w, replace(base, tokenise_wait_ms=wait),
                                  observe=lambda i, _b, _r, _e, order=order: order.append(i))
    assert runs[0.0].meta["precise_waited"] == runs[400.0].meta["precise_waited"] > 0
    assert orders[0.0] == sorted(orders[0.0]) and sorted(orders[400.0]) == orders[0.0]
    assert orders[400.0] != orders[0.0]  # a later arrival overtook a waiting one
    assert "tokenise wait 400ms" in runs[400.0].meta["label"] and "wait" not in runs[0.0].meta["label"]
    sent = {wait: sorted((r.index, r.sent) for r in run.records) for wait, run in runs.items()}
    assert sent[0.0] == sent[400.0] and len(sent[0.0]) == len(w.items)


def test_affinity_settings_take_their_field_types() -> None:
    """`--affinity-set cost_aware=false` and a suite's `float(band)` reach the policy as the config's own
    types: the compiled policy (proxy/native) refuses an int where the config says bool."""
    from loadtest.replay import parse_affinity_sets, routing_config

    sets = parse_affinity_sets(["cost_aware=false", "request_epsilon=3", "eviction_band_tokens=4096"])
    assert sets == {"cost_aware": False, "request_epsilon": 3.0, "eviction_band_tokens": 4096}
    # An optional setting (None by default) takes the type it has when set.
    assert parse_affinity_sets(["uncached_weight=6"]) == {"uncached_weight": 6.0}
    assert type(routing_config(replace(BASE, affinity_overrides=(("uncached_weight", 2),))).affinity.uncached_weight) is float
    aff = routing_config(replace(BASE, affinity_overrides=(("cost_aware", 0), ("eviction_band_tokens", 2048.0)))).affinity
    assert aff.cost_aware is False and type(aff.eviction_band_tokens) is int and aff.eviction_band_tokens == 2048
    assert type(routing_config(replace(BASE, affinity_overrides=(("epsilon", 1),))).affinity.epsilon) is float
    for bad in (["cost_aware=maybe"], ["no_such_knob=1"], ["fingerprint_fields=prompt"], ["cost_aware"]):
        with pytest.raises(ValueError):
            parse_affinity_sets(bad)
    with pytest.raises(ValueError):
        routing_config(replace(BASE, affinity_overrides=(("eviction_band_tokens", 2048.5),)))


async def test_a_replay_without_the_cost_check_runs_compiled_or_not() -> None:
    """The switch that failed compiled (`cost_aware` given as 0) routes every request of a small load."""
    result = await replay(workload(), replace(BASE, index="precise", affinity_overrides=(("cost_aware", 0),)))
    assert len(result.records) == 60 and all(r.status == 200 for r in result.records)


def test_arrival_jitter_is_seeded_bounded_and_keeps_the_traces_order() -> None:
    from loadtest.replay import arrival_times

    items = load_workload("mooncake", prefer_sample=True).window(0, 60, None).items
    plain = arrival_times(items, replace(BASE, speed=2.0))
    assert plain == [it.t / 2.0 for it in items]  # no jitter: the trace's times over the speed
    a = arrival_times(items, replace(BASE, speed=2.0, arrival_jitter_ms=1.0, seed=1))
    assert a == arrival_times(items, replace(BASE, speed=2.0, arrival_jitter_ms=1.0, seed=1))
    assert a != arrival_times(items, replace(BASE, speed=2.0, arrival_jitter_ms=1.0, seed=2))
    assert a == sorted(a)  # never before the request before it: every record keeps its index
    assert all(0.0 <= t - p < 0.0005 + 1e-12 for t, p in zip(a, plain))  # under 1 ms of trace time, over speed 2
    assert any(t != p for t, p in zip(a, plain))


async def test_a_jittered_replay_is_a_perturbation_of_the_same_requests() -> None:
    w = workload()
    cfg = replace(BASE, index="precise", arrival_jitter_ms=5.0, seed=4)
    jittered = await replay(w, cfg)
    assert jittered.meta["label"] == "replay:affinity R1xW1 precise delay 50ms jitter 5ms seed 4"
    assert [r.index for r in jittered.records] == list(range(60))
    plain = await replay(w, replace(BASE, index="precise"))
    moved = [j.sent - p.sent for j, p in zip(jittered.records, plain.records)]
    assert all(0.0 <= d < 0.005 for d in moved) and max(moved) > 0
    with pytest.raises(SystemExit):
        replay_main(["--workload", "chat", "--policies", "affinity", "--arrival-jitter-ms", "-1"])


async def test_observe_sees_each_request_reach_its_engine_with_what_every_engine_holds() -> None:
    """`replay(..., observe=...)` (scaleout.py `losses`): called once per request an engine accepted, as
    it reaches that engine, with every engine; `Engine.cached_prefix_tokens` then reads what each engine
    holds of the prompt. A prompt's first sighting finds nothing anywhere; a repeat of a shared system
    prompt finds it on the engine that computed it; what an engine holds on arrival is at most what the
    request hits on admission plus what it evicts meanwhile, and never more than its prompt."""
    wl = workload()
    seen: dict[int, tuple[str, dict[str, int]]] = {}

    def observe(i: int, backend: str, rid: str, engines: dict) -> None:
        assert i not in seen and rid == f"r{i}"
        seen[i] = (backend, {n: engines[backend].cached_prefix_tokens(rid, e.pool) for n, e in engines.items()})

    result = await replay(wl, replace(BASE, index="precise"), observe=observe)
    assert sorted(seen) == [r.index for r in result.records if r.status == 200]
    assert all(held == 0 for held in seen[0][1].values())  # nothing cached before the first request
    for r in result.records:
        backend, held = seen[r.index]
        assert backend == r.backend
        assert all(0 <= v < r.input_tokens for v in held.values())
    # Repeats of the shared system prompts: most find them on their own engine on arrival, and what they
    # hit on admission (usage.cached_tokens) is what their engine held (nothing is evicted at this size).
    on_own = [r for r in result.records if seen[r.index][1][r.backend] > 0]
    assert len(on_own) > len(result.records) // 2
    assert all((r.cached_tokens or 0) >= seen[r.index][1][r.backend] for r in on_own)


@pytest.mark.parametrize("shape", [
    {},
    {"workers": 2, "load_view": "peers", "peer_refresh_ms": 10.0},  # a --workers host: the shared table's bound
    {"replicas": 2, "load_view": "peers", "peer_refresh_ms": 10.0},  # replicas: the fleet's newest K by age
    {"replicas": 2, "workers": 2, "load_view": "peers", "peer_refresh_ms": 10.0},  # both, mates in the block
], ids=["one-process", "workers", "replicas", "replicas-of-workers"])
async def test_every_load_path_routes_on_the_engines_progress_below_running_weight_one(shape: dict) -> None:
    """The ledgers (and a host's shared table) follow the index's progress in every shape: at
    running_weight 0 some long prompts are placed elsewhere than at 1 (the sum), where queued prompts
    the engines have already computed no longer count; the default is 0.5."""
    w = load_workload("sysprompt:requests=80,rate=12,system_prompts=6,system_tokens=5000-9000,users=20,"
                      "question_tokens=200-2000,answer_tokens=20-60", seed=3)
    base = replace(BASE, index="precise", **shape)
    sums = await replay(w, replace(base, affinity_overrides=(("running_weight", 1.0),)))
    bound = await replay(w, replace(base, affinity_overrides=(("running_weight", 0.0),)))
    half = await replay(w, replace(base, affinity_overrides=(("running_weight", 0.5),)))
    assert [r.backend for r in half.records] == [r.backend for r in (await replay(w, base)).records]  # the default
    moved = sum(a.backend != b.backend for a, b in zip(sums.records, bound.records))
    assert moved >= 3, moved
