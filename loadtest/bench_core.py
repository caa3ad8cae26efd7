"""Cost of one routing decision in the pure core, and the memory of its indexes.

Measures, per prompt size (1k/4k/16k/64k tokens at ~4 bytes per token) and fleet size (4/64/256 backends):
building the `RequestSummary` from a parsed chat body plus `AffinityPolicy.pick`, p50 and p99, for

- ``new``: a prompt never seen before that shares a ~2 KiB system prompt with the warm-up traffic (the
  exact index misses and every backend's prefix index is probed, the most expensive path), and
- ``repeat``: the same request again (exact-fingerprint hit);

measured by default in this thread's CPU time, so that on a shared machine the time other processes hold
the core is not charged to the router (``--clock wall`` for elapsed time); then the part of it spent in
fingerprinting (prompt bytes -> exact fingerprint, block chain, hash key),
and finally the memory of one backend's prefix index filled to its configured capacity and of the
exact-fingerprint map (tracemalloc, so the ints the indexes keep alive are counted).

Targets (issue 4): < 100 µs for a 4k-token prompt, < 1 ms for 64k, memory bounded by configuration.

`--diff TREE` runs the same decision traces (random fleets and requests in 10 configurations, and
loadtest.replay on the shipped Mooncake sample in 8) through this tree's AffinityPolicy and TREE's, each in
its own interpreter, and compares every decision: a speed-up of the policy must leave them identical.

    .venv/bin/python -m loadtest.bench_core            # full table (~1 min on 2 shared cores)
    .venv/bin/python -m loadtest.bench_core --quick    # fewer iterations
    .venv/bin/python loadtest/bench_core.py --micro [--ab TREE --rounds 6]   # hot-path calls, µs (see micro)
    .venv/bin/python loadtest/bench_core.py --diff TREE                      # decisions identical? (~2 min)
    .venv/bin/python loadtest/bench_core.py --replay-rows                    # scaleout.jsonl's R = 1 rows (~3 min)
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc

from proxy.core.affinity import AffinityPolicy
from proxy.core.decision import Inflight
from proxy.core.fingerprint import Fingerprinter
from proxy.core.prefix_index import GenerationalMap, PrefixIndex
from proxy.core.request import summary_from_openai
from proxy.core.routing_config import AffinityConfig, RoutingConfig
from proxy.core.snapshot import BackendSpec, Snapshot

ENDPOINT = "/v1/chat/completions"
WORDS = "the of and to in is was for on that with as by at from his an were are which this be or".split()


def text(n_bytes: int, rng: random.Random) -> str:
    out: list[str] = []
    size = 0
    while size < n_bytes:
        w = rng.choice(WORDS) + str(rng.randrange(1000))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_bytes]


def body(system: str, user: str) -> dict[str, object]:
    return {
        "model": "llama",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 128,
        "temperature": 0.7,
    }


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def bench_pick(tokens: int, n_backends: int, iters: int, rng: random.Random, clock=time.thread_time_ns) -> dict[str, float]:
    snap = Snapshot.initial(BackendSpec(f"gpu-{i}", f"http://10.0.0.{i}:8000") for i in range(n_backends))
    inflight = {name: Inflight(requests=rng.randrange(4), tokens=0) for name in snap.names}
    policy = AffinityPolicy(RoutingConfig())
    system = text(2048, rng)
    user_bytes = max(64, tokens * 4 - 2048)
    base = text(user_bytes, rng)
    # Warm-up: populate exact and prefix indexes across the fleet.
    for i in range(min(200, 4 * n_backends)):
        policy.pick(summary_from_openai(ENDPOINT, body(system, f"warm {i} " + base)), snap, inflight)
    bodies = [body(system, f"new {i} " + base) for i in range(iters)]
    new: list[float] = []
    repeat: list[float] = []
    fp_only: list[float] = []
    fingerprinter = Fingerprinter(AffinityConfig())
    gc.disable()
    try:
        for b in bodies:
            t0 = clock()
            policy.pick(summary_from_openai(ENDPOINT, b), snap, inflight)
            t1 = clock()
            policy.pick(summary_from_openai(ENDPOINT, b), snap, inflight)
            t2 = clock()
            req = summary_from_openai(ENDPOINT, b)
            t3 = clock()
            fingerprinter.blocks(fingerprinter.keys(req))
            t4 = clock()
            new.append((t1 - t0) / 1000)
            repeat.append((t2 - t1) / 1000)
            fp_only.append((t4 - t3) / 1000)
    finally:
        gc.enable()
    return {
        "new_p50": statistics.median(new),
        "new_p99": pct(new, 0.99),
        "repeat_p50": statistics.median(repeat),
        "repeat_p99": pct(repeat, 0.99),
        "fingerprint_p50": statistics.median(fp_only),
    }


def index_memory(capacity: int) -> tuple[int, int]:
    """Bytes held by one full prefix index of `capacity` blocks, and by a full exact map of that size."""
    rng = random.Random(1)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idx = PrefixIndex(capacity)
    for _ in range(capacity // 64 * 3):  # 3x capacity inserted: the bound must hold, not just the fill
        idx.add([rng.getrandbits(64) for _ in range(64)])
    index_bytes = tracemalloc.get_traced_memory()[0] - before
    assert len(idx) <= capacity
    before = tracemalloc.get_traced_memory()[0]
    exact: GenerationalMap[str] = GenerationalMap(capacity)
    names = [f"gpu-{i}" for i in range(8)]
    for i in range(capacity * 3):
        exact.put(rng.getrandbits(64), names[i % 8])
    exact_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del idx, exact
    return index_bytes, exact_bytes


# ------------------------------------------------------------------------------------ differential

# `--diff TREE`: the same traces through this tree's AffinityPolicy and TREE's (each in its own interpreter,
# PYTHONPATH = the tree), every decision compared: (backend, reason, prefix blocks matched), or the error a
# pick raised. A speed-up of the policy must leave this list identical.

def _fuzz_trace(case: str, steps: int, seed: int) -> list[object]:
    """Random fleets and requests through one policy, in-flight work fed back: every branch of the pick
    (session, KV hit, exact, prefix, hash; the bound, the cost check, the fallbacks; peers, the engines'
    counts; adapters, media, exclusions, weights, models, snapshots changing under it)."""
    from proxy.core.decision import NoBackendAvailable
    from proxy.core.inflight import InflightTable
    from proxy.core.kv_index import PreciseMatch
    from proxy.core.request import RequestSummary
    from proxy.core.snapshot import BackendState, Health, Signals
    import dataclasses
    import xxhash

    rng = random.Random(seed)
    n = 16 if case in ("wide", "peers4") else 4
    aff_over: dict[str, object] = {}
    routing_over: dict[str, object] = {}
    if case == "nocost":
        aff_over["cost_aware"] = False
    if case == "tight":
        aff_over.update(epsilon=0.05, request_epsilon=0.25, saturation=0.6, overload_margin=0.0, cost_slack_tokens=0,
                        new_prompt_slack_tokens=0, block_bytes=64, min_prefix_blocks=2)
    if case == "nosession":
        aff_over["session_affinity"] = False
    if case == "shared":
        routing_over["shared_backends"] = True
    cfg = RoutingConfig(affinity=AffinityConfig(**aff_over), **routing_over)  # type: ignore[arg-type]
    step = [0]

    def precise(req: RequestSummary) -> PreciseMatch | None:
        h = xxhash.xxh3_64_intdigest(req.prompt.encode("utf-8", "surrogatepass")[:300])
        if h % 5 == 0:
            return None
        tokens = max(0, len(req.prompt) // 4)
        cached = {f"gpu-{i}": (h >> (i * 3)) % max(1, tokens + 1) for i in range(n) if (h >> i) & 1}
        return PreciseMatch(tokens, cached, 16 if h & 64 else 0)

    def peers() -> dict[str, tuple] | None:
        s = step[0]
        if s % 7 == 0:
            return None
        out: dict[str, tuple] = {}
        for i in range(n):
            if (s + i) % 3 == 0:
                continue
            r = (s * 7 + i) % 5
            entry: tuple = (r, r * 800, float(r * 300))
            if case == "peers4" and i % 2 == 0:
                entry = entry + (tuple(((k + s) % 4, float(100 * (k + i))) for k in range(r + 1)),)
            out[f"gpu-{i}"] = entry
        return out

    policy = AffinityPolicy(cfg, precise=precise if case == "precise" else None,
                            peers=peers if case.startswith("peers") else None)

    def spec(i: int) -> BackendSpec:
        models: tuple[str, ...] = () if i % 4 else ("a",)
        return BackendSpec(f"gpu-{i}", f"http://10.0.0.{i}:8000", weight=1.0 if case != "weights" else 1.0 + i % 3,
                           models=models, adapters=("lora-x",) if i % 3 == 1 else (),
                           max_inflight=6 if i % 5 == 2 else None)

    states = [BackendState(spec=spec(i)) for i in range(n)]
    version = 1
    snap = Snapshot(version=version, backends=tuple(states))
    inflight = InflightTable()
    live: list[tuple[str, int]] = []
    systems = [text(rng.randrange(200, 2500), rng) for _ in range(3)]
    convs: list[list[dict[str, object]]] = [[{"role": "system", "content": systems[i % 3]}] for i in range(30)]
    prefixes = [text(rng.randrange(100, 3000), rng) for _ in range(5)]
    sent: list[tuple[str, dict[str, object], str | None]] = []
    out: list[object] = []
    for s in range(steps):
        step[0] = s
        if s % 50 == 0:  # the control plane moves: health, telemetry, weights, now and then the fleet itself
            new = []
            for b in snap.backends:
                health = rng.choice([Health.HEALTHY] * 6 + [Health.UNKNOWN, Health.UNHEALTHY, Health.DRAINING])
                fresh = rng.random() < 0.7
                signals = Signals(scraped_at=float(s), running=float(rng.randrange(8)),
                                  waiting=rng.choice([None, 0.0, float(rng.randrange(6))]),
                                  kv_capacity_tokens=rng.choice([None, 200_000.0, 1_000_000.0]),
                                  loaded_adapters=frozenset({"lora-x"}) if rng.random() < 0.4 else frozenset()) \
                    if rng.random() < 0.8 else None
                new.append(BackendState(spec=b.spec, health=health, signals=signals,
                                        load_score=rng.choice([None, rng.random()]) if fresh else None, stale=not fresh,
                                        weight=rng.choice([None] * 8 + [0.0, 2.0])))
            if rng.random() < 0.2 and len(new) > 2:
                new.pop(rng.randrange(len(new)))
            present = {b.name for b in new}
            for i in range(n):
                if f"gpu-{i}" not in present and rng.random() < 0.5:
                    new.append(BackendState(spec=spec(i)))
            version += 1
            snap = Snapshot(version=version, backends=tuple(new))
        while live and rng.random() < 0.6:  # some requests finish
            name, tokens = live.pop(rng.randrange(len(live)))
            inflight.release(name, tokens)
        kind = rng.random()
        model = rng.choice([None, "a", "b", "a", "lora-x", "zzz"]) if kind > 0.05 else None
        session = f"s{rng.randrange(20)}" if rng.random() < 0.15 else None
        if kind < 0.05:
            req = RequestSummary(prompt="", endpoint="/v1/models", session_key=session)
        elif kind < 0.25 and sent:
            ep, body, session = sent[rng.randrange(len(sent))]  # an exact repeat
            req = summary_from_openai(ep, body, session_key=session, adapters=frozenset({"lora-x"}))
        elif kind < 0.65:
            conv = convs[rng.randrange(len(convs))]
            if len(conv) > 9:
                conv[1:] = []
            content: object = text(rng.randrange(20, 900), rng)
            if rng.random() < 0.1:
                content = [{"type": "text", "text": content}, {"type": "image_url", "image_url": {"url": f"u{rng.randrange(3)}"}}]
            conv.append({"role": "user", "content": content})
            body = {"messages": list(conv), "max_tokens": rng.choice([16, 128, None]), "temperature": rng.choice([0, 0.7, None])}
            if model is not None:
                body["model"] = model
            ep = "/v1/chat/completions"
            req = summary_from_openai(ep, body, session_key=session, adapters=frozenset({"lora-x"}))
            sent.append((ep, body, session))
            conv.append({"role": "assistant", "content": text(rng.randrange(20, 400), rng)})
        else:
            body = {"prompt": rng.choice(prefixes) + text(rng.randrange(0, 1500), rng), "max_tokens": 16}
            if model is not None:
                body["model"] = model
            ep = "/v1/completions"
            req = summary_from_openai(ep, body, session_key=session, adapters=frozenset({"lora-x"}))
            sent.append((ep, body, session))
        if len(sent) > 400:
            del sent[:100]
        exclude = frozenset(rng.sample(list(snap.names), k=min(len(snap.names), rng.randrange(1, 3)))) \
            if rng.random() < 0.1 and snap.names else frozenset()
        try:
            d = policy.pick(req, snap, inflight, exclude)
        except NoBackendAvailable as exc:
            out.append(["error", str(exc)])
            continue
        out.append([d.backend, d.reason.value, d.prefix_blocks_matched])
        tokens = req.prompt_tokens_est + (req.max_tokens or 0)
        inflight.acquire(d.backend, tokens)
        live.append((d.backend, tokens))
    _ = dataclasses  # (kept importable for both trees)
    return out


def _summary_trace(n: int, seed: int) -> list[object]:
    """summary_from_openai over random bodies of every endpoint, valid and not: each summary's fields, or
    the error's text and param (a speed-up of the summary must leave both identical)."""
    from proxy.core.request import RequestError

    rng = random.Random(seed)
    # The branch point's SUMMARISERS (fixed here, so that an endpoint added later leaves the trace as it is).
    endpoints = ["/pooling", "/rerank", "/score", "/tokenize", "/v1/chat/completions", "/v1/completions",
                 "/v1/embeddings", "/v1/messages", "/v1/rerank", "/v1/responses", "/v1/score", "/v2/rerank",
                 "/v1/models", "/x/v1/chat/completions"]
    odd: list[object] = [None, True, 1, 1.5, -0.0, 0, "s", [], {}, [1, 2], ["a", "b"], [[1], [2]], float("inf"), 2**70]

    def value() -> object:
        return rng.choice(odd) if rng.random() < 0.04 else text(rng.randrange(0, 60), rng)

    def content() -> object:
        r = rng.random()
        if r < 0.6:
            return text(rng.randrange(0, 300), rng)
        if r < 0.8:
            return [rng.choice([{"type": "text", "text": text(30, rng)}, {"type": "image_url", "image_url": {"url": "u"}},
                                "plain", {"type": "tool_result", "content": [{"type": "text", "text": "r"}]}, 3])
                    for _ in range(rng.randrange(0, 4))]
        return value()

    def messages() -> object:
        if rng.random() < 0.03:
            return value()
        return [rng.choice([{"role": rng.choice(["system", "user", "assistant", "developer", "tool", 7]),
                             "content": content()}, "bad", {"content": "no role"}])
                if rng.random() < 0.03 else {"role": rng.choice(["system", "user", "assistant", "developer"]),
                                            "content": content()}
                for _ in range(rng.randrange(1, 5))]

    out: list[object] = []
    for _ in range(n):
        ep = rng.choice(endpoints)
        b: dict[str, object] = {}
        for key, make in (("model", lambda: rng.choice(["m", "lora-x", None] * 10 + [3])), ("messages", messages),
                          ("prompt", lambda: rng.choice([text(200, rng)] * 8 + [["a", "b"], [1, 2, 3], [[1], [2]], 5])),
                          ("input", lambda: rng.choice([text(50, rng), [{"role": "user", "content": "hi"}],
                                                        [{"type": "function_call", "name": "f"}],
                                                        [{"type": "function_call_output", "output": {"a": 1}}],
                                                        [{"type": "reasoning"}], "x", 4])),
                          ("instructions", value), ("tools", lambda: rng.choice([[{"name": "t"}], [], None] * 5 + ["x"])),
                          ("system", lambda: rng.choice(["sys", [{"type": "text", "text": "s"}]] * 8 + [3])),
                          ("previous_response_id", lambda: rng.choice(["r1", None] * 8 + [3])),
                          ("query", value), ("documents", lambda: rng.choice([["d1", {"text": "d2"}, {"x": 1}]] * 8 + ["d"])),
                          ("text_1", value), ("text_2", value),
                          ("max_tokens", lambda: rng.choice([16, None, 0, 2**70] * 6 + [True, 1.0, "8"])),
                          ("max_completion_tokens", lambda: rng.choice([32, None] * 8 + [False])),
                          ("max_output_tokens", lambda: rng.choice([64, None] * 8 + ["x"])),
                          ("temperature", lambda: rng.choice([0, 0.0, -0.0, 0.7, None, 1, 2**70, float("nan")] * 4 + [True, "hot"])),
                          ("stream", lambda: rng.choice([True, False] * 10 + [None, 1, "yes"]))):
            if rng.random() < 0.45:
                b[key] = make()
        body_or_odd: object = b if rng.random() < 0.97 else rng.choice(odd)
        try:
            s = summary_from_openai(ep, body_or_odd, session_key=rng.choice([None, "k"]),
                                    adapters=frozenset({"lora-x"}))
        except RequestError as exc:
            out.append(["error", str(exc), exc.param])
        except (KeyError, TypeError) as exc:
            out.append(["raised", type(exc).__name__, str(exc)])
        else:
            out.append(repr([getattr(s, name) for name in _SUMMARY_FIELDS]))
    return out


