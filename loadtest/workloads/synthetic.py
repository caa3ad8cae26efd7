"""Synthetic workloads for what the public traces do not show on their own.

- `mix`: the design's mixed 128- and 2,048-token generations (its load-balancing table was measured on
  it): the cost of a request is set by its generation length, which connection counting cannot see.
- `chat`: multi-turn sessions that re-send a growing history, so turn k's prompt extends turn k-1's.
- `sysprompt`: many users over a few long system prompts (Zipf popularity), each user with a persistent
  preamble; a two-level prefix tree, the shape that breaks "hash the first block" routers.
- `lora`: traffic for several LoRA adapters (Zipf), each with its own system prompt; keeping an adapter's
  traffic together saves adapter loads as well as prefill.

All are seeded: the same parameters give the same requests, byte for byte.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from loadtest.workloads.model import Message, Workload, WorkItem
from loadtest.workloads.text import Segment

BLOCK = 512  # words per block id, as for Mooncake; shorter segments use a block's leading words


class _Ids:
    """Block-id allocator: each synthetic piece of text gets ids no other piece uses."""

    def __init__(self, start: int) -> None:
        self._it = itertools.count(start)

    def text(self, words: int) -> tuple[Segment, ...]:
        segs: list[Segment] = []
        while words > 0:
            n = min(words, BLOCK)
            segs.append(Segment(next(self._it), n))
            words -= n
        return tuple(segs)


def _poisson_times(rng: random.Random, rate: float, n: int) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _zipf_weights(k: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(k)]


def _tokens(segs: tuple[Segment, ...]) -> int:
    return sum(s.words for s in segs)


@dataclass(frozen=True)
class MixParams:
    requests: int = 600
    rate: float = 4.0
    long_fraction: float = 0.5  # share of 2,048-token generations; the rest generate 128
    prompt_min: int = 256
    prompt_max: int = 1024
    seed: int = 0


def mix(p: MixParams = MixParams()) -> Workload:
    rng = random.Random(p.seed)
    ids = _Ids(10_000_000)
    items = []
    for t in _poisson_times(rng, p.rate, p.requests):
        segs = ids.text(rng.randint(p.prompt_min, p.prompt_max))
        out = 2048 if rng.random() < p.long_fraction else 128
        items.append(WorkItem(t=t, input_tokens=_tokens(segs), output_tokens=out, segments=segs))
    return Workload("synthetic:mix", items, BLOCK, namespace=3, source=f"mix {p}")


@dataclass(frozen=True)
class ChatParams:
    sessions: int = 120
    session_rate: float = 1.0  # new sessions per second
    turns_mean: float = 4.0  # geometric number of turns, like BurstGPT's long-tailed sessions
    system_prompts: int = 2
    system_tokens: int = 400
    user_tokens: tuple[int, int] = (30, 300)
    answer_tokens: tuple[int, int] = (50, 400)
    think_s: float = 15.0  # mean pause between a turn's arrival and the next
    seed: int = 0


def chat(p: ChatParams = ChatParams()) -> Workload:
    rng = random.Random(p.seed)
    ids = _Ids(20_000_000)
    systems = [ids.text(p.system_tokens) for _ in range(p.system_prompts)]
    items = []
    for s, start in enumerate(_poisson_times(rng, p.session_rate, p.sessions)):
        turns = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / p.turns_mean))
        history: list[Message] = [Message("system", systems[rng.randrange(p.system_prompts)])]
        t = start
        for _ in range(turns):
            history.append(Message("user", ids.text(rng.randint(*p.user_tokens))))
            out = rng.randint(*p.answer_tokens)
            msgs = tuple(history)
            items.append(
                WorkItem(
                    t=t,
                    input_tokens=sum(_tokens(m.segments) for m in msgs),
                    output_tokens=out,
                    messages=msgs,
                    session=f"chat-{s}",
                )
            )
            # The next turn re-sends this answer; its text is synthetic (the engine's words differ), so the
            # cache can reuse everything up to this turn's prompt, as in a real chat whose template breaks
            # the block at the assistant's turn boundary.
            history.append(Message("assistant", ids.text(out)))
            t += rng.expovariate(1.0 / p.think_s)
    items.sort(key=lambda it: it.t)
    return Workload("synthetic:chat", items, BLOCK, namespace=4, source=f"chat {p}")


@dataclass(frozen=True)
class SysPromptParams:
    requests: int = 800
    rate: float = 6.0
    system_prompts: int = 4
    system_tokens: tuple[int, int] = (2000, 4000)
    users: int = 200
    user_preamble_tokens: int = 256
    question_tokens: tuple[int, int] = (50, 400)
    answer_tokens: tuple[int, int] = (50, 300)
    zipf_s: float = 1.0
    seed: int = 0


def sysprompt(p: SysPromptParams = SysPromptParams()) -> Workload:
    rng = random.Random(p.seed)
    ids = _Ids(30_000_000)
    systems = [ids.text(rng.randint(*p.system_tokens)) for _ in range(p.system_prompts)]
    weights = _zipf_weights(p.system_prompts, p.zipf_s)
    # Each user belongs to one application (system prompt) and keeps its own preamble across requests.
    users = [(rng.choices(range(p.system_prompts), weights)[0], ids.text(p.user_preamble_tokens)) for _ in range(p.users)]
    items = []
    for t in _poisson_times(rng, p.rate, p.requests):
        u = rng.randrange(p.users)
        app, preamble = users[u]
        msgs = (Message("system", systems[app]), Message("user", preamble + ids.text(rng.randint(*p.question_tokens))))
        items.append(
            WorkItem(
                t=t,
                input_tokens=sum(_tokens(m.segments) for m in msgs),
                output_tokens=rng.randint(*p.answer_tokens),
                messages=msgs,
                session=f"user-{u}",
            )
        )
    return Workload("synthetic:sysprompt", items, BLOCK, namespace=5, source=f"sysprompt {p}")


@dataclass(frozen=True)
class LoraParams:
    requests: int = 600
    rate: float = 5.0
    adapters: int = 8
    adapter_prefix: str = "lora-"
    system_tokens: int = 1000
    question_tokens: tuple[int, int] = (100, 600)
    answer_tokens: tuple[int, int] = (50, 300)
    zipf_s: float = 1.0
    seed: int = 0


def lora(p: LoraParams = LoraParams()) -> Workload:
    rng = random.Random(p.seed)
    ids = _Ids(40_000_000)
    systems = [ids.text(p.system_tokens) for _ in range(p.adapters)]
    weights = _zipf_weights(p.adapters, p.zipf_s)
    items = []
    for t in _poisson_times(rng, p.rate, p.requests):
        a = rng.choices(range(p.adapters), weights)[0]
        segs = systems[a] + ids.text(rng.randint(*p.question_tokens))
        items.append(
            WorkItem(
                t=t,
                input_tokens=_tokens(segs),
                output_tokens=rng.randint(*p.answer_tokens),
                segments=segs,
                model=f"{p.adapter_prefix}{a}",
            )
        )
    return Workload("synthetic:lora", items, BLOCK, namespace=6, source=f"lora {p}")


GENERATORS = {"mix": (mix, MixParams), "chat": (chat, ChatParams), "sysprompt": (sysprompt, SysPromptParams), "lora": (lora, LoraParams)}
