"""loadtest/bench_kv_events.py: the replay's KV events, as vLLM publishes them, through the proxy's subscriber."""

from __future__ import annotations

import json

from loadtest import bench_kv_events


def test_the_bench_feeds_a_recorded_stream_to_the_subscriber_and_checks_the_index(tmp_path, capsys) -> None:
    frames, out = tmp_path / "frames.msgpack", tmp_path / "rows.json"
    assert bench_kv_events.main(["--workload", "mooncake", "--sample", "--window", "0:8", "--encoding", "array",
                                 "--repeat", "1", "--pace", "100", "--drain-interval-ms", "0,50",
                                 "--modes", "messages,sockets,drain", "--subscriptions", "3",
                                 "--frames-out", str(frames), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["encoding"], r["mode"], r["drain_interval_ms"]) for r in rows] == [
        ("array", "messages", None), ("array", "sockets", 0), ("array", "sockets", 50)]
    assert all(r["batches"] > 0 and r["events"] >= r["batches"] and r["us_per_batch"] > 0 for r in rows)
    table = capsys.readouterr().out
    assert "| array | sockets | 0 ms |" in table and "| array | sockets | 50 ms |" in table
    assert [(r["subscriptions"], len(r["us_per_pick"])) for r in data["drain"]] == [(3, 1)]
    assert data["drain"][0]["us_per_pick"][0] > 0 and "| 3 | " in table
    # The saved stream replays; an index that ends differently from the engines is an error, not a row.
    stream = bench_kv_events.Stream.load(str(frames))
    assert stream.requests == rows[0]["requests"]
    name = next(iter(stream.engine_blocks))
    stream.engine_blocks[name] += 1
    try:
        bench_kv_events.bench_messages(stream, "array")
    except SystemExit as exc:
        assert "the engines hold" in str(exc)
    else:
        raise AssertionError("a wrong block count was not caught")
