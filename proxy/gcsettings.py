"""The cyclic garbage collector's settings for a serving process, applied once start-up has built everything.

Measured (loadtest/results/peers.md, "Round 3: the tail at one connection"; every collection timed with
`gc.callbacks`): the data path's objects are freed by reference counting, so nothing the collector finds
is garbage (35 objects in 20 s at 64 connections). At one connection it hardly runs (one collection in
30 s); under load it runs for nothing: at 64 connections, with CPython's defaults, ~90 young collections a
second and a full one every ~1.5 s that traversed the ~66,000 objects imports, configuration and the
plug-in tables had made, 36 ms on the loop each time, ~0.7 s of CPU in 20 s (about 10 µs per request).

- `gc.collect()` then `gc.freeze()` once the process is built: what start-up made moves to the permanent
  generation, which no collection traverses again, so a full collection costs only what was made since
  (0.5 ms instead of 36 ms). Frozen objects are still freed by reference counting; only a reference cycle
  among them is never collected: most live as long as the process, and what the first reload replaces of
  them is kept once (what reloads build later is collected as usual).
- generation 0's threshold `GEN0` instead of 700: a young collection mostly meets the requests in flight
  at that moment, promotes them, and they die soon after; ten times fewer collections do ten times less of
  that (at 64 connections: a few collections in 20 s instead of ~1,250 after the freeze alone).
  End to end (bench_peers --ab, 64 connections): CPU per request 0.90× round robin, 0.89× affinity.

`AFFINITY_PROXY_GC` in the environment: `default` keeps CPython's settings (no freeze, thresholds as they
are); an integer N freezes and sets generation 0's threshold to N; unset: freeze and `GEN0`.
"""

from __future__ import annotations

import gc
import logging
import os

log = logging.getLogger("affinity_proxy")

GEN0 = 7000
ENV = "AFFINITY_PROXY_GC"


def tune_gc(setting: str | None = None) -> None:
    """Apply the serving settings (see the module docstring); `setting` is AFFINITY_PROXY_GC's value."""
    value = os.environ.get(ENV) if setting is None else setting
    if value is not None and value.strip().lower() == "default":
        return
    gen0 = GEN0
    if value is not None and value.strip():
        try:
            gen0 = int(value)
            if gen0 < 1:
                raise ValueError(value)
        except ValueError:
            log.warning("%s=%r is neither 'default' nor a positive integer: using %d", ENV, value, GEN0)
            gen0 = GEN0
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0, gen1, gen2)
