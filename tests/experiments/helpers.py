"""What the live experiment tests share: a multi-turn chat workload, configs, a /metrics reader."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from sim.fleet import Fleet

SYSTEM = "You are a concise assistant. Answer in one short paragraph."


@dataclass
class Reply:
    conversation: int
    turn: int
    status: int
    backend: str | None
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Conversation:
    index: int
    turns: int
    topic: str = ""
    replies: list[Reply] = field(default_factory=list)

    def messages(self, turn: int) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Conversation {self.index}: tell me about {self.topic} number {self.index}."}]
        for t in range(1, turn + 1):
            msgs.append({"role": "assistant", "content": f"Here is part {t} about {self.topic} {self.index}. " * 3})
            msgs.append({"role": "user", "content": f"Go on with part {t + 1}, please."})
        return msgs


def conversations(n: int, turns: int, topic: str = "rivers", start: int = 0) -> list[Conversation]:
    return [Conversation(start + i, turns, topic) for i in range(n)]


def body(model: str, conv: Conversation, turn: int, *, stream: bool = False, max_tokens: int = 2) -> dict[str, Any]:
    b: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "messages": conv.messages(turn)}
    if stream:
        b["stream"] = True
        b["stream_options"] = {"include_usage": True}
    return b


async def send(session: aiohttp.ClientSession, url: str, model: str, conv: Conversation, turn: int, *,
               stream: bool = False, headers: dict[str, str] | None = None) -> Reply:
    async with session.post(url + "/v1/chat/completions", json=body(model, conv, turn, stream=stream),
                            headers=headers) as resp:
        data = await resp.read()
        reply = Reply(conv.index, turn, resp.status, resp.headers.get("x-affinity-backend"))
        if resp.status == 200 and not stream:
            import json

            usage = json.loads(data).get("usage") or {}
            reply.prompt_tokens = usage.get("prompt_tokens", 0)
            reply.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    conv.replies.append(reply)
    return reply


async def run_turns(url: str, model: str, convs: list[Conversation], *, concurrency: int = 16,
                    stream: bool = False) -> list[Reply]:
    """Every conversation turn by turn (a conversation's turns in order, conversations concurrently)."""
    sem = asyncio.Semaphore(concurrency)
    out: list[Reply] = []
    async with aiohttp.ClientSession() as s:
        async def one(conv: Conversation) -> None:
            for t in range(conv.turns):
                async with sem:
                    out.append(await send(s, url, model, conv, t, stream=stream))

        await asyncio.gather(*(one(c) for c in convs))
    return out


async def load_until(url: str, model: str, stop: Callable[[], bool], *, concurrency: int = 8, turns: int = 3,
                     start: int = 0, stream: bool = False, topic: str = "lakes",
                     on_reply: Callable[[Reply], Awaitable[None] | None] | None = None) -> list[Conversation]:
    """Fresh multi-turn conversations, `concurrency` at a time, until `stop()`."""
    convs: list[Conversation] = []
    counter = [start]
    async with aiohttp.ClientSession() as s:
        async def worker() -> None:
            while not stop():
                conv = Conversation(counter[0], turns, topic)
                counter[0] += 1
                convs.append(conv)
                for t in range(turns):
                    if stop():
                        break
                    reply = await send(s, url, model, conv, t, stream=stream)
                    if on_reply is not None:
                        r = on_reply(reply)
                        if r is not None:
                            await r

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return convs


def fleet_backends_yaml(fleet: Fleet) -> str:
    return "\n".join(f"  - {{name: {s.name}, url: '{s.url}'}}" for s in fleet.servers)


def proxy_yaml(fleet: Fleet, experiments: str, *, port: int = 0, admin_port: int = 0, extra: str = "") -> str:
    return (f"listen: {{host: 127.0.0.1, port: {port}}}\nadmin: {{host: 127.0.0.1, port: {admin_port}}}\n"
            "debug_headers: true\ntelemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
            "outlier_detection: {enabled: false}\nretries: {enabled: false}\ntimeouts: {drain_s: 10}\n"
            f"routing: {{policy: affinity}}\n{extra}experiments:\n{experiments}backends:\n{fleet_backends_yaml(fleet)}\n")


async def scrape(admin_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the admin /metrics as {(name, sorted labels): value}."""
    async with aiohttp.ClientSession() as s:
        async with s.get(admin_url + "/metrics") as resp:
            text = await resp.text()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def sample(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def admin_json(admin_url: str, timeline: bool = False) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.get(admin_url + "/admin/experiments" + ("?timeline=1" if timeline else "")) as resp:
            assert resp.status == 200
            data: dict[str, Any] = await resp.json()
            return data
