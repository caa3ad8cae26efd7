"""What the client-facing and backend-facing HTTP/2 connections share: an h2 state machine, a transport,
write batching and write-side back-pressure.

Bytes h2 produces are written once per event-loop turn for every connection touched in that turn
(`Flusher`), not once per frame: one client read often touches a client connection and several backend
connections, and a syscall per frame would cost more than the relaying itself.

When a transport's write buffer is above its high-water mark (`pause_writing`), the side stops moving
DATA onto it; the flow-control windows of the other side then stay closed until it drains, so a slow
reader slows its writer instead of growing the proxy's memory.
"""

from __future__ import annotations

import abc
import asyncio
from typing import TYPE_CHECKING, Iterable

import h2.config
import h2.connection
import h2.settings

if TYPE_CHECKING:
    from proxy.grpc.relay import Call


class Flusher:
    """Collects the connections touched during one loop turn and writes their pending bytes once."""

    __slots__ = ("_dirty", "_scheduled", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._dirty: set[H2Side] = set()
        self._scheduled = False
        self._loop = loop

    def mark(self, side: "H2Side") -> None:
        self._dirty.add(side)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.run)

    def run(self) -> None:
        self._scheduled = False
        dirty, self._dirty = self._dirty, set()
        for side in dirty:
            side.write_out()


def h2_config(client_side: bool) -> h2.config.H2Configuration:
    # Headers stay bytes and unvalidated/unnormalised: the proxy passes them through unchanged (no
    # lower-casing surprises, no cookie splitting) and validation costs time on every call. The peers
    # validate what they receive.
    return h2.config.H2Configuration(
        client_side=client_side,
        header_encoding=None,
        validate_inbound_headers=False,
        validate_outbound_headers=False,
        normalize_inbound_headers=False,
        normalize_outbound_headers=False,
    )


class H2Side(asyncio.Protocol, abc.ABC):
    """Base of both connection kinds; `calls` maps this connection's stream ids to relayed calls."""

    conn: h2.connection.H2Connection
    transport: asyncio.Transport | None

    def __init__(self, flusher: Flusher, client_side: bool) -> None:
        self.flusher = flusher
        self.conn = h2.connection.H2Connection(config=h2_config(client_side))
        self.transport = None
        self.paused = False
        self.closed = False
        self.calls: dict[int, "Call"] = {}

    def init_settings(self, max_streams: int, stream_window: int, connection_window: int) -> None:
        conn = self.conn
        conn.local_settings = h2.settings.Settings(
            client=conn.config.client_side,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_streams,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: stream_window,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 65536,
            },
        )
        conn.initiate_connection()
        delta = connection_window - 65535
        if delta > 0:
            conn.increment_flow_control_window(delta)

    def mark(self) -> None:
        self.flusher.mark(self)

    def write_out(self) -> None:
        data = self.conn.data_to_send()
        if data and self.transport is not None and not self.closed:
            self.transport.write(data)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.on_writable(self.calls.values())

    @abc.abstractmethod
    def on_writable(self, calls: Iterable["Call"]) -> None:
        """More data may be sent on these calls (window opened, transport drained)."""
