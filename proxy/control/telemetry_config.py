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
class KVEventsEndpoint:
    """Where one backend publishes its KV-cache events (vLLM `--kv-events-config`).

    ``{host}`` in an endpoint stands for the backend's URL host; for a backend discovered by DNS
    (`discovery`, a Kubernetes headless Service) the entry under the service's name is a template that
    every address it resolves to fills in (``tcp://{host}:5557``: each pod's own publisher)."""

    endpoint: str = field(metadata={"min_len": 1})  # the PUB socket, e.g. tcp://10.0.0.7:5557 or tcp://{host}:5557
    topic: str = ""
    replay_endpoint: str | None = None  # the ROUTER socket; without it a sequence gap clears the index
    model: str | None = None  # base model name that seeds block keys (default: the backend's first model)

    def validate(self) -> Iterable[tuple[str, str]]:
        for name, value in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                yield name, f"must be a ZeroMQ endpoint (tcp://host:port, ipc://path), got {value!r}"
            elif value is not None and ("{" in value.replace("{host}", "") or "}" in value.replace("{host}", "")):
                yield name, f"the only placeholder is {{host}} (the backend's URL host), got {value!r}"


@dataclass(frozen=True)
class KVEventsConfig:
    """The engines' own KV-cache events feed a precise per-backend index (`proxy/core/kv_index.py`).

    ```yaml
    telemetry:
      kv_events:
        backends:                     # backend name -> its publisher; backends not listed keep the learned index
          gpu-0: {endpoint: "tcp://10.0.0.7:5557", replay_endpoint: "tcp://10.0.0.7:5558", topic: ""}
          vllm: {endpoint: "tcp://{host}:5557", replay_endpoint: "tcp://{host}:5558"}  # a discovered
                                      # service: one subscription per address it resolves to
        tokenizers:                   # model name -> folder with tokenizer.json (+ tokenizer_config.json)
          meta-llama/Meta-Llama-3-8B-Instruct: /models/llama3-8b
        stale_after_s: 30             # no event for this long: stale, routed by the learned index (0 = never)
        replay_timeout_ms: 2000       # a replay that has not ended by then failed: the index is cleared
        precise_wait_ms: 200          # a long, uncached prompt waits this long at most for its tokenisation
                                      # (off the event loop) before its pick; then the learned index routes it
                                      # (0 = never wait: such a prompt is always routed by the learned index)
        precise_wait_concurrency: 4   # at most this many prompts are tokenised off the event loop at once
                                      # (per process); a long first sighting past that does not wait: the
                                      # learned index routes it
        drain_interval_ms: 250       # the events that arrived are applied before every pick, and at least
                                      # this often otherwise, all engines' batches back to back (0 = as each
                                      # message arrives: a wake-up of the process per batch)
    ```
    """

    backends: dict[str, KVEventsEndpoint] = field(default_factory=dict)
    tokenizers: dict[str, str] = field(default_factory=dict)
    stale_after_s: float = field(default=30.0, metadata={"ge": 0})
    replay_timeout_ms: int = field(default=2000, metadata={"ge": 1})
    precise_wait_ms: int = field(default=200, metadata={"ge": 0, "le": 60000})
    precise_wait_concurrency: int = field(default=4, metadata={"ge": 1, "le": 1024})
    drain_interval_ms: int = field(default=250, metadata={"ge": 0, "le": 60000})

    def validate(self) -> Iterable[tuple[str, str]]:
        # Each folder must load, checked when the config is loaded and on every reload (as TLS files are):
        # a reload naming a bad one is refused and the running configuration keeps serving.
        if self.tokenizers:
            from proxy.dataplane.tokenize import tokenizer_folder_error  # only configs with tokenizers pay for it

            for model, path in self.tokenizers.items():
                error = tokenizer_folder_error(path)
                if error is not None:
                    yield f"tokenizers.{model}", f"cannot load the tokenizer: {error}"

    @property
    def enabled(self) -> bool:
        return bool(self.backends)


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
      kv_events: {...}            # the engines' KV-cache events: see KVEventsConfig
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
    kv_events: KVEventsConfig = KVEventsConfig()

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
