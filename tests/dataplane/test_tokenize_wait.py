"""`PreciseMatcher.prepare`, the router's hook (issue 13): a prompt too long to tokenise on the event loop
waits, bounded, for its own tokenisation in the executor and is then matched precisely; a short or cached
prompt takes no await; a tokeniser slower than the bound, or failing, leaves it to the learned index."""

from __future__ import annotations

import asyncio
import random
import threading
import time

from proxy.control.store import SnapshotStore
from proxy.core.inflight import InflightTable
from proxy.core.kv_index import KVIndex
from proxy.config import RoutingConfig
from proxy.core.registry import build_policy
from proxy.core.request import RequestSummary
from proxy.core.snapshot import BackendSpec, Snapshot
from proxy.dataplane.router import Router
from proxy.dataplane.tokenize import ModelTokenizer, PreciseMatcher
from proxy.metrics import ProxyMetrics
from sim.tokenizer import TOKENIZER_DIR, token_ids

from .test_tokenize import _text


def _setup(blocks: int = 8, offload: int = 5000, **kw) -> tuple[str, ModelTokenizer, PreciseMatcher]:
    text = _text(random.Random(11), 3000)
    ids = token_ids(text)
    index = KVIndex()
    index.track("b0", model="m")
    index.track("b1", model="m")
    index.stored("b0", tuple(range(1, blocks + 1)), None, ids[: 16 * blocks], 16)  # an earlier turn, elsewhere
    index.mark_fresh("b0")
    index.mark_fresh("b1")
    tok = ModelTokenizer.from_dir(TOKENIZER_DIR, offload_chars=offload)
    assert len(text) > tok.offload_chars
    return text, tok, PreciseMatcher(index, {"m": tok}, **kw)


def _req(text: str) -> RequestSummary:
    return RequestSummary(prompt=text, model="m", endpoint="/v1/completions")


async def test_a_long_first_sighting_waits_for_its_tokenisation_and_is_precise() -> None:
    text, tok, matcher = _setup()
    threads: list[int] = []
    real = tok._raw

    def spy(t: str) -> list[int]:
        threads.append(threading.get_ident())
        return real(t)

    tok._raw = spy  # type: ignore[method-assign]
    ready = matcher.prepare(_req(text))
    assert ready is not None
    await ready
    assert threads and all(t != threading.get_ident() for t in threads)  # tokenised off the loop
    threads.clear()
    got = matcher(_req(text))
    assert got is not None and got.cached == {"b0": 128, "b1": 0} and got.prompt_tokens == len(token_ids(text))
    assert threads == [] and matcher.deferred == 0  # the pick found it memoised
    assert sum(matcher.wait_counts) == 1 and matcher.wait_timeouts == 0 and matcher.wait_sum_s > 0
    assert matcher.prepare(_req(text)) is None  # now cached: no await


async def test_short_prompts_and_a_zero_bound_take_no_await() -> None:
    text, _tok, matcher = _setup()
    assert matcher.prepare(_req(text[:2000])) is None
    assert matcher.prepare(RequestSummary(prompt="", model="m", endpoint="/v1/completions")) is None
    _text2, _tok2, off = _setup(wait_s=0.0)
    assert off.prepare(_req(text)) is None
    assert off(_req(text)) is None and off.deferred == 1  # the learned index routes it, as before the wait


async def test_concurrent_requests_for_one_text_share_one_tokenisation() -> None:
    text, tok, matcher = _setup()
    calls: list[str] = []
    real = tok._raw

    def spy(t: str) -> list[int]:
        calls.append(t)
        return real(t)

    tok._raw = spy  # type: ignore[method-assign]
    waits = [matcher.prepare(_req(text)) for _ in range(3)]
    assert all(w is not None for w in waits)
    await asyncio.gather(*waits)  # type: ignore[arg-type]  # checked just above
    assert "".join(calls) == text  # every chunk tokenised once
    assert matcher(_req(text)).cached["b0"] == 128


async def test_a_tokeniser_slower_than_the_bound_falls_back_and_finishes_for_the_next_sighting() -> None:
    text, tok, matcher = _setup(wait_s=0.05)
    real = tok._raw
    gate = threading.Event()

    def slow(t: str) -> list[int]:
        gate.wait(5)
        return real(t)

    tok._raw = slow  # type: ignore[method-assign]
    t0 = time.monotonic()
    ready = matcher.prepare(_req(text))
    assert ready is not None
    await ready
    assert time.monotonic() - t0 < 2  # the bound, not the tokeniser, ended the wait
    assert matcher.wait_timeouts == 1
    assert matcher(_req(text)) is None and matcher.deferred == 1  # this time: the learned index decides
    gate.set()
    for _ in range(100):
        again = matcher.prepare(_req(text))  # joins the running tokenisation until it is memoised
        if again is None:
            break
        await again
    got = matcher(_req(text))  # the next sighting: precise, tokenised once (the wait's job went on)
    assert got is not None and got.cached["b0"] == 128


