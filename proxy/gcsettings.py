"""The cyclic garbage collector's settings for a serving process, applied once start-up has built everything.

Measured at one connection sending requests back to back (loadtest/results/peers.md, "Round 3: the tail at
one connection"): with CPython's defaults, a full (generation 2) collection ran every 10-20 s and traversed
every object that imports, configuration and the plug-in tables had made, 31 ms on the loop for one
request; the young collections (threshold 700) ran ~20 times a second, ~55 µs each, one of the periodic
pieces of work that a request at the tail coincides with.

- `gc.collect()` then `gc.freeze()` once the process is built: what start-up made moves to the permanent
  generation, which no collection traverses again, so a full collection costs only what was made since.
  Frozen objects are still freed by reference counting; only a reference cycle among them would never be
  collected (start-up objects live as long as the process).
- generation 0 threshold `GEN0` instead of 700: a serving process allocates and frees its per-request
  containers by reference counting; young collections find almost nothing (1,428 objects in 530
  collections), so running them ten times less often costs nothing and touches ten times fewer requests.

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
