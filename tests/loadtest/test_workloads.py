"""Trace parsing, prompt synthesis (shared ids -> shared prefixes) and the synthetic generators."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.traces import make_samples
from loadtest.workloads import TraceFormatError, build_body, load_workload, parse_window
from loadtest.workloads.azure import parse_timestamp, read_azure
from loadtest.workloads.model import WorkItem
from loadtest.workloads.mooncake import read_mooncake
from loadtest.workloads.text import BlockText, Segment, segments_for
from proxy.core.request import summary_from_openai


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_lines_become_requests_with_block_segments(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "t.jsonl", [
        {"timestamp": 3052, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 7]},
        {"timestamp": 1000, "input_length": 600, "output_length": 0, "hash_ids": [0, 2]},
    ])
    w = read_mooncake(p)
    assert [it.t for it in w.items] == [0.0, 2.052]  # sorted, ms -> s, re-based at the first arrival
    first, second = w.items
    assert first.segments == (Segment(0, 512), Segment(2, 88))
    assert second.segments == (Segment(0, 512), Segment(1, 512), Segment(7, 76))
    assert sum(s.words for s in second.segments) == second.input_tokens == 1100
    assert first.output_tokens == 1  # a zero-length generation still asks for one token


def test_mooncake_length_wins_over_the_number_of_ids(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [4]},
        {"timestamp": 1, "input_length": 100, "output_length": 5, "hash_ids": [4, 5, 6]},
    ])
    a, b = read_mooncake(p).items
    assert [s.words for s in a.segments] == [512, 512, 476] and a.segments[0].block == 4
    assert a.segments[1].block < 0 and a.segments[2].block < 0  # unknown blocks are never shared
    assert b.segments == (Segment(4, 100),)


def test_mooncake_bad_line_names_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1}\n')
    with pytest.raises(TraceFormatError, match=r"bad.jsonl:2"):
        read_mooncake(p)


def test_azure_csv_timestamps_and_columns(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.1805900,1000,1\n"
    )
    w = read_azure(p)
    assert [round(it.t, 3) for it in w.items] == [0.0, 3.5]
    assert [it.input_tokens for it in w.items] == [374, 1000]
    assert w.items[0].segments[0].block != w.items[1].segments[0].block  # no hashes: nothing shared
    assert parse_timestamp("2024-05-10 00:00:00.123456+00:00") == parse_timestamp("2024-05-10 00:00:00.123456")
    bad = tmp_path / "b.csv"
    bad.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(TraceFormatError, match="expected columns"):
        read_azure(bad)


def test_azure_what_if_system_prompt_is_shared(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,100,4\n2023-11-16 18:15:47.1,50,4\n")
    a, b = read_azure(p, system_prompt_tokens=600).items
    assert a.segments[:2] == b.segments[:2] and a.input_tokens == 700 and b.input_tokens == 650


def test_shared_ids_give_byte_identical_prefixes_and_exact_token_counts() -> None:
    text = BlockText(512, namespace=1)
    fresh = iter(range(-1, -100, -1)).__next__
    a = WorkItem(0.0, 1100, 4, segments_for([0, 1, 7], 1100, 512, fresh=fresh))
    b = WorkItem(1.0, 1300, 4, segments_for([0, 1, 9], 1300, 512, fresh=fresh))
    c = WorkItem(2.0, 1100, 4, segments_for([3, 1, 7], 1100, 512, fresh=fresh))
    ta, tb, tc = (text.render(x.segments) for x in (a, b, c))
    wa, wb, wc = ta.split(" "), tb.split(" "), tc.split(" ")
    assert len(wa) == 1100 and len(wb) == 1300  # one word = one simulator token
    assert wa[:1024] == wb[:1024] and wa[1024:1030] != wb[1024:1030]
    # A different first id changes the first block; the same id later renders the same words, but a prefix
    # cache chains block keys, so c shares no cached prefix with a.
    assert wa[:512] != wc[:512] and wa[512:1024] == wc[512:1024]
    assert BlockText(512, namespace=1).render(a.segments) == ta  # deterministic across instances
    assert BlockText(512, namespace=2).render(a.segments) != ta  # namespaces keep traces apart


def test_chat_turns_extend_the_previous_prompt_for_the_proxy_and_the_simulator() -> None:
    from sim.api import render_chat

    w = load_workload("chat:sessions=3,turns_mean=4,think_s=1", seed=3)
    text = w.text()
    by_session: dict[str, list[WorkItem]] = {}
    for it in w.items:
        by_session.setdefault(it.session or "", []).append(it)
    checked = 0
    for items in by_session.values():
        for prev, cur in zip(items, items[1:]):
            _, bp = build_body(prev, text, model="m")
            _, bc = build_body(cur, text, model="m")
            assert render_chat(bc["messages"]).startswith(render_chat(bp["messages"]))
            sp = summary_from_openai("/v1/chat/completions", bp)
            sc = summary_from_openai("/v1/chat/completions", bc)
            assert sc.prompt.startswith(sp.prompt)
            checked += 1
    assert checked > 0


def test_synthetic_generators_are_seeded_and_shaped() -> None:
    mix = load_workload("mix:requests=200", seed=1)
    assert {it.output_tokens for it in mix.items} == {128, 2048}
    assert [it.input_tokens for it in mix.items] == [it.input_tokens for it in load_workload("mix:requests=200", seed=1).items]
    assert [it.t for it in mix.items] != [it.t for it in load_workload("mix:requests=200", seed=2).items]
    sp = load_workload("sysprompt:requests=100,system_prompts=3", seed=0)
    firsts = {it.messages[0].segments for it in sp.items}
    assert len(firsts) <= 3  # a few long system prompts shared by many users
    lora = load_workload("lora:requests=50,adapters=4")
    assert {it.model for it in lora.items} <= {f"lora-{i}" for i in range(4)}
    _, body = build_body(lora.items[0], lora.text(), model="base")
    assert body["model"] == lora.items[0].model and body["ignore_eos"] is True
    with pytest.raises(ValueError, match="unknown parameter"):
        load_workload("chat:nope=1")


def test_window_and_spec_parsing() -> None:
    assert parse_window("10:20") == (10.0, 20.0) and parse_window(":5") == (None, 5.0)
    with pytest.raises(ValueError):
        parse_window("20:10")
    w = load_workload("mooncake", prefer_sample=True).window(10, 30)
    assert w.items[0].t == 0.0 and w.duration < 20
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("nonsense")


def test_shipped_samples_are_reproducible_and_in_format(tmp_path: Path) -> None:
    out = tmp_path / "azure.csv"
    make_samples.main(["--only", "azure-code", "--out", str(out)])
    assert out.read_bytes() == (make_samples.HERE / "azure_code_sample.csv").read_bytes()
    lines = (make_samples.HERE / "mooncake_synthetic_sample.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    assert set(rec) == {"timestamp", "input_length", "output_length", "hash_ids"}
    regenerated = make_samples.mooncake_synthetic(600.0, 0)
    assert json.loads(lines[-1]) == regenerated[-1] and len(regenerated) == len(lines)
    w = load_workload("mooncake", prefer_sample=True)
    s = w.summary()
    assert 13000 < s["input_tokens_mean"] < 17500 and 3.5 < s["rate_rps"] < 4.3  # published: 15,325 and 3.9/s