# The fields compared (those of the branch point of round 4: a field added later does not break the check).
_SUMMARY_FIELDS = ("prompt", "model", "adapter", "max_tokens", "temperature", "stream", "session_key",
                   "prompt_tokens_est", "endpoint", "key_prefix_chars", "media", "shared_prefix_chars", "messages",
                   "previous_response_id", "state_home")


_REPLAYS = {
    "learned": {},
    "precise-inline": {"index": "precise", "precise_lookup": "inline"},
    "precise-proxy": {"index": "precise"},
    "r2-peers": {"replicas": 2, "index": "precise", "load_view": "peers"},
    "r2-engines": {"replicas": 2, "index": "precise", "load_view": "engines"},
    "w2": {"workers": 2, "index": "precise"},
    "r2w2-peers": {"replicas": 2, "workers": 2, "index": "precise", "load_view": "peers"},
    "session": {"session_header": True},
}


def _replay_traces(window: float) -> dict[str, list[object]]:
    """Every AffinityPolicy.pick of loadtest.replay on the shipped Mooncake sample (virtual time, so the
    same decisions give the same run), per replay configuration."""
    import asyncio
    from dataclasses import replace
    import proxy.core.affinity as affinity
    from loadtest.replay import ReplayConfig, replay
    from loadtest.workloads import load_workload

    log: list[object] = []
    original = affinity.AffinityPolicy.pick

    def pick(self, req, snapshot, inflight, exclude=frozenset()):  # type: ignore[no-untyped-def]
        d = original(self, req, snapshot, inflight, exclude)
        log.append([d.backend, d.reason.value, d.prefix_blocks_matched])
        return d

    affinity.AffinityPolicy.pick = pick  # type: ignore[method-assign]  # recording only, in this process
    w = load_workload("mooncake", prefer_sample=True).window(0, window, None)
    base = ReplayConfig(policy="affinity", backends=4, max_model_len=131072)
    out: dict[str, list[object]] = {}
    try:
        for name, changes in _REPLAYS.items():
            log.clear()
            asyncio.run(replay(w, replace(base, **changes)))
            out[name] = list(log)
    finally:
        affinity.AffinityPolicy.pick = original  # type: ignore[method-assign]
    return out


