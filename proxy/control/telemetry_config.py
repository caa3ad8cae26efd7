"""The `telemetry:` section of the YAML configuration.

Kept apart from the poller so that loading a configuration does not import aiohttp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from proxy.control.adapters import ADAPTERS, compile_metric_map
from proxy.core.bounds import check_config
from proxy.core.score import ScoreConfig


@dataclass(frozen=True)
class TelemetryConfig:
    """How often and how the backends' metrics are read, and how they become a load score.

    ```yaml
    telemetry:
      enabled: true
      interval_ms: 200            # one scrape round every 200 ms (5 Hz)
      timeout_ms: 150             # per scrape; must be shorter than the interval
      stale_after_intervals: 3    # metrics older than 3 intervals: stale, score unknown (must be > 1)
      engine: auto                # auto-detect from the page, or vllm | sglang | tgi | triton | agent
      metric_map:                 # any series onto a signal (wins over the engine adapter)
        'my_queue_len': waiting
        'nv_trt_llm_request_metrics{request_type="active"}': running
      orca: true                  # use endpoint-load-metrics response headers between scrapes
      score: {kind: design, memory_weight: 0.4, queue_weight: 0.35, kv_rate_weight: 0.25,
              queue_full: 100, kv_tokens_per_s_full: 512}
    ```
    """

    enabled: bool = True
    interval_ms: int = field(default=200, metadata={"ge": 10})
    timeout_ms: int = field(default=150, metadata={"ge": 1})
    stale_after_intervals: float = field(default=3.0, metadata={"gt": 1.0})
    engine: str = "auto"  # "auto" or a name in proxy/control/adapters.py's ADAPTERS
    metric_map: dict[str, str] = field(default_factory=dict)
    orca: bool = True
    score: ScoreConfig = ScoreConfig()

    def __post_init__(self) -> None:
        # Also enforced for configs built in code, not only from YAML (proxy/core/bounds.py).
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        engines = ("auto", *ADAPTERS)
        if self.engine not in engines:
            yield "engine", f"must be one of {', '.join(map(repr, engines))}, got {self.engine!r}"
        if self.timeout_ms >= self.interval_ms:
            yield "timeout_ms", (f"must be shorter than interval_ms ({self.interval_ms}): a slow scrape would "
                                 "overlap the next round")
        try:
            compile_metric_map(self.metric_map)
        except ValueError as exc:
            yield "metric_map", str(exc)

    @property
    def interval_s(self) -> float:
        return self.interval_ms / 1000.0

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000.0

    @property
    def stale_after_s(self) -> float:
        return self.interval_s * self.stale_after_intervals
