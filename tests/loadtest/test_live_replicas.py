"""loadtest.live_replicas end to end on a tiny window: a 2-server simulated fleet with KV events, two
separate `proxy run` replicas, requests spread over both, and the replay of the same window next to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.live_replicas import LiveSpec, build_parser, main_async, replica_config_yaml, tail_table
from proxy.config import parse_config

# 24 requests over ~3 s sharing two system prompts: short prompts, so the test stays a few seconds long,
# and shared prefixes, so the engines report cache hits and publish the blocks they store.
TINY = ("sysprompt:requests=24,rate=8,system_prompts=2,system_tokens=600-900,users=6,question_tokens=20-60,"
        "answer_tokens=4-12")


def test_replica_config_parses_with_kv_events_for_every_backend() -> None:
    servers = [{"name": f"sim-{i}", "url": f"http://127.0.0.1:{9000 + i}", "kv_events": f"tcp://127.0.0.1:{7000 + i}",
                "kv_replay": f"tcp://127.0.0.1:{7100 + i}"} for i in range(3)]
    cfg = parse_config(replica_config_yaml(LiveSpec(backends=3, index="precise", load_view="engines"), servers, 8080, 8081))
    assert cfg.routing.policy == "affinity" and cfg.routing.shared_backends is True
    kv = cfg.telemetry.kv_events.backends
    assert sorted(kv) == ["sim-0", "sim-1", "sim-2"]
    assert kv["sim-1"].endpoint == "tcp://127.0.0.1:7001" and kv["sim-1"].replay_endpoint == "tcp://127.0.0.1:7101"
    learned = parse_config(replica_config_yaml(LiveSpec(backends=3, index="learned", load_view="own"), servers, 8080, 8081))
    assert learned.routing.shared_backends is False and not learned.telemetry.kv_events.enabled
    peers = parse_config(replica_config_yaml(LiveSpec(backends=3, load_view="peers", redis_url="redis://127.0.0.1:6400/0"),
                                             servers, 8080, 8081))
    assert peers.routing.shared_backends is True  # the fallback while Redis does not answer
    assert peers.routing.peer_load.redis_url == "redis://127.0.0.1:6400/0" and peers.routing.peer_load.refresh_ms == 10


async def test_two_replicas_live_next_to_the_replay(tmp_path: Path) -> None:
    out = tmp_path / "live.json"
    argv = ["--workload", TINY, "--seed", "3", "--backends", "2", "--replicas", "2", "--index", "precise",
            "--max-model-len", "8192", "--no-progress", "--out", str(out), "--records", str(tmp_path / "rec.json")]
    doc = await main_async(build_parser().parse_args(argv), argv)
    assert json.loads(out.read_text())["table"] == doc["table"]
    (run,) = doc["runs"]
    live, rep = run["live"], run["replay"]
    assert live["requests"] == rep["requests"] == 24
    assert live["errors"] == 0 and live["ok"] == 24, run["live_meta"]
    # The client spread the requests over both replicas, and each replica's index was fed by the events
    # of every backend that served something.
    share = run["live_meta"]["replica_share"]
    assert len(share) == 2 and min(share) > 0 and sum(share) == 24
    served = {b for b, n in live["backend_share"].items() if n}
    for blocks in run["live_meta"]["kv_index_blocks"]:
        assert {b for b, n in blocks.items() if n > 0} >= served, blocks
    # Each replica's decisions by reason, from its admin /metrics, add up to what it was sent; short
    # prompts never wait for their tokenisation.
    reasons = run["live_meta"]["reasons"]
    assert [sum(r.values()) for r in reasons] == share, reasons
    assert run["live_meta"]["precise_wait"] == [{"waits": 0, "wait_s": 0.0, "timeouts": 0, "skipped": 0}] * 2
    # Each replica's event-loop lag, sampled every 100 ms over the run.
    for lag in run["live_meta"]["loop_lag"]:
        assert lag["samples"] >= 10 and 0 <= lag["over_5ms"] <= lag["samples"] and lag["max_s"] >= 0
    # Shared system prompts: both the live engines and the replayed ones report prefix-cache hits.
    assert live["hit_ratio"] and live["hit_ratio"] > 0 and rep["hit_ratio"] and rep["hit_ratio"] > 0
    assert run["ratios"]["ttft_mean"] is not None and run["ratios"]["ttft_mean"] > 0
    # The engines' own TTFT (their histograms) beside the replay's, and what the proxy's path added.
    assert live["engine_ttft_mean"] and 0 < live["engine_ttft_mean"] <= live["ttft_mean"]
    assert live["ttft_added_mean_ms"] is not None and live["ttft_added_mean_ms"] >= 0
    assert run["ratios"]["engine_ttft_mean"] == pytest.approx(live["engine_ttft_mean"] / rep["ttft_mean"])
    # ... and to each answer's end (the engines' e2e histograms).
    assert live["engine_e2e_mean"] and live["engine_ttft_mean"] < live["engine_e2e_mean"]
    assert live["e2e_added_mean_ms"] is not None and live["e2e_added_mean_ms"] >= 0
    assert "To the answer's end:" in doc["table"]
    assert "| TTFT mean at the engines |" in doc["table"]
    assert "| TTFT p99 |" in doc["table"] and "live / replay" in doc["table"]
    # --records: every request of both sides, paired by index, and the tail table built from them.
    (pair,) = json.loads((tmp_path / "rec.json").read_text())
    assert sorted(r["index"] for r in pair["live"]) == sorted(r["index"] for r in pair["replay"]) == list(range(24))
    table = tail_table([pair], top=3)
    slowest = max(r["ttft"] for r in pair["live"] if r["ttft"] is not None)
    assert table.count("\n") == 5 and f"| {slowest * 1e3:,.0f} |" in table.splitlines()[3]


def test_routing_line_sums_the_replicas_and_sets_the_replay_beside_them() -> None:
    from loadtest.live_replicas import routing_line

    meta = {"reasons": [{"hash": 3, "cache_hit": 5}, {"hash": 1, "cache_hit": 2}],
            "precise_wait": [{"waits": 2, "wait_s": 0.3, "timeouts": 1, "skipped": 0},
                             {"waits": 2, "wait_s": 0.1, "timeouts": 0, "skipped": 2}],
            "loop_lag": [{"samples": 30, "lag_s": 0.03, "over_5ms": 3, "max_s": 0.012},
                         {"samples": 10, "lag_s": 0.01, "over_5ms": 1, "max_s": 0.02}]}
    line = routing_line(meta, {"reasons": {"cache_hit": 9, "hash": 2, "least_loaded": 1}})
    assert line.startswith("reasons live/replay: cache_hit 7/9, hash 4/2, least_loaded 0/1;"), line
    assert "precise waits 4 (mean 100 ms), timed out 1, skipped at the concurrency cap 2" in line
    assert line.endswith("; event-loop lag mean 1.0 ms, 10.0% of samples over 5 ms, max 20 ms"), line


def test_the_replay_beside_a_workers_replica_models_its_shared_memory_host() -> None:
    """A live `run --workers 2` replica is the shared-memory host whatever its load view: the replay it
    is compared with runs each worker on its own row of the block (`host_table`), not one table."""
    from loadtest.live_replicas import replay_config
    from loadtest.replay import scaleout_label

    one = replay_config(LiveSpec(replicas=1, workers=2, load_view="own"), 50.0)
    assert one.host_table and "shm-host" in scaleout_label(one)
    assert not replay_config(LiveSpec(replicas=2, workers=1, load_view="own"), 50.0).host_table


async def test_round_robin_calibration_places_every_request_alike_live_and_replayed(tmp_path: Path) -> None:
    """`--policy round_robin --index learned` at one replica: the proxy and the replay send request i to the
    same backend (configuration order, in turn), so whatever differs between the two columns is the fleet's
    own time, not routing. The replicas' config says round_robin, and precise is refused for it."""
    argv = ["--workload", TINY.replace("requests=24", "requests=12"), "--seed", "3", "--backends", "2", "--replicas", "1", "--policy", "round_robin",
            "--index", "learned", "--max-model-len", "8192", "--no-progress", "--records", str(tmp_path / "rec.json")]
    doc = await main_async(build_parser().parse_args(argv), argv)
    (run,) = doc["runs"]
    assert run["spec"]["policy"] == "round_robin" and run["live"]["ok"] == 12
    assert run["live_meta"]["reasons"] == [{"balanced": 12}] and run["replay_reasons"] == {"balanced": 12}
    (pair,) = json.loads((tmp_path / "rec.json").read_text())
    live = {r["index"]: r["backend"] for r in pair["live"]}
    replayed = {r["index"]: r["backend"] for r in pair["replay"]}
    sent = {r["index"]: r["sent"] for r in pair["live"]}
    assert set(live.values()) == {"sim-0", "sim-1"} and sorted(live.values()) == sorted(replayed.values())
    # Two requests sent within a few ms of each other may reach the proxy in either order (and take each
    # other's turn); every other request goes where the replay sent it.
    differ = [i for i in live if live[i] != replayed[i]]
    for i in differ:
        assert min(abs(sent[i] - sent[j]) for j in (i - 1, i + 1) if j in sent) < 0.02, (i, live, replayed)
    assert len(differ) <= 4, differ
    assert "round_robin, 1 replicas" in doc["table"]
    cfg = parse_config(replica_config_yaml(LiveSpec(backends=2, index="learned", load_view="own", policy="round_robin"),
                                           [{"name": "a", "url": "http://127.0.0.1:9"}], 8080, 8081))
    assert cfg.routing.policy == "round_robin"
    from loadtest.live_replicas import main

    with pytest.raises(SystemExit, match="reads no KV index"):
        main(["--policy", "round_robin", "--index", "precise"])