# The fuzz configurations (tests/core/test_affinity_trace.py pins the first eight, seeded by position).
TRACE_CASES = ("default", "wide", "nocost", "tight", "weights", "nosession", "precise", "shared")
PEER_CASES = ("peers3", "peers4")


def record(steps: int, window: float) -> dict[str, list[object]]:
    out = {f"fuzz-{case}": _fuzz_trace(case, steps, seed)
           for seed, case in enumerate(TRACE_CASES + PEER_CASES)}
    out["summaries"] = _summary_trace(steps * 5, 99)
    out.update({f"replay-{k}": v for k, v in _replay_traces(window).items()})
    return out


def diff(tree: str, steps: int, window: float) -> int:
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    got = {}
    cache = os.environ.get("BENCH_CORE_DIFF_CACHE")  # a file for TREE's traces, when TREE does not change
    if cache and os.path.exists(cache):
        with open(cache) as fh:
            got["base"] = json.load(fh)
    for name, path in (("base", os.path.abspath(tree)), ("this", here)):
        if name in got:
            continue
        res = subprocess.run([sys.executable, "-P", os.path.abspath(__file__), "--record", "--steps", str(steps),
                              "--window", str(window)], env=dict(os.environ, PYTHONPATH=path),
                             capture_output=True, text=True, check=True, cwd=here)
        got[name] = json.loads(res.stdout)
        if name == "base" and cache:
            with open(cache, "w") as fh:
                fh.write(res.stdout)
    bad = 0
    for case, want in got["base"].items():
        have = got["this"].get(case)
        same = have == want
        first = next((i for i, (x, y) in enumerate(zip(want, have or [])) if x != y), None)
        print(f"{case:24s} {len(want):6d} decisions  {'identical' if same else f'DIFFERENT at {first}'}")
        if not same:
            bad += 1
            if first is not None:
                print(f"    base {want[first]}  this {have[first]}")  # type: ignore[index]
    print(f"{sum(len(v) for v in got['base'].values())} decisions, {bad} case(s) differ")
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------ micro

