"""The single hand-off point between the control plane and the data plane.

Control-plane tasks compute a new `Snapshot` from the current one and `publish` it; the data plane reads
`current` once per request. Publishing is one reference assignment on the event loop thread, so readers
never see a half-built fleet and never wait. `compare_and_publish` protects a writer from overwriting a
snapshot another control-plane task published while it was computing (poller vs. health checker vs.
reload): on a version mismatch it recomputes on top of the newer one.
"""

from __future__ import annotations

from typing import Callable

from proxy.core.snapshot import Snapshot

Listener = Callable[[Snapshot], None]


class SnapshotStore:
    def __init__(self, initial: Snapshot) -> None:
        self._current = initial
        self._listeners: list[Listener] = []

    @property
    def current(self) -> Snapshot:
        return self._current

    def subscribe(self, listener: Listener) -> None:
        """Called after every publish (e.g. export gauges, push to worker processes)."""
        self._listeners.append(listener)

    def publish(self, snapshot: Snapshot) -> Snapshot:
        if snapshot.version <= self._current.version:
            raise ValueError(
                f"snapshot version must increase: {snapshot.version} after {self._current.version}"
            )
        self._current = snapshot
        for listener in self._listeners:
            listener(snapshot)
        return snapshot

    def update(self, change: Callable[[Snapshot], Snapshot]) -> Snapshot:
        """Apply `change` to the current snapshot and publish the result.

        Changes are synchronous functions of the current snapshot, so on one event loop two writers can
        never interleave inside `update`: each one builds on the other's result.
        """
        return self.publish(change(self._current))
