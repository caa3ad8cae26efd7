"""Which backend stored each Responses API response, learned from the answers the proxy relays.

vLLM keeps the responses it stores (`store: true`, the API's default) in the serving engine's own memory:
a request with `previous_response_id` must reach the engine that produced that response, or it answers
404 "Response with id '...' not found.". Each turn of a chain names a new previous response, so no hash of
the request finds that engine; the data plane remembers instead. It reads the response id off each
successful `/v1/responses` answer as it passes (a JSON answer's top-level `id`; a stream's
`response.created` event, the first the API sends) and records it against the backend that answered, in
a bounded map (least recently learned or used entries go first). The summary of a request that continues
a known response carries that backend as its `state_home`, which the Router honours while the backend is
routable (proxy/dataplane/router.py).

With `--workers N` every worker keeps its own map and shares what it learns: `on_learn` sends each new
entry up the supervisor channel, the supervisor passes it to every other worker, which `adopt`s it (a few
hundred microseconds later on an idle host; a turn that reaches another worker sooner than that, or a worker
started after the entry was shared, routes by the session key and may get the engine's 404).
"""

from __future__ import annotations

import json
import re
from typing import Callable

RESPONSES_PATH = "/v1/responses"
DEFAULT_MAX_ENTRIES = 100_000
# How much of a stream is searched for `response.created` before giving up (it is the first event).
SNIFF_LIMIT_BYTES = 64 * 1024
# The top-level `id` at the start of a JSON answer (vLLM and OpenAI put it first), else a full parse.
_LEADING_ID = re.compile(rb'^\s*\{\s*"id"\s*:\s*"([^"\\]{1,256})"')
_LEADING_ID_MAX = 512  # bytes: past this without a match, a streamed JSON answer's id is not leading


class ResponseHomes:
    """response id -> backend name, at most `max_entries` of them (insertion order; a lookup refreshes)."""

    __slots__ = ("max_entries", "_homes", "_on_learn")

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, *,
                 on_learn: Callable[[str, str], None] | None = None) -> None:
        """`on_learn(response_id, backend)`: told of every entry this process learns itself (the --workers
        channel shares them; entries `adopt`ed from elsewhere are not told again)."""
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._homes: dict[str, str] = {}
        self._on_learn = on_learn

    def __len__(self) -> int:
        return len(self._homes)

    def learn(self, response_id: str, backend: str) -> None:
        self.adopt(response_id, backend)
        if self._on_learn is not None:
            self._on_learn(response_id, backend)

    def adopt(self, response_id: str, backend: str) -> None:
        """Record an entry without telling `on_learn` (what another process learned)."""
        homes = self._homes
        homes.pop(response_id, None)
        homes[response_id] = backend
        if len(homes) > self.max_entries:
            del homes[next(iter(homes))]

    def home(self, response_id: str) -> str | None:
        homes = self._homes
        backend = homes.pop(response_id, None)
        if backend is not None:
            homes[response_id] = backend  # used: it moves to the young end
        return backend


def response_id_from_json(body: bytes) -> str | None:
    """The `id` of a JSON Responses API answer, or None when the body is not one."""
    m = _LEADING_ID.match(body)
    if m is not None:
        return m[1].decode("utf-8", "replace")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    rid = data.get("id") if isinstance(data, dict) else None
    return rid if isinstance(rid, str) and rid else None


class CreatedSniffer:
    """Reads a Responses API event stream until its `response.created` event names the response (with
    `sse=False`, a JSON answer relayed as it arrives, chunked: until its leading `id`).

    `feed(piece)` with each body piece as relayed; `done` turns true once the id is found (`response_id`)
    or the search gave up (another event came first with an id, or `SNIFF_LIMIT_BYTES` passed)."""

    __slots__ = ("response_id", "done", "_buf", "_sse")

    def __init__(self, sse: bool = True) -> None:
        self.response_id: str | None = None
        self.done = False
        self._buf = b""
        self._sse = sse

    def feed(self, piece: bytes) -> None:
        if self.done:
            return
        buf = self._buf + piece
        if not self._sse:
            m = _LEADING_ID.match(buf)
            if m is not None:
                self.response_id = m[1].decode("utf-8", "replace")
                self.done = True
            elif len(buf) > _LEADING_ID_MAX or (buf.lstrip()[:1] not in (b"", b"{")):
                self.done = True  # the id is not where vLLM and OpenAI put it: not learned
            self._buf = buf
            return
        while True:
            end = _event_end(buf)
            if end is None:
                break
            event, buf = buf[:end], buf[end:].lstrip(b"\r\n")
            data = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
            if not data:
                continue
            try:
                parsed = json.loads(data)
            except (ValueError, UnicodeDecodeError):
                self.done = True
                return
            if isinstance(parsed, dict) and parsed.get("type") == "response.created":
                resp = parsed.get("response")
                rid = resp.get("id") if isinstance(resp, dict) else None
                self.response_id = rid if isinstance(rid, str) and rid else None
            self.done = True  # response.created is the first event: any other means there is none
            return
        if len(buf) > SNIFF_LIMIT_BYTES:
            self.done = True
            buf = b""
        self._buf = buf


def _event_end(buf: bytes) -> int | None:
    """End of the first complete SSE event in `buf` (its blank line), or None."""
    ends = [i for i in (buf.find(b"\n\n"), buf.find(b"\r\n\r\n")) if i >= 0]
    return min(ends) if ends else None


__all__ = ["CreatedSniffer", "DEFAULT_MAX_ENTRIES", "RESPONSES_PATH", "ResponseHomes", "response_id_from_json"]
