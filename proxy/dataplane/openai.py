"""The OpenAI pipeline, written once for every HTTP version: parse, summarise, route, exchange, map errors.

A protocol adapter (aiohttp for HTTP/1.1 in proxy/http/server.py, the HTTP/2 bridge in proxy/grpc/bridge.py)
reads the request head and the body (bounded), fills in an `InboundRequest` and hands it to
`OpenAIPipeline.handle` together with a `Responder`, its own way of writing an answer back:

    summary      = parse the body once (`summary_from_openai`), bounded in size and JSON depth
    lease        = router.route(summary, ...)            admit -> pick (proxy/dataplane/router.py)
    attempt      = send the ORIGINAL bytes over the relay pool; retried on another backend while nothing
                   reached the client (proxy/dataplane/retry.py)
    answer       = a whole `Answer` (JSON, held 429/503, the proxy's own errors), sent once the lease ended,
                   or a stream relayed through the responder as it arrives (never retried)

Every routing failure, upstream failure and mid-stream break is mapped here to the same OpenAI-shaped
answer whichever protocol carried the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from http import HTTPStatus
from typing import Any, Callable, Generic, Protocol, TypeVar

import aiohttp
import msgspec
from multidict import CIMultiDict

from proxy.control.orca import FORMAT_HEADER as ORCA_FORMAT_HEADER
from proxy.control.orca import HEADER as ORCA_HEADER
from proxy.core.decision import NoBackendAvailable
from proxy.core.decision import Outcome
from proxy.core.request import SUMMARISERS, RequestError, RequestSummary, summary_from_openai
from proxy.dataplane.errors import ClientGone, error_body, sse_error_event
from proxy.dataplane.response_homes import RESPONSES_PATH, CreatedSniffer, ResponseHomes, response_id_from_json
from proxy.dataplane.retry import Attempts, RetryController, RetryableFailure
from proxy.dataplane.router import Lease, Overloaded, Router, UnknownModel
from proxy.metrics import ProxyMetrics
from proxy.observability.lifecycle import Observability, RequestObservation, strip_trace_headers
from proxy.observability.record import HTTP1
from proxy.upstream.failures import classify_upstream_error
from proxy.upstream.headers import upstream_request_head
from proxy.upstream.http1 import Exchange, UpstreamPool

log = logging.getLogger("affinity_proxy.http")

# The paths routed on their content: exactly those proxy/core/request.py knows how to summarise.
ROUTED_ENDPOINTS = frozenset(SUMMARISERS)
ANTHROPIC_MESSAGES = "/v1/messages"
RETRY_AFTER_S = "1"
# Deeper request JSON is refused with a 400. OpenAI request bodies nest a handful of levels (messages ->
# content parts -> image_url; tool schemas a few more); Python's json parser itself gives up with a
# RecursionError somewhere near 1,000 levels, and every later walk over the parsed body recurses too.
MAX_JSON_DEPTH = 128
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
ORCA_ASK = ((ORCA_FORMAT_HEADER.encode(), b"TEXT"),)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class InboundRequest:
    """What every attempt of one request needs, read once by the protocol adapter."""

    __slots__ = ("method", "raw_path", "path", "scheme", "raw_headers", "peer", "request_id", "body",
                 "asked_orca", "session_key", "received_at", "protocol", "observation")

    def __init__(self, method: str, raw_path: str, path: str, scheme: str,
                 raw_headers: tuple[tuple[bytes, bytes], ...], peer: str | None, request_id: str, body: bytes,
                 *, asked_orca: bool, session_key: str | None, received_at: float, protocol: str = HTTP1) -> None:
        self.method = method
        self.raw_path = raw_path
        self.path = path
        self.scheme = scheme
        self.raw_headers = raw_headers
        self.peer = peer
        self.request_id = request_id
        self.body = body
        self.asked_orca = asked_orca  # the client asked for ORCA reports itself: they are its to keep
        self.session_key = session_key
        # When the request's head was received (time.monotonic): request durations count from here for
        # every protocol (proxy/dataplane/router.py).
        self.received_at = received_at
        self.protocol = protocol  # as the access log names it: http/1.1 | h2
        # This request's record and trace (proxy/observability/lifecycle.py), set by `handle`; None: off.
        self.observation: RequestObservation | None = None


def _raw_header(raw: tuple[tuple[bytes, bytes], ...], name: str) -> str | None:
    key = name.encode()
    for n, v in raw:
        if n.lower() == key:
            return v.decode("latin-1")
    return None


def _no_header(name: str) -> str | None:
    return None


class Answer:
    """A complete answer not sent yet: the backend's (JSON, or held back for a retry) or the proxy's own."""

    __slots__ = ("status", "reason", "headers", "body", "head_length", "close")

    def __init__(self, status: int, reason: str, headers: CIMultiDict[str], body: bytes,
                 head_length: int | None = None, close: bool = False) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body
        self.head_length = head_length  # HEAD: the length a GET would have had (the backend's Content-Length)
        self.close = close  # close the connection after it (HTTP/1.1: the rest of an oversized body is unread)


class Responder(Protocol[T_co]):
    """How one protocol writes an answer to its client. `T` is what its handler returns."""

    async def send(self, answer: Answer) -> T_co:
        """A whole answer (status, headers and body at once)."""

    async def start(self, up: Exchange, headers: CIMultiDict[str]) -> None:
        """The head of a streamed answer; from here on bytes reached the client."""

    async def relay(self, up: Exchange) -> None:
        """Forward the body as it arrives; upstream failures propagate (UPSTREAM_ERRORS)."""

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> T_co:
        """The stream is complete."""

    async def abort(self) -> T_co:
        """The stream broke and cannot carry an error event: end it so the client sees a failure."""

    def gone(self) -> bool:
        """The client went away (a failed write then says nothing about the backend)."""


def error_answer(status: int, message: str, type_: str, code: str, param: str | None = None, *,
                 request_id: str, retry_after: str | None = None, close: bool = False) -> Answer:
    headers: CIMultiDict[str] = CIMultiDict([("Content-Type", "application/json"), ("x-request-id", request_id)])
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    return Answer(status, _reason(status), headers, error_body(message, type_, code, param), close=close)


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


class JsonTooDeep(ValueError):
    pass


_JSON_DECODER = msgspec.json.Decoder()
_NOT_PARSED = object()


def parse_json(body: bytes | bytearray) -> Any:
    """`json.loads`, with nesting deeper than MAX_JSON_DEPTH refused (JsonTooDeep, a ValueError).

    Cheap in the common case: a body with fewer brackets than the limit cannot be nested that deep, so
    only bodies with many brackets (inside strings, usually) get their parsed tree measured.
    """
    parsed: Any = _NOT_PARSED
    if body[:1] == b"{":
        # msgspec's decoder first: ~10x faster than json.loads on a small request (0.2 vs 2.2 µs), and for
        # every body it accepts the same value (a differential fuzz: loadtest/results/peers.md, round 3).
        # Whatever it refuses (NaN, numbers out of range, escaped lone surrogates, deep nesting, invalid
        # UTF-8...) goes to json.loads below, so accepted bodies and error messages are json's as before.
        try:
            parsed = _JSON_DECODER.decode(body)
        except (msgspec.DecodeError, RecursionError):
            pass
    if parsed is _NOT_PARSED:
        try:
            # An object whose first two bytes are not NUL is UTF-8 by json.detect_encoding's own rules (no
            # BOM starts with "{"): decode it here and skip the detection.
            if body[:1] == b"{" and len(body) > 1 and body[1]:
                parsed = json.loads(body.decode("utf-8", "surrogatepass"))
            else:
                parsed = json.loads(body)
        except RecursionError:
            raise JsonTooDeep(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and _deeper_than(parsed, MAX_JSON_DEPTH):
        raise JsonTooDeep(f"nested deeper than {MAX_JSON_DEPTH} levels")
    return parsed


def _deeper_than(value: Any, limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


class OpenAIPipeline(Generic[T]):
    """One per process, shared by every HTTP listener. Dependencies come in here and nowhere else."""

    def __init__(
        self, router: Router, pool: UpstreamPool, metrics: ProxyMetrics, *,
        retries: RetryController | None = None,
        load_report: Callable[[str, str], None] | None = None,
        debug_headers: bool = False,
        max_body_bytes: int,
        session_header: str | None = None,
        observability: Observability | None = None,
        response_homes: ResponseHomes | None = None,
    ) -> None:
        self.router = router
        self.pool = pool
        self.metrics = metrics
        self.counters = metrics.upstream
        # RESILIENCE's retry controller; None = one attempt, no retry.
        self.retries = retries
        # Telemetry's ORCA hook (Poller.observe_orca) when telemetry.orca is on: upstream requests then ask
        # for `endpoint-load-metrics`, and each response's report refreshes the backend's signals.
        self.load_report = load_report
        self.debug_headers = debug_headers
        self.max_body_bytes = max_body_bytes
        self.session_header = session_header
        # Access log, hot-spot windows and traces (proxy/observability); None when all are off.
        self.observability = observability if observability is not None and observability.active else None
        # Responses API: response id -> the backend that stored it (proxy/dataplane/response_homes.py).
        self.response_homes = response_homes if response_homes is not None else ResponseHomes()
        # The tasks of the requests being proxied, and the ones told to end because the drain deadline
        # passed (`expire`): a stream ends with an SSE error event, an unanswered request with a 503.
        self._active: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop, known from the first request
        self._expired: set[asyncio.Task[Any]] = set()

    def expire(self) -> int:
        """The drain deadline (timeouts.drain_s) passed: end every request still in flight, each in its
        protocol's shape, so that clients hear why instead of seeing a cut connection. Returns how many."""
        tasks = [t for t in self._active if not t.done()]
        for task in tasks:
            self._expired.add(task)
            task.cancel()
        return len(tasks)

    def _expiring(self) -> bool:
        """True once, in a request task cancelled by `expire`: the cancellation is taken back so the task
        can still write its final answer."""
        task = asyncio.current_task()
        if task is None or task not in self._expired:
            return False
        self._expired.discard(task)
        task.uncancel()
        return True

    # ------------------------------------------------------------------------------------------ request

    def too_large(self, request_id: str) -> Answer:
        self.metrics.error("body_too_large")
        return error_answer(413, f"Request body is larger than the limit of {self.max_body_bytes} bytes",
                            "invalid_request_error", "body_too_large", request_id=request_id, close=True)

    def summarise(self, req: InboundRequest) -> RequestSummary | Answer:
        """The routing inputs of `req`, or the 400 answer its body earns."""
        if req.method != "POST" or req.path not in ROUTED_ENDPOINTS:
            return RequestSummary(prompt="", endpoint=req.path, session_key=req.session_key)
        try:
            parsed = parse_json(req.body)
        except ValueError as bad_json:
            self.metrics.error("invalid_json")
            return error_answer(400, f"Request body is not valid JSON: {bad_json}", "invalid_request_error",
                                "invalid_json", request_id=req.request_id)
        if self.router.aliases and isinstance(parsed, dict):
            model = parsed.get("model")
            served = self.router.resolve_model(model) if isinstance(model, str) else model
            if served != model:
                # The backends know the served name only: the forwarded body says it.
                parsed["model"] = served
                req.body = json.dumps(parsed, separators=(",", ":")).encode()
        try:
            summary = summary_from_openai(req.path, parsed, session_key=req.session_key,
                                          adapters=self.router.adapter_names())
        except RequestError as invalid:
            self.metrics.error("invalid_request")
            answer = error_answer(400, str(invalid), "invalid_request_error", "invalid_value", invalid.param,
                                  request_id=req.request_id)
            if req.path == ANTHROPIC_MESSAGES:
                # Anthropic's clients read their own error shape.
                answer.body = json.dumps({"type": "error", "error": {
                    "type": "invalid_request_error", "message": str(invalid)}}).encode()
            return answer
        if summary.previous_response_id is not None:
            home = self.response_homes.home(summary.previous_response_id)
            if home is not None:  # the engine that stored the previous response (the Router sends it there)
                summary = dataclasses.replace(summary, state_home=home)
        return summary

    async def handle(self, req: InboundRequest, responder: Responder[T]) -> T:
        """The whole request: summarise, route and exchange (retried per policy), answer, record.

        One coroutine for what used to be five nested ones (handle -> _handle -> proxy -> _proxy ->
        run_with_retries): each level was a coroutine object made and resumed at every suspension of every
        request (issue 19). Only the attempt (`_exchange`) is a coroutine of its own."""
        ob: RequestObservation | None = None
        observability = self.observability
        if observability is not None:
            raw = req.raw_headers
            # The header lookup is for the trace context only: no closure per request with tracing off.
            ob = req.observation = observability.begin(
                req.request_id, req.protocol, req.method, req.path, req.peer,
                _no_header if observability.tracing is None else lambda name: _raw_header(raw, name),
                req.received_at, len(req.body), req.session_key)
        task: asyncio.Task[Any] | None = None  # set while routed: what `expire` may end
        try:
            summary = self.summarise(req)
            if isinstance(summary, Answer):
                if ob is not None:
                    ob.answered(summary, "invalid_request")
                result = await responder.send(summary)
            else:
                if ob is not None:
                    ob.summarised(summary)
                loop = self._loop
                if loop is None:
                    loop = self._loop = asyncio.get_running_loop()
                task = asyncio.current_task(loop)  # given the loop: no get_running_loop, a getpid() on 3.11
                if task is not None:
                    self._active.add(task)
                request_id = req.request_id
                router = self.router
                experiments = router.experiments
                if experiments is not None and (refused := experiments.pin_request(req.raw_headers)) is not None:
                    result = await responder.send(error_answer(refused[0], refused[1], "invalid_request_error",
                                                               "arm_pin_refused", request_id=request_id))
                else:
                    error = None
                    # A whole answer's lease, finished once the answer is written: its accounting (the slot,
                    # the outcome report, the duration) then runs after the write, off the client's wait.
                    held: Lease | None = None
                    try:
                        # `run_with_retries` spelled out (proxy/dataplane/retry.py: the same loop, the same
                        # `Attempts` bookkeeping): no coroutine and closure for the loop per request.
                        attempts = Attempts(self.retries)
                        while True:
                            try:
                                lease = Lease(router, summary, attempts.exclude, req.received_at)  # router.route
                                waiting = lease.enter()
                                if waiting is not None:
                                    await waiting
                                answered = False  # (a `break` inside try/finally: mypyc cannot compile it)
                                try:
                                    outcome: Answer | T = await self._exchange(req, lease, responder)
                                    answered = True
                                except RetryableFailure as failure:
                                    last: RetryableFailure[Answer] = failure
                                    tried = lease.tried
                                finally:
                                    if answered and isinstance(outcome, Answer):
                                        held = lease
                                    else:  # failed (before the next attempt's pick), or streamed: written already
                                        lease.finish()
                                if answered:
                                    break
                            except NoBackendAvailable:
                                if attempts.count == 1:
                                    raise
                                attempts.no_backend_left()
                                outcome = last.response  # no other backend left: the failure it would have got
                                break
                            # The lease above is finished: the failed attempt is accounted to its backend
                            # before the next pick.
                            delay = attempts.retry(last, tried)
                            if delay is None:
                                outcome = last.response
                                break
                            if delay > 0:
                                await asyncio.sleep(delay)
                    except ConnectionError:
                        raise  # the client left (ClientGone, or a write to its closing connection): below
                    except UnknownModel as unknown:
                        error = "model_not_found"
                        outcome = error_answer(404, str(unknown), "invalid_request_error", "model_not_found", "model",
                                               request_id=request_id)
                    except Overloaded as overloaded:
                        error = "overloaded"
                        outcome = error_answer(overloaded.status, str(overloaded), "server_error", "overloaded",
                                               request_id=request_id, retry_after=str(overloaded.retry_after_s))
                    except NoBackendAvailable as no_backend:
                        error = "no_backend"
                        outcome = error_answer(503, str(no_backend) or "No backend is available", "server_error",
                                               "no_backend", request_id=request_id, retry_after=RETRY_AFTER_S)
                    except Exception as exc:  # a fault in the proxy (a bug, a policy that raised): this request alone fails
                        error = "internal_error"
                        log.error("internal error on request %s: %s: %s", request_id, type(exc).__name__, exc)
                        self.metrics.error("internal_error")
                        outcome = error_answer(500, "Internal proxy error", "server_error", "internal_error",
                                               request_id=request_id)
                    if isinstance(outcome, Answer):
                        try:
                            result = await responder.send(outcome)
                        finally:
                            if held is not None:
                                held.finish()
                        if ob is not None:
                            ob.answered(outcome, error)
                    else:
                        result = outcome  # what the responder returned after streaming
        except asyncio.CancelledError:
            if task is None or task not in self._expired:
                if ob is not None:
                    ob.finish(499, error="client_gone")
                raise
            self._expired.discard(task)
            task.uncancel()
            # Drain deadline before any response byte: the client may retry elsewhere.
            try:
                result = await responder.send(error_answer(
                    503, "The proxy is shutting down (its drain deadline passed)", "server_error", "shutting_down",
                    request_id=req.request_id, retry_after=RETRY_AFTER_S, close=True))
            except asyncio.CancelledError:
                if ob is not None:
                    ob.finish(499, error="client_gone")
                raise
            except BaseException:
                if ob is not None:
                    ob.finish(500, error="internal_error")
                raise
        except ConnectionError:
            # The client left while its answer was being written (its connection was already closing): a
            # 499 like a cancellation, not a fault of the proxy's (nor, in the hot-spot windows, the backend's).
            if ob is not None:
                ob.finish(499, error="client_gone")
            raise
        except BaseException:
            if ob is not None:
                ob.finish(500, error="internal_error")
            raise
        finally:
            if task is not None:
                self._active.discard(task)
                if self._expired:
                    self._expired.discard(task)
        if ob is not None:
            ob.finish_as_recorded()
        return result

    # ------------------------------------------------------------------------------------------ attempt

    async def _exchange(self, req: InboundRequest, lease: Lease, responder: Responder[T]) -> Answer | T:
        """One attempt. Returns a whole answer to send, or what the responder returned after streaming.
        Failures before the first byte raise `RetryableFailure` when a retry policy is configured."""
        backend = lease.backend
        url = backend.spec.url
        load_report = self.load_report
        asked_orca = load_report is not None and not req.asked_orca  # the proxy asks for the report, not the client
        extra: tuple[tuple[bytes, bytes], ...] = ORCA_ASK if asked_orca else ()
        raw_headers = req.raw_headers
        ob = req.observation
        # With tracing off the pick only fills the record: that is done once the request is on its way to the
        # backend (just below), off the client's wait. With tracing on, its span context goes upstream.
        record_pick = ob is not None and ob.trace is None
        if ob is not None and not record_pick:
            trace_headers = ob.picked(lease, url)
            if trace_headers:  # tracing on: the upstream span's context replaces the client's
                raw_headers = strip_trace_headers(raw_headers)
                extra = (*extra, *trace_headers)
        head = upstream_request_head(
            req.method, req.raw_path, self.pool.backend(url).host_header, raw_headers, req.peer,
            req.scheme, req.request_id, len(req.body), extra,
        )
        self.counters.requests += 1
        up: Exchange | None = None
        pool = self.pool
        try:
            try:
                up = pool.send(url, head, req.body, head_only=req.method == "HEAD")  # an idle connection: no coroutine
            finally:
                if record_pick and ob is not None:
                    ob.picked(lease, url)
            if up is None:
                up = await pool.request(url, head, req.body, head_only=req.method == "HEAD")
            else:
                await up.head
            if ob is not None:
                ob.first_byte()
            if lease.arm is not None:
                lease.first_byte_at = time.monotonic()  # experiments: the arm's TTFT (streams: head = first token)
            headers = up.headers  # end-to-end fields only; this exchange's own copy
            if load_report is not None:
                report = headers.get(ORCA_HEADER)
                if report is not None:
                    load_report(backend.name, report)
                    if asked_orca:
                        # The proxy asked for this report, not the client: it stops here.
                        headers.popall(ORCA_HEADER)
            headers["x-request-id"] = req.request_id
            if self.debug_headers:
                headers["x-affinity-backend"] = backend.name
                if lease.arm is not None:
                    headers["x-affinity-arm"] = f"{lease.arm.experiment}/{lease.arm.name}"
            status = lease.status = up.status
            retries = self.retries
            if retries is not None and status in retries.held_statuses:  # retries.retry_status(status)
                # Held back, not forwarded: if another backend is tried, the client never sees this one.
                held = Answer(up.status, up.reason, headers, await up.read())
                if ob is not None:
                    ob.attempt_failed(up.status)
                raise RetryableFailure(Outcome.STATUS_5XX if up.status >= 500 else Outcome.SUCCESS, held, up.status)
            sse = headers.get("Content-Type", "").startswith("text/event-stream")
            if not up.chunked and not sse and (up.content_length is not None or up.complete):
                body = up.body() if up.complete else await up.read()  # the usual JSON answer came with its head
                if up.status == 200 and req.path == RESPONSES_PATH:
                    rid = response_id_from_json(body)
                    if rid is not None:
                        self.response_homes.learn(rid, backend.name)
                if lease.arm is not None:
                    lease.body = body  # experiments: the arm's prompt and cached tokens from `usage`
                # A HEAD answer has no body but keeps the length a GET would have had.
                length = _declared_length(up.raw_headers) if req.method == "HEAD" else None
                return Answer(up.status, up.reason, headers, body, length)
            return await self._relay(up, headers, lease, sse, responder, ob)
        except asyncio.CancelledError:
            lease.status = 499
            raise
        except UPSTREAM_ERRORS as exc:
            if responder.gone():
                # The client left: a write to its closing connection raised (the streamed answer's head), or
                # it went while the backend was asked. No answer, no retry elsewhere, and nothing said of
                # the backend (a 502 here reported it to the outlier detection for a client's departure).
                lease.status = 499
                raise ClientGone("the client left before its answer started") from exc
            # Only reachable before anything was sent to the client (connecting, sending, reading a held or
            # JSON body): once _relay has started answering it handles failures itself.
            if ob is not None:
                ob.attempt_failed(error=type(exc).__name__)
                ob.record.error = "upstream_timeout" if isinstance(exc, asyncio.TimeoutError) else "upstream_error"
            return self._failed_before_response(exc, lease, req.request_id)
        finally:
            if up is not None:
                up.release()

    def _failed_before_response(self, exc: BaseException, lease: Lease, request_id: str) -> Answer:
        backend = lease.backend
        self.metrics.error("upstream_unreachable")
        lease.status = 504 if isinstance(exc, asyncio.TimeoutError) else 502
        log.warning("backend %s failed before responding: %r", backend.name, exc)
        failed = error_answer(
            lease.status, f"Backend {backend.name} failed: {type(exc).__name__}", "server_error",
            "upstream_timeout" if lease.status == 504 else "upstream_error", request_id=request_id,
        )
        lease.outcome = classify_upstream_error(exc)
        if self.retries is not None and lease.outcome is not None:
            raise RetryableFailure(lease.outcome, failed) from exc
        return failed

    async def _relay(self, up: Exchange, headers: CIMultiDict[str], lease: Lease, sse: bool,
                     responder: Responder[T], ob: RequestObservation | None = None) -> T:
        """Stream the answer as it arrives. From here on bytes reach the client: never retried."""
        if ob is not None:
            ob.record.status = up.status
        await responder.start(up, headers)
        try:
            if up.status == 200 and lease.summary.endpoint == RESPONSES_PATH:
                await self._relay_learning(up, responder, lease.backend.name, sse)
            else:
                await responder.relay(up)
        except UPSTREAM_ERRORS as failure:
            # Headers are gone already: end the stream with an error the client can parse, or visibly break it.
            self.metrics.error("upstream_midstream")
            lease.status = 502
            if ob is not None:
                ob.record.status, ob.record.error = 502, "upstream_midstream"
            if not responder.gone():  # a write to a departed client says nothing about the backend
                lease.outcome = Outcome.STREAM_FAILURE
            name = lease.backend.name
            log.warning("backend %s failed mid-stream: %r", name, failure)
            if not sse:
                return await responder.abort()
            await responder.write(sse_error_event(
                f"The backend {name} failed while streaming: {type(failure).__name__}",
                "upstream_stream_error",
            ))
        except asyncio.CancelledError:
            if not self._expiring():
                raise
            lease.status = 503
            if not sse or responder.gone():
                return await responder.abort()
            await responder.write(sse_error_event(
                "The proxy is shutting down: this stream outlived its drain deadline", "shutting_down"))
        except Exception as bug:
            # A fault in the proxy while relaying: the stream still ends in a shape the client parses.
            log.error("internal error relaying a response of %s: %s: %s", lease.backend.name,
                      type(bug).__name__, bug)
            self.metrics.error("internal_error")
            lease.status = 500
            if not sse or responder.gone():
                return await responder.abort()
            await responder.write(sse_error_event("Internal proxy error while streaming", "internal_error"))
        return await responder.end()

    async def _relay_learning(self, up: Exchange, responder: Responder[T], backend: str, sse: bool) -> None:
        """A Responses API answer relayed as it arrives (an event stream, or JSON sent chunked), piece by
        piece, remembering the response id it names first."""
        sniffer = CreatedSniffer(sse)
        async for piece in up.stream():
            if not sniffer.done:
                sniffer.feed(piece)
                if sniffer.response_id is not None:
                    self.response_homes.learn(sniffer.response_id, backend)
            await responder.write(piece)


def _declared_length(raw_headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in raw_headers:
        if name.lower() == b"content-length" and value.strip().isdigit():
            return int(value)
    return None


__all__ = ["Answer", "InboundRequest", "MAX_JSON_DEPTH", "OpenAIPipeline", "ROUTED_ENDPOINTS", "Responder",
           "RETRY_AFTER_S", "UPSTREAM_ERRORS", "error_answer", "parse_json"]
