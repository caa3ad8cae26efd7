"""The targeted scanner must read exactly what prometheus_client reads, on every engine's page."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from proxy.control.adapters import ADAPTERS, MetricsReader, compile_metric_map, detect_engine
from proxy.control.scrape import parse_labels, parse_selector, scan, select

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
PAGES = sorted(p.name for p in FIXTURES.glob("*.txt"))


def _reference(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """prometheus_client's samples, keyed by the name as written on the page.

    It renames a counter written without `_total` (TGI's, Triton's) to `<name>_total`; we read pages as
    written, so map those back.
    """
    lines = {
        head.split()[0]
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
        for head in [line.split("{")[0]]
        if head.split()
    }
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name not in lines and family.type == "counter" and name.endswith("_total"):
                name = name[: -len("_total")]
            out.setdefault(name, []).append((dict(sample.labels), sample.value))
    return out


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_every_engine_has_a_fixture() -> None:
    # The list of engines is the adapters table: a new adapter without a fixture page fails here.
    assert len(ADAPTERS) >= 5
    for engine in ADAPTERS:
        assert f"{engine}.txt" in PAGES


@pytest.mark.parametrize("page", PAGES)
def test_scan_agrees_with_prometheus_client_on_every_series(page: str) -> None:
    text = (FIXTURES / page).read_text()
    reference = _reference(text)
    assert reference, "fixture parsed to nothing"
    ours = scan(text, tuple(reference))
    assert set(ours) == set(reference)
    for name, samples in reference.items():
        got = [(parse_labels(raw), value) for raw, value in ours[name]]
        assert len(got) == len(samples), name
        for (labels, value), (ref_labels, ref_value) in zip(got, samples):
            assert labels == ref_labels, name
            assert _same(value, ref_value), name


def test_scan_reads_whole_names_only_and_never_comments() -> None:
    text = (
        "# HELP x_total not a sample\n# TYPE x counter\nx_total 1\nx_total_created 5\n"
        "x{a=\"1\"} 2\nx_sum 3\n  y 4\nz\t7\n"
    )
    got = scan(text, ("x", "x_total", "y", "z"))
    assert got == {"x_total": [("", 1.0)], "x": [('a="1"', 2.0)], "z": [("", 7.0)]}


def test_scan_skips_a_malformed_value_but_keeps_the_rest() -> None:
    got = scan("a 1\na not-a-number\na{b=\"c\"} 2 1700000000\n", ("a",))
    assert got == {"a": [("", 1.0), ('b="c"', 2.0)]}


def test_parse_labels_handles_escapes_and_braces() -> None:
    raw = 'path="/a b}c",quote="say \\"hi\\"",slash="C:\\\\dir",nl="x\\ny"'
    assert parse_labels(raw) == {"path": "/a b}c", "quote": 'say "hi"', "slash": "C:\\dir", "nl": "x\ny"}
    with pytest.raises(ValueError):
        parse_labels('a="1",garbage')


def test_selector_and_select() -> None:
    name, labels = parse_selector('nv_trt_llm_request_metrics{request_type="active"}')
    assert (name, labels) == ("nv_trt_llm_request_metrics", {"request_type": "active"})
    text = (FIXTURES / "triton.txt").read_text()
    samples = scan(text, (name,))
    assert select(samples, name, labels) == [21.0]
    with pytest.raises(ValueError):
        parse_selector("not a {selector")


@pytest.mark.parametrize("engine", list(ADAPTERS))
def test_engine_detection(engine: str) -> None:
    assert detect_engine((FIXTURES / f"{engine}.txt").read_text()) == engine


def test_detection_of_unknown_page() -> None:
    assert detect_engine("# TYPE foo gauge\nfoo 1\n") is None


def test_vllm_signals() -> None:
    r = MetricsReader().read((FIXTURES / "vllm.txt").read_text())
    assert (r.engine, r.running, r.waiting, r.kv_usage) == ("vllm", 12.0, 3.0, 0.4375)
    assert r.kv_capacity_tokens == 16 * 27910
    # the latest lora_requests_info sample (largest timestamp value) names the adapters in use
    assert r.loaded_adapters == frozenset({"sql-lora", "chat-lora"})
    assert r.requests_total == 1503 + 1677 + 8
    assert (r.latency_sum_s, r.latency_count) == (541.9616, 3188.0)
    assert r.mem_used_bytes is None and r.kernel_queue is None  # not reported: never zero


def test_sglang_signals() -> None:
    r = MetricsReader().read((FIXTURES / "sglang.txt").read_text())
    assert (r.running, r.waiting, r.kv_usage, r.kv_capacity_tokens, r.kv_used_tokens) == (
        28.0, 7.0, 0.28, 446184.0, 124931.0)


def test_tgi_signals() -> None:
    r = MetricsReader().read((FIXTURES / "tgi.txt").read_text())
    assert (r.running, r.waiting, r.kv_used_tokens, r.requests_total) == (24.0, 5.0, 38016.0, 4188.0)
    assert r.kv_usage is None


def test_triton_signals() -> None:
    r = MetricsReader().read((FIXTURES / "triton.txt").read_text())
    assert (r.running, r.waiting, r.kv_usage) == (17.0, 4.0, 0.3125)
    assert r.kv_capacity_tokens == 4096 * 64 and r.kv_used_tokens == 1280 * 64
    assert (r.mem_used_bytes, r.mem_total_bytes, r.gpu_utilization) == (77309411328.0, 85520809984.0, 0.87)
    assert r.requests_total == 1822.0  # the ensemble and its steps are not added up
    assert r.latency_sum_s == pytest.approx(311.047)


def test_triton_without_waiting_type_uses_pending_count() -> None:
    text = (FIXTURES / "triton.txt").read_text().replace('request_type="waiting"', 'request_type="other"')
    assert MetricsReader().read(text).waiting == 2.0


def test_agent_signals_are_summed_over_gpus() -> None:
    r = MetricsReader().read((FIXTURES / "agent.txt").read_text())
    assert r.mem_used_bytes == pytest.approx(6.1203283968e10 + 5.9055800320e10)
    assert r.mem_total_bytes == pytest.approx(2 * 8.5520809984e10)
    assert (r.kernel_queue, r.kv_tokens_per_s) == (37.0, 384.5)
    assert r.gpu_utilization == pytest.approx(0.9)


def test_design_names_win_over_engine_values() -> None:
    text = (FIXTURES / "vllm.txt").read_text() + (FIXTURES / "agent.txt").read_text()
    r = MetricsReader().read(text)
    assert r.engine == "vllm"
    assert r.kernel_queue == 37.0 and r.running == 12.0 and r.kv_tokens_per_s == 384.5


def test_metric_map_maps_any_series_onto_a_signal() -> None:
    mapping = compile_metric_map({
        "my_engine_queue": "waiting",
        "my_engine_active": "running",
        "my_engine_kv_fraction": "kv_usage",
        'my_engine_mem{kind="used"}': "memory_used",
        'my_engine_mem{kind="total"}': "memory_total",
        "my_engine_kv_rate": "kv_tokens_per_second",
        "my_engine_blocks_tokens": "kv_capacity",
        "my_engine_queue_len": "queue_length",
        "my_engine_adapter_loaded": "adapters",
    })
    text = (
        "my_engine_queue 4\nmy_engine_active 9\nmy_engine_kv_fraction{gpu=\"0\"} 0.5\n"
        "my_engine_kv_fraction{gpu=\"1\"} 0.25\nmy_engine_mem{kind=\"used\"} 10\nmy_engine_mem{kind=\"total\"} 40\n"
        "my_engine_kv_rate 99\nmy_engine_blocks_tokens 1000\nmy_engine_queue_len 13\n"
        "my_engine_adapter_loaded{adapter=\"a1\"} 1\nmy_engine_adapter_loaded{adapter=\"a2\"} 0\n"
        "my_engine_adapter_loaded{lora_name=\"a3\"} 1\n"
    )
    r = MetricsReader(metric_map=mapping).read(text)
    assert r.engine is None
    assert (r.waiting, r.running, r.kv_usage) == (4.0, 9.0, 0.375)
    assert (r.mem_used_bytes, r.mem_total_bytes, r.kv_tokens_per_s) == (10.0, 40.0, 99.0)
    assert (r.kv_capacity_tokens, r.kernel_queue) == (1000.0, 13.0)
    assert r.loaded_adapters == frozenset({"a1", "a3"})


def test_metric_map_overrides_the_engine_adapter() -> None:
    mapping = compile_metric_map({"vllm:num_requests_waiting": "running"})
    r = MetricsReader(metric_map=mapping).read((FIXTURES / "vllm.txt").read_text())
    assert r.running == 3.0


def test_metric_map_rejects_unknown_signal() -> None:
    with pytest.raises(ValueError, match="unknown signal 'gpu_temperature'"):
        compile_metric_map({"x": "gpu_temperature"})


def test_forced_engine_skips_detection() -> None:
    r = MetricsReader(engine="sglang").read((FIXTURES / "vllm.txt").read_text())
    assert r.engine == "sglang" and r.running is None


# --- generated pages: any well-formed exposition reads the same as with prometheus_client ------------

_names = st.sampled_from(["vllm:num_requests_running", "sglang:token_usage", "tgi_queue_size", "a", "a_b", "ab",
                          "nv_trt_llm_request_metrics", "gpu_memory_used_bytes", "x:y_z"])
_label_names = st.sampled_from(["model_name", "le", "engine", "gpu", "request_type", "q"])
_label_values = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_values = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=64).map(repr),
    st.integers(-10**12, 10**12).map(str),
    st.sampled_from(["NaN", "+Inf", "-Inf", "1e+06", "-0.0", "3.5E-3"]),
)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


@st.composite
def _pages(draw: st.DrawFn) -> str:
    lines = []
    for name in draw(st.lists(_names, min_size=1, max_size=6, unique=True)):
        lines.append(f"# HELP {name} help text with {{braces}} and \\\\ escapes")
        lines.append(f"# TYPE {name} gauge")
        seen: set[tuple[tuple[str, str], ...]] = set()
        for _ in range(draw(st.integers(1, 4))):
            labels = draw(st.dictionaries(_label_names, _label_values, max_size=3))
            key = tuple(sorted(labels.items()))
            if key in seen:
                continue
            seen.add(key)
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            ts = draw(st.sampled_from(["", " 1700000000000"]))
            lines.append(f"{name}{{{inner}}} {draw(_values)}{ts}" if labels else f"{name} {draw(_values)}{ts}")
    return "\n".join(lines) + "\n"


@settings(max_examples=200, deadline=None)
@given(_pages())
def test_scan_agrees_with_prometheus_client_on_generated_pages(page: str) -> None:
    reference = _reference(page)
    ours = scan(page, tuple(reference))
    assert set(ours) == set(reference)
    for name, samples in reference.items():
        got = [(parse_labels(raw), value) for raw, value in ours[name]]
        assert len(got) == len(samples)
        for (labels, value), (ref_labels, ref_value) in zip(got, samples):
            assert labels == ref_labels and _same(value, ref_value)