# `--micro`: µs per call of the hot-path core calls on realistic, warm state (best of 5 passes), and with
# `--ab TREE` the same in alternating subprocesses of this tree and TREE (PYTHONPATH), as
# loadtest/bench_h1path.py --ab does for the whole request. Workloads: `small`, bench_h1path.py's own
# requests (a ~220-byte completion prompt, one of 8 preambles: no full block, so no chain); `chat`, a 2 KiB
# system prompt (one of 4) and a ~600-byte user turn (a prefix probe of every backend). `new`: a prompt
# not seen before (hash placement, the cost check); `repeat`: the same summaries again (exact hits);
# `turn`: the next turn of a conversation seen before (a prefix hit); `summary`: summary_from_openai alone.
# 2 to 3 requests in flight per backend, so the cost check reads a queue.

_H1_PREFIX = "System prompt %d: You are a helpful assistant. " + "x" * 150


def _micro_fleet(n: int, rng: random.Random) -> tuple[Snapshot, object]:
    from proxy.core.inflight import InflightTable
    snap = Snapshot.initial(BackendSpec(f"gpu-{i}", f"http://10.0.0.{i}:8000") for i in range(n))
    inflight = InflightTable()
    for name in snap.names:
        for _ in range(rng.randrange(1, 4)):
            inflight.acquire(name, 500)
    return snap, inflight


