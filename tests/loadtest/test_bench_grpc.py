"""loadtest.bench_grpc: its summary arithmetic, and the in-process relay measurement runs against the real listener."""

from __future__ import annotations

import pytest

from loadtest import bench_grpc


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert bench_grpc.percentile(values, 0.50) == 50.0
    assert bench_grpc.percentile(values, 0.99) == 99.0
    assert bench_grpc.percentile([7.0], 0.99) == 7.0
    with pytest.raises(ValueError):
        bench_grpc.percentile([], 0.5)


def _round(direct: float, a: float, b: float, cpu_a: float, cpu_b: float) -> dict[str, dict[str, dict[str, float]]]:
    return {"unary": {"direct": {"rate": direct}, "a": {"rate": a, "cpu_us": cpu_a}, "b": {"rate": b, "cpu_us": cpu_b}},
            "latency": {"direct": {"rate": 1.0, "p50_us": 100.0, "p99_us": 200.0},
                        "a": {"rate": 1.0, "cpu_us": 1.0, "p50_us": 150.0, "p99_us": 260.0},
                        "b": {"rate": 1.0, "cpu_us": 1.0, "p50_us": 170.0, "p99_us": 300.0}}}


def test_summary_takes_medians_of_per_round_ratios() -> None:
    rounds = [_round(1000, 500, 400, 200, 250), _round(800, 200, 400, 300, 250), _round(1000, 600, 500, 210, 240)]
    s = bench_grpc.summarise(rounds, ["a", "b"])
    unary = s["unary"]
    assert isinstance(unary, dict)
    assert unary["a"]["rate_vs_direct_per_round"] == [0.5, 0.25, 0.6]
    assert unary["a"]["rate_vs_direct"] == 0.5
    assert unary["a"]["cpu_us"] == 210.0
    latency = s["latency"]
    assert isinstance(latency, dict)
    assert latency["a"]["added_p50_us"] == 50.0 and latency["b"]["added_p99_us"] == 100.0
    versus = s["a_vs"]
    assert isinstance(versus, dict)
    assert versus["b"]["unary_cpu_ratio"] == 0.875  # median of 200/250, 300/250, 210/240
    table = bench_grpc.markdown(s, ["a", "b"])
    assert "| proxy CPU µs per unary call |  | 210 | 250 |" in table


def test_summary_without_direct_has_no_ratios_to_it() -> None:
    rounds = [{"unary": {"a": {"rate": 5.0, "cpu_us": 2.0}, "b": {"rate": 4.0, "cpu_us": 3.0}}}]
    s = bench_grpc.summarise(rounds, ["a", "b"])
    unary = s["unary"]
    assert isinstance(unary, dict)
    assert "rate_vs_direct" not in unary["a"]
    assert s["a_vs"] == {"b": {"unary_cpu_ratio": 0.667, "unary_rate_ratio": 1.25}}


async def test_relay_cost_runs_calls_and_streams_through_the_real_listener() -> None:
    got = await bench_grpc._relay_cost(calls=20, batches=2, messages=20)  # noqa: SLF001
    assert set(got) == {"unary_us_min", "unary_us_median", "stream_us_per_msg_min", "stream_us_per_msg_median"}
    assert all(v > 0 for v in got.values())
