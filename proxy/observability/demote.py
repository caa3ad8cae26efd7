"""Optional (`hotspots.lower_weight_to`, off by default): a latency hot spot routes less until it clears.

When a backend becomes a hot spot its run-time routing weight becomes ``lower_weight_to`` x its effective
weight, through `SnapshotStore.update` exactly as the admin weight endpoint (POST /admin/backends/{name}/weight)
sets it, so every policy and every worker (the supervisor's snapshot) sees the same fleet. When it clears,
the weight it had before is put back, unless an operator changed the weight meanwhile: their choice wins and
stays. With --workers the supervisor's aggregator judges the windows, so the supervisor does this once.
"""

from __future__ import annotations

import logging

from proxy.control.store import SnapshotStore
from proxy.core.hotspots import LATENCY_HOT_SPOT, HotspotEvent

log = logging.getLogger("proxy.hotspots")


class HotspotWeights:
    def __init__(self, store: SnapshotStore, factor: float) -> None:
        self.store = store
        self.factor = factor
        # backend -> (its run-time weight before, None = the configured one; the weight set here)
        self._lowered: dict[str, tuple[float | None, float]] = {}

    def on_event(self, event: HotspotEvent) -> None:
        if event.state != LATENCY_HOT_SPOT:
            return
        name = event.backend
        backend = self.store.current.get(name)
        if backend is None:  # left the fleet meanwhile
            self._lowered.pop(name, None)
            return
        if event.entered:
            if name in self._lowered:
                return
            lowered = backend.effective_weight * self.factor
            self._lowered[name] = (backend.weight, lowered)
            self.store.update(lambda snap: snap.replace_backend(name, weight=lowered))
            log.warning("backend %s is a latency hot spot: routing weight %.3g -> %.3g until it clears",
                        name, backend.effective_weight, lowered, extra={"event": "hotspot_weight_lowered"})
            return
        entry = self._lowered.pop(name, None)
        if entry is None:
            return
        before, lowered = entry
        if backend.weight != lowered:
            log.info("backend %s cleared; its weight was changed meanwhile (%s) and stays", name, backend.weight)
            return
        self.store.update(lambda snap: snap.replace_backend(name, weight=before))
        log.info("backend %s is no longer a latency hot spot: routing weight restored to %.3g", name,
                 backend.spec.weight if before is None else before, extra={"event": "hotspot_weight_restored"})