def _micro_case(workload: str, n: int, passes: int = 5) -> dict[str, float]:
    best: dict[str, float] = {}
    clock = time.thread_time  # CPU time: on a shared machine the time others hold the core is not counted
    for p in range(passes):
        rng = random.Random(p)
        snap, inflight = _micro_fleet(n, rng)
        if workload == "small":
            ep = "/v1/completions"
            bodies: list[dict[str, object]] = [
                {"model": "fake-model", "prompt": _H1_PREFIX % (i % 8) + f" user question 0-{i}", "max_tokens": 16,
                 "temperature": 0} for i in range(3000)]
            turns: list[dict[str, object]] = []
        else:
            ep = ENDPOINT
            systems = [text(2048, rng) for _ in range(4)]
            bodies = [body(systems[i % 4], f"q{i} " + text(600, rng)) for i in range(1600)]
            turns = []
            for b in bodies[1000:]:
                msgs = list(b["messages"]) + [{"role": "assistant", "content": text(300, rng)},  # type: ignore[call-overload]
                                              {"role": "user", "content": text(200, rng)}]
                turns.append({**b, "messages": msgs})
        warm, test = bodies[:1000], bodies[1000:]
        policy = AffinityPolicy(RoutingConfig())
        for b in warm:
            policy.pick(summary_from_openai(ep, b), snap, inflight)
        summaries = [summary_from_openai(ep, b) for b in test]
        turn_summaries = [summary_from_openai(ep, b) for b in turns]
        pick = policy.pick
        t0 = clock()
        for s in summaries:
            pick(s, snap, inflight)
        t1 = clock()
        for s in summaries:
            pick(s, snap, inflight)
        t2 = clock()
        for s in turn_summaries:
            pick(s, snap, inflight)
        t3 = clock()
        for b in test:
            summary_from_openai(ep, b)
        t4 = clock()
        got = {"new": (t1 - t0) / len(test), "repeat": (t2 - t1) / len(test), "summary": (t4 - t3) / len(test)}
        if turns:
            got["turn"] = (t3 - t2) / len(turns)
        for k, v in got.items():
            best[k] = min(best.get(k, float("inf")), v * 1e6)
    return best


