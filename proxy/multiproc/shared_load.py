"""The host-wide load block: one shared-memory buffer every worker maps, so `--workers N` routes on the
in-flight work and queued prefill of the whole proxy, not of one worker (the cells and how they are read
and written: proxy/core/inflight.py).

Why a memfd passed down, rather than a named `multiprocessing.shared_memory` block: the supervisor already
hands each worker a file descriptor (its channel), so one more costs nothing; an anonymous memfd has no
name to collide with or leak (the kernel frees it when the last process holding it exits, even after a
SIGKILL), and Python 3.11's resource tracker, which unlinks a named block when the first worker that
attached to it exits, never sees it. Where `os.memfd_create` is missing, an unlinked temporary file does
the same job.

Slots: the supervisor owns the backend name -> slot map and sends it with every snapshot whose backend set
changed, so every worker uses the same slot for a backend. A backend that leaves frees its slot; a freed
slot is given to another backend only once no worker has anything left in it (a worker keeps its slot for
a backend while it still has requests there), and never-used slots go first.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from typing import Iterable

from proxy.core.inflight import SharedInflightTable, SharedLayout, clear_row, slot_is_idle
from proxy.dataplane.shared_chunks import ChunkLayout, SharedChunks

log = logging.getLogger("affinity_proxy.workers")

DEFAULT_SLOTS = 1024


def _anonymous_fd(size: int) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("affinity-proxy-load", 0)
    else:
        fd = os.dup(tempfile.TemporaryFile().fileno())
    os.ftruncate(fd, size)
    return fd


class SharedLoad:
    """One process's mapping of the block: the supervisor creates it (`create`), each worker maps the
    descriptor it inherited (`attach`)."""

    def __init__(self, fd: int, layout: SharedLayout) -> None:
        self.fd = fd
        self.layout = layout
        self._mmap = mmap.mmap(fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = memoryview(self._mmap)

    @classmethod
    def create(cls, workers: int, slots: int = DEFAULT_SLOTS) -> SharedLoad:
        layout = SharedLayout(rows=workers, slots=slots)
        return cls(_anonymous_fd(layout.size), layout)  # a new memfd reads as zeros

    @classmethod
    def attach(cls, fd: int, layout: SharedLayout) -> SharedLoad:
        return cls(fd, layout)

    def table(self, row: int | None) -> SharedInflightTable:
        return SharedInflightTable(self.buf, self.layout, row)

    def clear_row(self, row: int) -> None:
        clear_row(self.buf, self.layout, row)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()
        os.close(self.fd)


class SharedChunkBlock:
    """The host's tokenised prompt chunks (proxy/dataplane/shared_chunks.py): one row per worker, made and
    passed down like the load block. Its pages are only allocated as workers write them: ~16.5 MiB per
    worker once its row has gone round, nothing without the precise index."""

    def __init__(self, fd: int, layout: ChunkLayout) -> None:
        self.fd = fd
        self.layout = layout
        self._mmap = mmap.mmap(fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def create(cls, workers: int) -> SharedChunkBlock:
        layout = ChunkLayout(rows=workers)
        return cls(_anonymous_fd(layout.size), layout)

    @classmethod
    def attach(cls, fd: int, layout: ChunkLayout) -> SharedChunkBlock:
        return cls(fd, layout)

    def view(self, row: int | None) -> SharedChunks:
        """A worker's view (`row`: the one it writes), or a read-only one (None)."""
        return SharedChunks(memoryview(self._mmap), self.layout, row)


class SlotMap:
    """The supervisor's backend name -> slot assignment."""

    def __init__(self, load: SharedLoad) -> None:
        self._load = load
        self.slots: dict[str, int] = {}
        self._next = 0  # slots below this have been used at least once
        self._freed: list[int] = []
        self._warned = False

    def follow(self, names: Iterable[str]) -> bool:
        """Give every name a slot, free the slots of names gone; True if the map changed."""
        wanted = list(dict.fromkeys(names))
        keep = set(wanted)
        changed = False
        for name in [n for n in self.slots if n not in keep]:
            self._freed.append(self.slots.pop(name))
            changed = True
        for name in wanted:
            if name in self.slots:
                continue
            slot = self._allocate()
            if slot is None:
                if not self._warned:
                    log.error(
                        "the shared load block's %d slots are all in use: further backends are counted per "
                        "worker only", self._load.layout.slots,
                    )
                    self._warned = True
                continue
            self.slots[name] = slot
            changed = True
        return changed

    def _allocate(self) -> int | None:
        if self._next < self._load.layout.slots:
            self._next += 1
            return self._next - 1
        for i, slot in enumerate(self._freed):
            if slot_is_idle(self._load.buf, self._load.layout, slot):
                del self._freed[i]
                return slot
        return None
