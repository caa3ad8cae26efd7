"""ORCA `endpoint-load-metrics` headers: both readable encodings, and nothing guessed from the rest."""

from __future__ import annotations

import pytest

from proxy.control.orca import parse_orca


def test_text_format_as_vllm_sends_it() -> None:
    header = ("TEXT cpu_utilization=0.3, mem_utilization=0.8, rps_fractional=12.5, "
              "named_metrics.kv_cache_usage_perc=0.4, named_metrics.num_requests_waiting=3, "
              "named_metrics.num_requests_running=7")
    assert parse_orca(header) == {"kv_usage": 0.4, "waiting": 3.0, "running": 7.0, "qps": 12.5,
                                  "mem_fraction": 0.8}


def test_json_format_with_protobuf_camel_case() -> None:
    header = ('JSON {"rpsFractional": 2, "memUtilization": 0.5, "applicationUtilization": 0.9, '
              '"namedMetrics": {"kv_cache_utilization": 0.25, "cuda_kernel_queue_length": 12}}')
    assert parse_orca(header) == {"qps": 2.0, "mem_fraction": 0.5, "gpu_utilization": 0.9, "kv_usage": 0.25,
                                  "kernel_queue": 12.0}


@pytest.mark.parametrize("header", [
    "", "BIN CgQIARAB", "JSON [1, 2]", "JSON {not json", "TEXT", "TEXT garbage",
    "TEXT named_metrics.kv_cache_usage_perc=nan", "TEXT named_metrics.num_requests_waiting=-1",
    "TEXT named_metrics.num_requests_waiting=true", "TEXT named_metrics.unknown_thing=5",
    'JSON {"named_metrics": {"num_requests_waiting": true}}',
])
def test_unreadable_or_unknown_values_are_ignored(header: str) -> None:
    assert parse_orca(header) == {}


def test_format_name_is_case_insensitive() -> None:
    assert parse_orca("text named_metrics.num_requests_waiting=2") == {"waiting": 2.0}