def micro() -> dict[str, float]:
    gc.disable()
    try:
        out: dict[str, float] = {}
        for workload, sizes in (("small", (2, 4, 16)), ("chat", (4, 16))):
            for n in sizes:
                for k, v in _micro_case(workload, n).items():
                    out[f"{workload} n={n} {k}"] = v
        return out
    finally:
        gc.enable()


def micro_ab(tree: str, rounds: int) -> None:
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"base": os.path.abspath(tree), "this": here}
    res: dict[str, list[dict[str, float]]] = {n: [] for n in trees}
    for r in range(rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            got = subprocess.run([sys.executable, "-P", os.path.abspath(__file__), "--micro", "--json"],
                                 env=dict(os.environ, PYTHONPATH=trees[name]), capture_output=True, text=True,
                                 check=True).stdout
            res[name].append(json.loads(got.strip().splitlines()[-1]))
        print(f"round {r} done", file=sys.stderr)
    print(f"{'µs per call':28s} {'base':>8s} {'this':>8s} {'ratio':>7s} lower")
    for key in res["base"][0]:
        base = [x[key] for x in res["base"]]
        this = [x[key] for x in res["this"]]
        ratios = [t / b for t, b in zip(this, base)]
        print(f"{key:28s} {statistics.median(base):8.2f} {statistics.median(this):8.2f} "
              f"{statistics.median(ratios):7.3f} {sum(x < 1 for x in ratios)}/{len(ratios)}")


def replay_rows() -> int:
    """`--replay-rows`: re-run the R = 1 affinity rows of loadtest/results/scaleout.jsonl (learned, and
    precise with the proxy's lookup; the full Mooncake and Azure traces of /work/shared/traces) and compare
    each with its recorded hit ratio, TTFT mean/p50/p99, request counts and decision reasons."""
    import asyncio
    import json
    import os
    from pathlib import Path

    from loadtest.replay import ReplayConfig, replay
    from loadtest.report import summarize
    from loadtest.workloads import load_workload

    root = Path(__file__).resolve().parents[1]
    traces = Path("/work/shared/traces") if Path("/work/shared/traces").is_dir() else root.parent / "shared" / "traces"
    files = {"mooncake": traces / "mooncake_synthetic_trace.jsonl", "azure-code": traces / "azure_llm_2023_code.csv"}
    rows = [json.loads(line) for line in (root / "loadtest/results/scaleout.jsonl").read_text().splitlines() if line.strip()]
    flags = ("--policies affinity", "--policies affinity --index precise --kv-event-delay-ms 50")
    loaded: dict[tuple[str, float, float], object] = {}
    bad = 0
    for row in (r for r in rows if r["flags"] in flags and os.path.exists(files[r["load"]])):
        key = (row["load"], *row["window"])
        if key not in loaded:
            loaded[key] = load_workload(str(files[row["load"]])).window(row["window"][0], row["window"][1], None)
        wl = loaded[key]
        cfg = ReplayConfig(policy="affinity", speed=row["speed"], max_model_len=131072,
                           index="precise" if "precise" in row["flags"] else "learned")
        result = asyncio.run(replay(wl, cfg))  # type: ignore[arg-type]  # a Workload
        got = summarize(result, wl, label="")  # type: ignore[arg-type]  # a Workload
        names = ("hit_ratio", "ttft_mean", "ttft_p50", "ttft_p99", "requests", "ok")
        same = all(got[k] == row[k] for k in names) and result.meta["reasons"] == row["reasons"]
        bad += not same
        print(f"{'same' if same else 'DIFFERENT':9s} {row['key']}: hit {100 * got['hit_ratio']:.2f}% "
              f"TTFT mean {1000 * got['ttft_mean']:.0f} ms p99 {1000 * got['ttft_p99']:.0f} ms", flush=True)
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--tokens", type=int, nargs="*", default=[1024, 4096, 16384, 65536])
    ap.add_argument("--backends", type=int, nargs="*", default=[4, 64, 256])
    ap.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: this thread's CPU time (default; immune to the scheduler on a shared machine), wall: elapsed",
    )
    ap.add_argument("--diff", metavar="TREE", help="the decision traces of this tree against TREE's (see diff)")
    ap.add_argument("--record", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=3000, help="--diff: picks per fuzz case")
    ap.add_argument("--window", type=float, default=120.0, help="--diff: seconds of the Mooncake sample replayed")
    ap.add_argument("--micro", action="store_true", help="µs per hot-path core call on warm state (see micro)")
    ap.add_argument("--ab", metavar="TREE", help="--micro: alternate rounds of this tree and TREE")
    ap.add_argument("--rounds", type=int, default=6, help="--micro --ab: rounds")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--replay-rows", action="store_true", help="R = 1 rows of scaleout.jsonl unchanged? (~3 min)")
    args = ap.parse_args()
    if args.replay_rows:
        raise SystemExit(replay_rows())
    if args.micro:
        if args.ab:
            micro_ab(args.ab, args.rounds)
        else:
            import json
            res = micro()
            print(json.dumps(res) if args.json else "\n".join(f"{k:28s} {v:8.2f} µs" for k, v in res.items()))
        return
    if args.record:
        import json
        print(json.dumps(record(args.steps, args.window)))
        return
    if args.diff:
        raise SystemExit(diff(args.diff, args.steps, args.window))
    clock = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    rng = random.Random(42)
    print(f"summary + AffinityPolicy.pick, microseconds of {args.clock} time (new = unseen prompt sharing a system prompt,")
    print("repeat = exact-fingerprint hit); fp = fingerprinting alone (bytes, chain, hash key)")
    print(f"{'tokens':>7} {'backends':>8} | {'new p50':>8} {'new p99':>8} | {'rep p50':>8} {'rep p99':>8} | {'fp p50':>7}")
    for tokens in args.tokens:
        iters = (60 if args.quick else 200) if tokens >= 16384 else (150 if args.quick else 500)
        for n in args.backends:
            r = bench_pick(tokens, n, iters, rng, clock)
            print(
                f"{tokens:>7} {n:>8} | {r['new_p50']:>8.1f} {r['new_p99']:>8.1f} | "
                f"{r['repeat_p50']:>8.1f} {r['repeat_p99']:>8.1f} | {r['fingerprint_p50']:>7.1f}",
                flush=True,
            )
    print()
    cfg = AffinityConfig()
    print("index memory (tracemalloc, filled with 3x capacity)")
    for capacity in sorted({cfg.index_blocks, cfg.index_max_blocks}):
        idx_b, ex_b = index_memory(capacity)
        print(
            f"  prefix index of {capacity:>6} blocks: {idx_b / 2**20:6.2f} MiB per backend "
            f"({idx_b / capacity:5.1f} B/block; covers ~{capacity * cfg.block_bytes // 4:,} tokens of KV)"
        )
    idx_b, ex_b = index_memory(cfg.exact_entries)
    print(f"  exact map of {cfg.exact_entries} fingerprints (fleet-wide): {ex_b / 2**20:6.2f} MiB")


if __name__ == "__main__":
    main()
