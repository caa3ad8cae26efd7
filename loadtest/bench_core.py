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

    .venv/bin/python -m loadtest.bench_core            # full table (~1 min on 2 shared cores)
    .venv/bin/python -m loadtest.bench_core --quick    # fewer iterations
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
    args = ap.parse_args()
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