async def test_a_tokeniser_error_routes_by_the_learned_index() -> None:
    text, tok, matcher = _setup()

    def broken(t: str) -> list[int]:
        raise ValueError("no")

    tok._raw = broken  # type: ignore[method-assign]
    ready = matcher.prepare(_req(text))
    assert ready is not None
    await ready  # never raises
    assert matcher(_req(text)) is None
    await asyncio.sleep(0.05)  # the pick's own warm-up fails in the executor too, quietly


def _router(prepare) -> Router:  # type: ignore[no-untyped-def]
    store = SnapshotStore(Snapshot.initial([BackendSpec(name="b0", url="http://127.0.0.1:1")]))
    return Router(store, build_policy(RoutingConfig(policy="round_robin")), InflightTable(), ProxyMetrics(),
                  prepare=prepare)


async def test_the_router_awaits_the_hook_before_the_pick_only_when_it_answers_one() -> None:
    seen: list[str] = []

    async def wait() -> None:
        seen.append("waited")

    def prepare(summary: RequestSummary):  # type: ignore[no-untyped-def]
        seen.append(summary.prompt)
        return wait() if summary.prompt == "long" else None

    router = _router(prepare)
    async with router.route(_req("long")) as lease:
        assert seen == ["long", "waited"] and lease.backend.name == "b0"
    async with router.route(_req("short")) as lease:
        assert seen[2:] == ["short"] and lease.backend.name == "b0"


async def test_chat_requests_wait_when_long_and_are_not_rendered_twice_when_short() -> None:
    from proxy.core.request import summary_from_openai

    text, tok, matcher = _setup()
    renders: list[int] = []
    real = tok.render_chat

    def spy(messages, **kw):  # type: ignore[no-untyped-def]
        renders.append(len(messages))
        return real(messages, **kw)

    tok.render_chat = spy  # type: ignore[method-assign]
    short = summary_from_openai("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "ba be"}]})
    assert matcher.prepare(short) is None and renders == []  # told short from the flattened prompt
    long = summary_from_openai("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": text}]})
    ready = matcher.prepare(long)
    assert ready is not None
    await ready
    got = matcher(long)
    assert got is not None and matcher.deferred == 0
    assert got.prompt_tokens == len(token_ids(real(long.messages)))


async def test_the_number_of_tokenisations_waited_for_at_once_is_a_config_key() -> None:
    """`telemetry.kv_events.precise_wait_concurrency` (default 4, as the bound was before it was a key):
    that many distinct long prompts wait for their tokenisation at once; the next one does not wait (the
    learned index routes it) until one of them finished."""
    import pytest

    from proxy.config import ConfigError, parse_config
    from proxy.control.kv_events import build_precise_routing

    base = ("backends:\n  - {name: a, url: 'http://127.0.0.1:1', models: [m]}\n"
            "telemetry:\n  kv_events:\n    tokenizers: {m: '%s'}\n    backends:\n      a: {endpoint: 'tcp://127.0.0.1:5557'}\n"
            % TOKENIZER_DIR)
    assert parse_config(base).telemetry.kv_events.precise_wait_concurrency == 4
    for bad, message in (("0", "must be >= 1"), ("2000", "must be <= 1024"), ("two", "must be an integer")):
        with pytest.raises(ConfigError, match=message):
            parse_config(base + f"    precise_wait_concurrency: {bad}\n")
    rng = random.Random(5)
    for key, n in (("", 4), ("    precise_wait_concurrency: 2\n", 2)):
        built = build_precise_routing(parse_config(base + key))
        assert built is not None
        matcher = built.matcher
        built.index.track("a", model="m")
        built.index.stored("a", (1,), None, list(range(16)), 16)  # the engines' block size
        built.index.mark_fresh("a")
        gate = threading.Event()
        for tok in matcher.tokenizers.values():  # type: ignore[attr-defined]  # a PreciseMatcher
            real = tok._raw
            tok._raw = lambda t, real=real: (gate.wait(5), real(t))[1]
        texts = [_text(rng, 9000) for _ in range(n + 1)]
        assert all(len(t) > 32768 for t in texts)  # each too long for the event loop
        prepare = matcher.prepare  # type: ignore[attr-defined]  # a PreciseMatcher
        waits = [prepare(_req(t)) for t in texts]
        assert all(w is not None for w in waits[:n]) and waits[n] is None, (key, waits)
        assert matcher.wait_skipped == 1  # type: ignore[attr-defined]  # counted: the learned index routes it
        gate.set()
        await asyncio.gather(*waits[:n])
        again = prepare(_req(texts[n]))  # room again
        assert again is not None
        await again
