"""What a load-test run is and what it recorded: the data `loadtest.run` and `loadtest.replay` produce and
`loadtest.report` and `loadtest.compare` read, in a module of its own so that none of them has to import
another to share it (run.py and report.py used to import each other).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class Record:
    """What one request saw. Times are seconds; `sent` is relative to the run's start."""

    index: int
    sent: float
    scheduled: float
    input_tokens: int
    status: int = 0  # HTTP status; 0 when no response arrived
    ttft: float | None = None
    e2e: float | None = None
    tpot: float | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    backend: str | None = None
    error: str | None = None
    # The proxy's x-request-id for it (the key of its access-log line: reason, KV holder, load at the pick).
    request_id: str | None = None


@dataclass
class RunConfig:
    url: str
    model: str = "llama3-8b"
    speed: float = 1.0
    closed: int | None = None  # closed loop with N users
    session_header: str | None = None
    timeout_s: float = 600.0
    max_inflight: int = 4096
    progress: bool = True
    label: str = ""
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunResult:
    meta: dict[str, Any]
    records: list[Record]
    samples: list[dict[str, Any]]
    capacity_tokens: dict[str, int]
    wall_s: float
    proxy_cpu_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        cols = [f for f in Record.__dataclass_fields__]
        return {
            "meta": self.meta,
            "wall_s": self.wall_s,
            "proxy_cpu_s": self.proxy_cpu_s,
            "capacity_tokens": self.capacity_tokens,
            "record_columns": cols,
            "records": [[getattr(r, c) for c in cols] for r in self.records],
            "samples": self.samples,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RunResult":
        cols = data["record_columns"]
        records = [Record(**dict(zip(cols, row))) for row in data["records"]]
        return cls(data["meta"], records, data["samples"], data.get("capacity_tokens", {}), data["wall_s"], data.get("proxy_cpu_s"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> "RunResult":
        return cls.from_json(json.loads(Path(path).read_text()))
