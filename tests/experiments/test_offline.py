"""The same experiment offline: loadtest/experiment_replay.py splits a trace between the arms in virtual time."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from loadtest.experiment_replay import load_experiments, main, replay_experiment
from loadtest.replay import ReplayConfig
from loadtest.workloads import load_workload

YAML = """routing: {policy: affinity}
experiments:
  definitions:
    - name: build
      control: stable
      arms:
        - {name: stable}
        - {name: canary, share: 0.3, backends: [sim-3], routing: {policy: round_robin}}
"""


async def test_offline_split_is_sticky_and_confines_the_canary_group(tmp_path: Path) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text(YAML)
    experiments, routing = load_experiments(path)
    workload = load_workload("chat", seed=0).window(None, None, 300)
    result, table = await replay_experiment(workload, experiments, routing, ReplayConfig(policy="affinity", backends=4))
    assert sum(row["requests"] for row in table.values()) == len(result.records) == len(workload.items)
    assert set(table) == {"build/stable", "build/canary"}
    assert set(table["build/canary"]["backends"]) == {"sim-3"}
    assert "sim-3" not in table["build/stable"]["backends"]
    assert all(row["errors"] == 0 and row["ttft_p99_s"] is not None for row in table.values())
    # every conversation of the trace in one arm: the arm's backends tell
    arms_of: dict[str, set[bool]] = defaultdict(set)
    for rec in result.records:
        arms_of[str(workload.items[rec.index].session)].add(rec.backend == "sim-3")
    assert all(len(a) == 1 for a in arms_of.values())
    assert 0.1 < table["build/canary"]["share"] < 0.5


def test_cli_writes_the_per_arm_table(tmp_path: Path, capsys: object) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text(YAML)
    out = tmp_path / "report.md"
    main(["--experiments", str(path), "--workload", "chat", "--limit", "100", "--out", str(out)])
    text = out.read_text()
    assert "| build/canary |" in text and "| build/stable |" in text
    assert out.with_suffix(".json").exists()
