"""Plain-value builders shared by the core tests: fleets, requests, in-flight bookkeeping."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from proxy.core.affinity import rendezvous_order
from proxy.core.decision import Decision, Inflight
from proxy.core.fingerprint import Fingerprinter
from proxy.core.request import RequestSummary, summary_from_openai
from proxy.core.routing_config import AffinityConfig
from proxy.core.snapshot import BackendSpec, Health, Signals, Snapshot


def fleet(n: int = 4, *, weights: Iterable[float] | None = None, prefix: str = "gpu-") -> Snapshot:
    ws = list(weights) if weights is not None else [1.0] * n
    return Snapshot.initial(BackendSpec(f"{prefix}{i}", f"http://127.0.0.1:{8000 + i}", w) for i, w in enumerate(ws))


def with_state(snap: Snapshot, name: str, **changes: object) -> Snapshot:
    return snap.replace_backend(name, **changes)


def fresh(snap: Snapshot, scores: dict[str, float], kv_capacity_tokens: float | None = None) -> Snapshot:
    """Every named backend gets fresh telemetry with the given load score."""
    out = []
    for b in snap.backends:
        if b.name in scores:
            b = replace(
                b,
                health=Health.HEALTHY,
                load_score=scores[b.name],
                stale=False,
                signals=Signals(scraped_at=0.0, kv_capacity_tokens=kv_capacity_tokens),
            )
        out.append(b)
    return snap.evolve(out)


def prompt(text: str, **kw: object) -> RequestSummary:
    return RequestSummary(prompt=text, **kw)  # type: ignore[arg-type]  # tests pass fields of several types by name


def chat(messages: list[tuple[str, str]], **body: object) -> RequestSummary:
    return summary_from_openai(
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages], **body},
    )


class Ledger:
    """The data plane's in-flight accounting, driven by decisions."""

    def __init__(self) -> None:
        self.inflight: dict[str, Inflight] = {}

    def start(self, d: Decision, tokens: int = 0) -> None:
        i = self.inflight.setdefault(d.backend, Inflight())
        i.requests += 1
        i.tokens += tokens

    def finish(self, backend: str, tokens: int = 0) -> None:
        i = self.inflight[backend]
        i.requests -= 1
        i.tokens -= tokens

    def requests(self, name: str) -> int:
        i = self.inflight.get(name)
        return i.requests if i else 0


__all__ = ["Health", "Ledger", "chat", "fleet", "fresh", "prompt", "with_state"]


def home_order(req: RequestSummary, snap: Snapshot, cfg: AffinityConfig = AffinityConfig()) -> list[str]:
    """Every backend of `snap` in the prompt's rendezvous order: its hash home first, then where the
    affinity policy falls back when the ones before are unavailable."""
    key = Fingerprinter(cfg).keys(req).hash_key
    return rendezvous_order(list(snap.names), [b.effective_weight for b in snap.backends], key)
