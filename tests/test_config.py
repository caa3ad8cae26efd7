"""The typed YAML parser: every error names its path and line; sections plug in as plain dataclasses."""

from __future__ import annotations

import enum
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from proxy.config import (
    AdminConfig,
    BackendConfig,
    Config,
    ConfigError,
    dump_config,
    load_config,
    parse_config,
    parse_section,
)
from proxy.core.registry import POLICIES
from proxy.core.routing_config import RoutingConfig

ROOT = Path(__file__).resolve().parents[1]


class Color(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Inner:
    ratio: float = field(default=0.5, metadata={"ge": 0, "le": 1})
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class Section:
    count: int = 1
    label: str | None = None
    flag: bool = False
    color: Color = Color.RED
    mode: Literal["fast", "safe"] = "safe"
    tags: list[int] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)
    inner: Inner = Inner()
    raw: Any = None


def errors_of(cls: type, text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_section(cls, text)
    return info.value.errors


def test_every_supported_type_parses() -> None:
    s = parse_section(Section, """
count: 3
label: null
flag: true
color: blue
mode: fast
tags: [1, 2]
weights: {a: 1, b: 2.5}
inner: {ratio: 1, names: [x, y]}
raw: {anything: [1, 2]}
""")
    assert s == Section(3, None, True, Color.BLUE, "fast", [1, 2], {"a": 1.0, "b": 2.5},
                        Inner(1.0, ("x", "y")), {"anything": [1, 2]})
    assert isinstance(s.inner.ratio, float) and isinstance(s.weights["a"], float)


def test_errors_name_path_and_line_and_all_are_reported() -> None:
    errs = errors_of(Section, """count: "3"
flag: 1
color: green
mode: fsat
tags: [1, x]
inner:
  ratio: 1.5
  nmes: [a]
""")
    assert errs == [
        "count (line 1): must be an integer, got str '3'",
        "flag (line 2): must be true or false, got int 1",
        "color (line 3): must be one of 'red', 'blue', got 'green'",
        "mode (line 4): must be one of 'fast', 'safe', got 'fsat' (did you mean 'fast'?)",
        "tags[1] (line 5): must be an integer, got str 'x'",
        "inner.ratio (line 7): must be <= 1, got 1.5",
        "inner.nmes (line 8): unknown key (did you mean 'names'?)",
    ]


def test_config_errors_and_did_you_mean() -> None:
    errs = errors_of(Config, """listen: {host: 127.0.0.1, prot: 8080}
backends:
  - {name: a, url: "http://127.0.0.1:1"}
  - {name: a, url: "ftp://x"}
  - {url: "http://127.0.0.1:2"}
routing:
  policy: round_robn
""")
    assert "listen.prot (line 1): unknown key (did you mean 'port'?)" in errs
    assert "backends[1].url (line 4): must start with http:// or https://, got 'ftp://x'" in errs
    assert "backends[2].name (line 5): is required" in errs
    assert any(e.startswith("routing.policy (line 7): must be one of") for e in errs)


def test_one_pass_reports_errors_of_every_layer() -> None:
    # A wrong field must not hide its section's own checks (the nested affinity section's bounds), nor the
    # whole config's (duplicate names, checked on the whole backend list although one entry has a typo; the
    # policy name, checked against the table of policies). The user fixes all in one go.
    errs = errors_of(Config, """backends:
  - name: a
    url: http://127.0.0.1:1
    weigth: 2
  - {name: a, url: "http://127.0.0.1:2"}
routing:
  policy: afinity
  affinity: {epsilon: -1}
telemetry: {interval_ms: 200, timeout_ms: 500}
""")
    assert errs == [
        "backends[0].weigth (line 4): unknown key (did you mean 'weight'?)",
        "routing.affinity.epsilon (line 8): must be > 0.0, got -1.0",
        "telemetry.timeout_ms (line 9): must be shorter than interval_ms (200): a slow scrape would overlap "
        "the next round",
        "backends[1].name (line 5): duplicate backend name 'a' (also backends[0])",
        f"routing.policy (line 7): must be one of {', '.join(POLICIES)}, not 'afinity' (did you mean 'affinity'?)",
    ]


def test_a_check_about_a_wrong_field_is_not_reported_twice() -> None:
    # interval_ms is wrong, so the default stands in while the section's checks run: the cross-field check
    # must not then blame timeout_ms against a default the user never wrote.
    errs = errors_of(Config, "telemetry: {interval_ms: -5, timeout_ms: 150}\nbackends: [{name: a, url: 'http://h:1'}]\n")
    assert len(errs) == 1 and errs[0].startswith("telemetry.interval_ms (line 1): must be")


def test_duplicate_backend_names_rejected() -> None:
    errs = errors_of(Config, 'backends:\n  - {name: a, url: "http://h:1"}\n  - {name: a, url: "http://h:2"}\n')
    assert errs == ["backends[1].name (line 3): duplicate backend name 'a' (also backends[0])"]


def test_yaml_syntax_error_has_line() -> None:
    errs = errors_of(Config, "listen: {port: 1\nadmin: [\n")
    assert len(errs) == 1 and errs[0].startswith("<yaml> (line")


def test_empty_file_is_invalid_and_dump_round_trips() -> None:
    # A file caught between truncate and rewrite must not pass for "all defaults, no backends".
    for empty in ("", "\n  \n", "# only a comment\n"):
        assert errors_of(Config, empty) and "empty" in errors_of(Config, empty)[0]
    cfg = parse_config('debug_headers: true\nbackends: [{name: g, url: "http://h:1", models: [m]}]\n')
    assert parse_config(dump_config(cfg)) == cfg


def test_shipped_configs_are_valid() -> None:
    files = sorted((ROOT / "config").glob("*.yaml"))
    assert files, "config/ ships at least one example"
    for f in files:
        load_config(str(f))


def test_check_config_cli(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends:\n  - {name: a, url: 'http://h:1', wieght: 2}\ntimeouts: {drain_s: -1}\n")
    run = subprocess.run([sys.executable, "-m", "proxy", "check-config", str(bad)], capture_output=True, text=True,
                         cwd=ROOT)
    assert run.returncode == 2
    assert "backends[0].wieght (line 2): unknown key (did you mean 'weight'?)" in run.stderr
    assert "timeouts.drain_s (line 3): must be >= 0, got -1.0" in run.stderr
    good = tmp_path / "good.yaml"
    good.write_text("backends:\n  - {name: a, url: 'http://h:1'}\n")
    run = subprocess.run([sys.executable, "-m", "proxy", "check-config", str(good)], capture_output=True, text=True,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert parse_config(run.stdout) == load_config(str(good))


# ------------------------------------------------------------------ every door's validator (issue 18)

ONE_BACKEND = "backends: [{name: a, url: 'http://h:1'}]\n"


@pytest.mark.parametrize("number", [".inf", "-.inf", ".nan", ".NaN", "1.0e+309"])
def test_non_finite_numbers_are_rejected_everywhere(number: str) -> None:
    # weight has a lower bound that inf passes; memory_weight had only a hand-written `< 0` check that NaN
    # passes; connect_s is a plain `> 0` bound. All three must refuse a number the routing cannot use.
    errs = errors_of(Config, f"""backends: [{{name: a, url: 'http://h:1', weight: {number}}}]
telemetry: {{score: {{memory_weight: {number}}}}}
timeouts: {{connect_s: {number}}}
""")
    assert any(e.startswith("backends[0].weight (line 1): must be a finite number") for e in errs), errs
    assert any(e.startswith("telemetry.score.memory_weight (line 2): must be a finite number") for e in errs), errs
    assert any(e.startswith("timeouts.connect_s (line 3): must be a finite number") for e in errs), errs


def test_no_backend_is_invalid_unless_discovery_is_on() -> None:
    assert errors_of(Config, "backends: []\n") == [
        "backends (line 1): at least one backend is required (unless discovery is enabled)"]
    assert errors_of(Config, "listen: {port: 8080}\n") == [
        "backends (line 1): at least one backend is required (unless discovery is enabled)"]
    assert parse_config("backends: []\ndiscovery: {enabled: true}\n").backends == ()


def test_listener_port_clashes_are_rejected() -> None:
    errs = errors_of(Config, ONE_BACKEND + "listen: {port: 8080}\nadmin: {port: 8080}\n")
    assert errs == ["admin.port (line 3): port 8080 is already used by listen.port"]
    errs = errors_of(Config, ONE_BACKEND + "listen: {host: 0.0.0.0, port: 8080}\ngrpc_listen: {port: 8080}\n")
    assert errs == ["grpc_listen.port (line 3): port 8080 is already used by listen.port"]
    # Port 0 picks a free port each time, and two distinct addresses may share a port number.
    parse_config(ONE_BACKEND + "listen: {port: 0}\nadmin: {port: 0}\ngrpc_listen: {port: 0}\n")
    parse_config(ONE_BACKEND + "listen: {host: 10.0.0.1, port: 80}\nadmin: {host: 127.0.0.1, port: 80}\n")


def test_duplicate_backend_urls_are_rejected() -> None:
    errs = errors_of(Config, "backends:\n  - {name: a, url: 'http://h:1'}\n  - {name: b, url: 'http://h:1/'}\n")
    assert errs == ["backends[1].url (line 3): duplicate backend URL 'http://h:1' (also backends[0])"]


def test_configs_built_in_code_meet_the_same_rules() -> None:
    from proxy.core.bounds import ConfigValueError

    with pytest.raises(ConfigValueError, match="weight: must be a finite number"):
        BackendConfig(name="a", url="http://h:1", weight=float("inf"))
    with pytest.raises(ConfigValueError, match="at least one backend"):
        Config()
    with pytest.raises(ConfigValueError, match="routing.policy: must be one of"):
        Config(backends=(BackendConfig(name="a", url="http://h:1"),), routing=RoutingConfig(policy="fastest"))
    with pytest.raises(ConfigValueError, match="admin.port"):
        Config(backends=(BackendConfig(name="a", url="http://h:1"),), admin=AdminConfig(port=8080))


def test_check_config_cli_refuses_an_empty_file_and_an_infinite_weight(tmp_path: Path) -> None:
    for name, text in (("empty.yaml", ""), ("inf.yaml", "backends:\n  - {name: a, url: 'http://h:1', weight: .inf}\n")):
        f = tmp_path / name
        f.write_text(text)
        run = subprocess.run([sys.executable, "-m", "proxy", "check-config", str(f)], capture_output=True, text=True,
                             cwd=ROOT)
        assert run.returncode == 2, (name, run.stdout)
        assert ("empty" if name == "empty.yaml" else "must be a finite number") in run.stderr
