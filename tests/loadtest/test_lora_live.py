"""loadtest.lora_live on a small workload: live through `python -m proxy` in front of `python -m sim` (adapters
registered per backend through the runtime LoRA API) and the offline replay route the same shares."""

from __future__ import annotations

from pathlib import Path

from loadtest.lora_live import (LoraLiveSpec, build_workload, compare, default_placement, parse_placement,
                                proxy_config_yaml, run, shares)
from loadtest.records import Record, RunResult
from loadtest.replay import replay


def test_default_placement_puts_hot_adapters_on_two_backends_and_cold_on_one() -> None:
    p = default_placement(LoraLiveSpec(adapters=4, backends=4))
    holders = {a: sorted(b for b, names in p.items() if a in names) for a in ("lora-0", "lora-1", "lora-2", "lora-3")}
    assert [len(h) for h in holders.values()] == [2, 2, 1, 1]
    assert all(p[b] for b in p)  # every backend holds some adapter
    assert parse_placement("sim-0=a+b, sim-1=a") == {"sim-0": ("a", "b"), "sim-1": ("a",)}


def test_the_workload_mixes_adapters_and_the_base_model_deterministically() -> None:
    spec = LoraLiveSpec(requests=200, base_share=0.3)
    a, b = build_workload(spec), build_workload(spec)
    assert [it.model for it in a.items] == [it.model for it in b.items]
    models = [it.model for it in a.items]
    assert 0.2 < models.count(None) / len(models) < 0.4
    assert models.count("lora-0") > models.count("lora-3") > 0


def test_adapters_are_declared_unless_discovered() -> None:
    servers = [{"name": "sim-0", "url": "http://127.0.0.1:1"}, {"name": "sim-1", "url": "http://127.0.0.1:2"}]
    placement = {"sim-0": ("lora-0",), "sim-1": ()}
    assert "adapters: [lora-0]" in proxy_config_yaml(LoraLiveSpec(), servers, placement, 1, 2)
    assert "adapters" not in proxy_config_yaml(LoraLiveSpec(discover=True), servers, placement, 1, 2)


async def test_the_replay_keeps_adapter_requests_on_the_backends_that_hold_them() -> None:
    """The replay routes through the data plane's Router: an adapter's requests go only where it is
    registered (declared or discovered), as live (it used to give every engine every adapter, route with
    the bare policy and so spread them over the whole fleet)."""
    spec = LoraLiveSpec(requests=120, rate=20)
    placement = {"sim-0": ("lora-0",), "sim-1": ("lora-0", "lora-1"), "sim-2": ("lora-2",), "sim-3": ("lora-3",)}
    workload = build_workload(spec)
    for declare in (True, False):
        from loadtest.lora_live import replay_config
        cfg = replay_config(LoraLiveSpec(requests=120, rate=20, discover=not declare), placement)
        result = await replay(workload, cfg)
        s = shares(result, workload, [f"sim-{i}" for i in range(4)])
        assert s["errors"] == 0
        holders = {a: {b for b, names in placement.items() if a in names} for a in ("lora-0", "lora-1", "lora-2", "lora-3")}
        for a, h in holders.items():
            on = {b for b, v in s["per_model"][a].items() if v > 0}
            assert on and on <= h, (declare, a, on, h)


def test_compare_reports_the_largest_share_difference() -> None:
    items = build_workload(LoraLiveSpec(requests=4, base_share=0.0)).items
    from loadtest.workloads import Workload
    w = Workload("t", list(items))

    def result(backends: list[str]) -> RunResult:
        recs = [Record(index=i, sent=0, scheduled=0, input_tokens=1, status=200, backend=b) for i, b in enumerate(backends)]
        return RunResult({}, recs, [], {}, 1.0, None)

    a = shares(result(["sim-0", "sim-0", "sim-1", "sim-1"]), w, ["sim-0", "sim-1"])
    b = shares(result(["sim-0", "sim-1", "sim-1", "sim-1"]), w, ["sim-0", "sim-1"])
    d = compare(a, b)
    assert abs(d["max_overall"] - 0.25) < 1e-9
    assert d["max_per_model"] >= d["max_overall"]


async def test_live_and_replay_route_a_lora_workload_alike(tmp_path: Path) -> None:
    spec = LoraLiveSpec(requests=60, rate=10)
    doc = await run(spec, workdir=tmp_path)
    assert doc["live"]["errors"] == 0 and doc["replay"]["errors"] == 0, doc["live_meta"]
    assert sum(doc["live"]["counts"].values()) == 60
    assert doc["max_diff"] <= 0.05, doc["table"]
    assert doc["agree"]
