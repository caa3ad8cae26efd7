"""The workload as the load generator, the report and the offline replay all see it.

A workload is a list of requests with arrival times in trace seconds and prompts described as block
segments, not text: a one-hour trace of 15k-token prompts would be gigabytes of text, so text is rendered
just before a request is sent (and never, in the offline replay, which only needs the block structure and
token counts). Every consumer therefore agrees on one description of "what was asked" and "what could have
been cached".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from loadtest.workloads.text import BlockText, Segment

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    segments: tuple[Segment, ...]


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request. `segments` is a completions prompt; `messages`, when set, makes it a chat request."""

    t: float  # arrival in trace seconds from the workload's start (before --speed)
    input_tokens: int
    output_tokens: int
    segments: tuple[Segment, ...] = ()
    messages: tuple[Message, ...] = ()
    model: str | None = None  # None: the run's default model; otherwise e.g. a LoRA adapter's name
    session: str | None = None  # sent as the session header when the run asks for it

    @property
    def chain(self) -> tuple[Segment, ...]:
        """All prompt segments in order: what a prefix cache sees."""
        if not self.messages:
            return self.segments
        out: list[Segment] = []
        for m in self.messages:
            out.extend(m.segments)
        return tuple(out)


@dataclass(slots=True)
class Workload:
    name: str
    items: list[WorkItem]
    block_tokens: int = 512  # tokens per block id of the source (512 for Mooncake)
    namespace: int = 0  # separates the block texts of unrelated sources
    source: str = ""  # file path or generator parameters, for the report
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.items[-1].t - self.items[0].t if self.items else 0.0

    def text(self) -> BlockText:
        return BlockText(self.block_tokens, namespace=self.namespace)

    def window(self, start: float | None = None, end: float | None = None, limit: int | None = None) -> "Workload":
        """A slice in trace seconds [start, end), re-based to start at 0, then at most `limit` requests."""
        lo = start if start is not None else float("-inf")
        hi = end if end is not None else float("inf")
        picked = [it for it in self.items if lo <= it.t < hi]
        if limit is not None:
            picked = picked[:limit]
        base = picked[0].t if picked else 0.0
        items = [replace(it, t=it.t - base) for it in picked]
        return Workload(
            self.name, items, self.block_tokens, self.namespace, self.source,
            {**self.meta, "window": [start, end], "limit": limit},
        )

    def summary(self) -> dict[str, Any]:
        n = len(self.items)
        ins = sorted(it.input_tokens for it in self.items)
        outs = sorted(it.output_tokens for it in self.items)
        return {
            "name": self.name,
            "source": self.source,
            "requests": n,
            "duration_s": round(self.duration, 3),
            "rate_rps": round(n / self.duration, 3) if self.duration > 0 else None,
            "input_tokens_mean": round(sum(ins) / n, 1) if n else 0,
            "input_tokens_p50": ins[n // 2] if n else 0,
            "output_tokens_mean": round(sum(outs) / n, 1) if n else 0,
            "output_tokens_p50": outs[n // 2] if n else 0,
        }


def parse_window(spec: str | None) -> tuple[float | None, float | None]:
    """`START:END` in trace seconds; either side may be empty (``:600``, ``1200:``)."""
    if not spec:
        return None, None
    if ":" not in spec:
        raise ValueError(f"--window must be START:END in seconds, got {spec!r}")
    a, b = spec.split(":", 1)
    start = float(a) if a.strip() else None
    end = float(b) if b.strip() else None
    if start is not None and end is not None and end <= start:
        raise ValueError(f"--window end must be after start, got {spec!r}")
    return start, end


def build_body(
    item: WorkItem,
    text: BlockText,
    *,
    model: str,
    stream: bool = True,
    extra: dict[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """The OpenAI request for `item`. `ignore_eos` makes the engine produce exactly `output_tokens`.

    `ignore_eos` is a vLLM/SGLang extension honoured by the simulator; without it output lengths would be
    drawn by the engine and the trace's generation lengths (half of the load) would be lost.
    """
    body: dict[str, Any] = {
        "model": item.model or model,
        "max_tokens": item.output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if extra:
        body.update(extra)
    if item.messages:
        body["messages"] = [{"role": m.role, "content": text.render(m.segments)} for m in item.messages]
        return CHAT, body
    body["prompt"] = text.render(item.segments)
    return COMPLETIONS, body


def total_tokens(items: Iterable[WorkItem]) -> int:
    return sum(it.input_tokens for it in items)
