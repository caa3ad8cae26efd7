"""Fault injection through the simulator under steady load, counted: the numbers behind issue 8.

Each scenario starts a small simulated fleet (sim.fleet), an in-process affinity-proxy with short
check intervals, and a bounded load loop of streaming chat requests; it injects one fault and returns a
`Result` with what happened: requests sent, completed, failed (clean = an OpenAI-shaped error the client can
parse, unclean = a hang or a cut connection), retried, plus scenario-specific times measured on the
proxy's own snapshot stream (detection, ejection, restore, drain). tests/resilience/test_faults.py runs the
same scenarios and asserts the invariants; this script prints the table:

    .venv/bin/python -m loadtest.resilience_report            # all scenarios, ~25 s
    .venv/bin/python -m loadtest.resilience_report kill stall  # some of them

Times are wall-clock on a shared 2-core machine: read them as orders of magnitude, not benchmarks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp

from loadtest.policy_spy import spy_on_policy
from sim.fleet import Fleet, start_fleet
from proxy.app import AffinityProxy
from proxy.config import load_config, parse_config
from proxy.core.snapshot import Health, Snapshot

MAX_TOKENS = 24  # ~150 ms streams at speed 1 on the default profile


# ------------------------------------------------------------------------------------------ load + counts


@dataclass
class Reply:
    started: float
    backend: str | None
    status: int
    ok: bool
    clean: bool  # failed with a parseable OpenAI error (JSON body or SSE error event)
    ids: frozenset[str]  # distinct completion ids seen in the stream: more than one = a spliced answer
    done_markers: int


@dataclass
class Result:
    name: str
    sent: int = 0
    ok: int = 0
    failed: int = 0
    failed_clean: int = 0
    retried: int = 0
    spliced: int = 0  # streams holding more than one answer (must be 0)
    by_backend: Counter[str] = field(default_factory=Counter)
    failed_by_backend: Counter[str] = field(default_factory=Counter)
    numbers: dict[str, Any] = field(default_factory=dict)
    outcomes: list[Reply] = field(default_factory=list)

    def add(self, o: Reply) -> None:
        self.outcomes.append(o)
        self.sent += 1
        self.by_backend[o.backend or "-"] += 1
        if o.ok:
            self.ok += 1
        else:
            self.failed += 1
            self.failed_clean += o.clean
            self.failed_by_backend[o.backend or "-"] += 1
        if len(o.ids) > 1 or o.done_markers > 1:
            self.spliced += 1


async def one_request(session: aiohttp.ClientSession, url: str, model: str, i: int, t0: float) -> Reply:
    body = {"model": model, "messages": [{"role": "user", "content": f"request {i}: tell me something"}],
            "max_tokens": MAX_TOKENS, "stream": True}
    started = time.monotonic() - t0
    backend: str | None = None
    status = 0
    text = ""
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            status = r.status
            backend = r.headers.get("x-affinity-backend")
            text = (await r.read()).decode("utf-8", "replace")
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return Reply(started, backend, status, False, False, frozenset(), 0)
    ids: set[str] = set()
    error = False
    for line in text.split("\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            obj = json.loads(line[6:])
        except ValueError:
            continue
        if "error" in obj:
            error = True
        elif "id" in obj:
            ids.add(obj["id"])
    done = text.count("data: [DONE]")
    if status != 200:
        try:
            clean = "error" in json.loads(text)
        except ValueError:
            clean = False
        return Reply(started, backend, status, False, clean, frozenset(ids), done)
    ok = done == 1 and not error
    return Reply(started, backend, status, ok, error, frozenset(ids), done)


async def load(url: str, model: str, result: Result, *, concurrency: int,
               duration_s: float | Callable[[], float], t0: float) -> None:
    """Closed loop: `concurrency` clients each send one request after the other until `duration_s` (a
    function: asked before every request, so a scenario may move the end while the load runs)."""
    counter = iter(range(10**9))
    timeout = aiohttp.ClientTimeout(total=30)
    until = duration_s if callable(duration_s) else (lambda: duration_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def client() -> None:
            while time.monotonic() - t0 < until():
                result.add(await one_request(session, url, model, next(counter), t0))

        await asyncio.gather(*(client() for _ in range(concurrency)))


class Timeline:
    """Records when each backend's health changed, from the proxy's snapshot stream."""

    def __init__(self, proxy: AffinityProxy, t0: float) -> None:
        self.t0 = t0
        self.events: list[tuple[float, str, Health]] = []
        self.left: dict[str, float] = {}  # backend -> when it left the snapshot
        self._last: dict[str, Health] = {b.name: b.health for b in proxy.store.current.backends}
        proxy.store.subscribe(self._on)

    def _on(self, snap: Snapshot) -> None:
        now = time.monotonic() - self.t0
        for b in snap.backends:
            if self._last.get(b.name) is not b.health:
                self.events.append((now, b.name, b.health))
                self._last[b.name] = b.health
        for name in [n for n in self._last if n not in snap]:
            del self._last[name]
            self.left[name] = now

    def first(self, name: str, health: Health, after: float = 0.0) -> float | None:
        return next((t for t, n, h in self.events if n == name and h is health and t >= after), None)


class AttemptLog:
    """When each upstream attempt went to which backend (a spy on the routing policy; measurement only).

    Each policy pick is one attempt here (no in-flight limits are set, so the router never re-picks past a
    saturated backend)."""

    def __init__(self, proxy: AffinityProxy, t0: float) -> None:
        self.attempts: list[tuple[float, str]] = []
        spy_on_policy(proxy.router, lambda _summary, decision, _before: self.attempts.append(
            (time.monotonic() - t0, decision.backend)))

    def last_to(self, name: str) -> float | None:
        times = [t for t, n in self.attempts if n == name]
        return max(times) if times else None


# ------------------------------------------------------------------------------------------ set-up


def proxy_yaml(fleet: Fleet, names: list[str] | None = None, extra: str = "", policy: str = "least_request") -> str:
    servers = [s for s in fleet.servers if names is None or s.name in names]
    lines = "\n".join(f"  - {{name: {s.name}, url: '{s.url}'}}" for s in servers)
    return (
        "listen: {port: 0}\nadmin: {port: 0}\ndebug_headers: true\ntelemetry: {enabled: false}\n"
        f"routing: {{policy: {policy}}}\n"
        "timeouts: {drain_s: 10}\n"
        f"{extra}backends:\n{lines}\n"
    )


CHECKS_FAST = ("health_checks: {interval_ms: 100, jitter: 0.2, timeout_ms: 500, healthy_threshold: 1,"
               " unhealthy_threshold: 3}\n")


async def with_fleet(n: int, body: Callable[[Fleet, str], Awaitable[Result]], **fleet_kw: Any) -> Result:
    fleet = await start_fleet(n, **fleet_kw)
    try:
        return await body(fleet, fleet.servers[0].backend.engine.model_name)
    finally:
        await fleet.stop()


async def start_proxy(text: str, path: Path | None = None) -> AffinityProxy:
    if path is not None:
        path.write_text(text)
        proxy = AffinityProxy(load_config(str(path)), config_path=str(path))
    else:
        proxy = AffinityProxy(parse_config(text))
    await proxy.start()
    return proxy


def _finish(result: Result, proxy: AffinityProxy) -> Result:
    result.retried = proxy.resilience.retries.retried
    return result


# ------------------------------------------------------------------------------------------ scenarios


async def scenario_kill(duration_s: float = 2.5, kill_at: float = 0.8, concurrency: int = 6) -> Result:
    """sim-1 is stopped abruptly under load: its open streams break, its port refuses."""

    async def body(fleet: Fleet, model: str) -> Result:
        proxy = await start_proxy(proxy_yaml(fleet, extra=CHECKS_FAST
                                             + "outlier_detection: {consecutive_connect_failures: 1}\n"))
        result = Result("kill")
        try:
            t0 = time.monotonic()
            timeline, attempts = Timeline(proxy, t0), AttemptLog(proxy, t0)
            killed = [kill_at]  # when sim-1 really went down; the load runs as long after it as planned

            async def kill() -> None:
                # Kill sim-1 while it serves. On a loaded machine the clients' first requests may start
                # later than kill_at: a CI run sent all 36 of its requests to the two others, in bursts of 6
                # split 3/3, which least_request does only while sim-1 is unroutable, i.e. already killed.
                # Killing a backend nobody used tests nothing, so wait for its first attempt (5 s at most)
                # and keep the load running as long after the kill as planned.
                await asyncio.sleep(kill_at)
                deadline = time.monotonic() + 5.0
                while attempts.last_to("sim-1") is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                killed[0] = time.monotonic() - t0
                await fleet.servers[1].stop()

            await asyncio.gather(load(proxy.http_url, model, result, concurrency=concurrency,
                                      duration_s=lambda: killed[0] + duration_s - kill_at, t0=t0), kill())
            ejected = timeline.first("sim-1", Health.UNHEALTHY, killed[0])
            last = attempts.last_to("sim-1")
            result.numbers = {
                "detected_after_s": None if ejected is None else round(ejected - killed[0], 3),
                "last_attempt_to_killed_after_s": None if last is None else round(max(0.0, last - killed[0]), 3),
                "failed_on_killed": result.failed_by_backend["sim-1"],
                "failed_elsewhere": result.failed - result.failed_by_backend["sim-1"],
            }
        finally:
            await proxy.stop()
        return _finish(result, proxy)

    return await with_fleet(3, body)


async def scenario_stall(duration_s: float = 4.5, stall_at: float = 0.5, stall_ms: float = 3000,
                         concurrency: int = 6, adaptive: bool = True) -> Result:
    """sim-1 pauses 3 s (a GC pause): every endpoint, /health included, answers late. With `adaptive`
    False the same checks use a fixed timeout, for comparison."""

    async def body(fleet: Fleet, model: str) -> Result:
        checks = CHECKS_FAST if adaptive else CHECKS_FAST.replace("unhealthy_threshold: 3", "unhealthy_threshold: 3,"
                                                                  " adaptive_timeout: false")
        proxy = await start_proxy(proxy_yaml(fleet, extra=checks))
        result = Result("stall 3s" + ("" if adaptive else " (fixed timeout)"))
        try:
            t0 = time.monotonic()
            timeline = Timeline(proxy, t0)

            async def stall() -> None:
                await asyncio.sleep(stall_at)
                await fleet.servers[1].set_faults({"stall_ms": stall_ms})

            await asyncio.gather(load(proxy.http_url, model, result, concurrency=concurrency,
                                      duration_s=duration_s, t0=t0), stall())
            counts = proxy.resilience.metrics.checks
            ejected = timeline.first("sim-1", Health.UNHEALTHY)
            result.numbers = {
                "ejected": ejected is not None,
                "ejected_after_s": None if ejected is None else round(ejected - stall_at, 3),
                "check_timeouts": counts.labels("sim-1", "timeout")._value.get(),
            }
        finally:
            await proxy.stop()
        return _finish(result, proxy)

    return await with_fleet(3, body)


async def scenario_5xx(duration_s: float = 3.5, fail_at: float = 0.5, recover_at: float = 1.5,
                       concurrency: int = 6) -> Result:
    """sim-1 answers every generation request with 500 for a second, then recovers."""

    async def body(fleet: Fleet, model: str) -> Result:
        proxy = await start_proxy(proxy_yaml(fleet, extra=CHECKS_FAST + (
            "outlier_detection: {consecutive_5xx: 3, base_ejection_ms: 500}\n")))
        result = Result("5xx then recover")
        try:
            t0 = time.monotonic()
            timeline = Timeline(proxy, t0)

            async def fault() -> None:
                await asyncio.sleep(fail_at)
                await fleet.servers[1].set_faults({"fail_rate": 1.0, "fail_status": 500})
                await asyncio.sleep(recover_at - fail_at)
                await fleet.servers[1].set_faults({"fail_rate": 0.0})

            await asyncio.gather(load(proxy.http_url, model, result, concurrency=concurrency,
                                      duration_s=duration_s, t0=t0), fault())
            ejected = timeline.first("sim-1", Health.UNHEALTHY, fail_at)
            # The last return to rotation: an ejection that ends while the fault is still on is followed by a
            # longer one, so the final HEALTHY transition is the one that stuck.
            back = [t for t, n, h in timeline.events if n == "sim-1" and h is Health.HEALTHY and t > fail_at]
            restored = back[-1] if back else None
            served_after = sum(1 for o in result.outcomes if o.backend == "sim-1" and o.ok and o.started > recover_at)
            result.numbers = {
                "ejected_after_s": None if ejected is None else round(ejected - fail_at, 3),
                "client_5xx": sum(1 for o in result.outcomes if o.status >= 500),
                "ejections": proxy.resilience.metrics.ejections.labels("sim-1")._value.get(),
                "restored_after_recovery_s": None if restored is None else round(restored - recover_at, 3),
                "healthy_at_end": proxy.store.current.get("sim-1").health is Health.HEALTHY,  # type: ignore[union-attr]
                "served_by_it_after_recovery": served_after,
            }
        finally:
            await proxy.stop()
        return _finish(result, proxy)

    return await with_fleet(3, body)


async def scenario_reload(duration_s: float = 3.0, concurrency: int = 6) -> Result:
    """Under load: remove sim-1 and add sim-3 (reload), then an invalid file, then bring sim-1 back."""

    async def body(fleet: Fleet, model: str) -> Result:
        tmp = Path(tempfile.mkdtemp(prefix="ap-reload-"))
        path = tmp / "proxy.yaml"
        proxy = await start_proxy(proxy_yaml(fleet, ["sim-0", "sim-1", "sim-2"], CHECKS_FAST), path)
        result = Result("reload under load")
        try:
            t0 = time.monotonic()
            timeline = Timeline(proxy, t0)
            reloads: list[tuple[float, bool, bool]] = []  # (when, ok, config object swapped)

            async def reload(text: str) -> None:
                path.write_text(text)
                before = proxy.config
                r = await proxy.resilience.reloader.reload("scenario")  # type: ignore[union-attr]
                reloads.append((time.monotonic() - t0, r.ok, proxy.config is not before))

            async def script() -> None:
                await asyncio.sleep(0.6)
                await reload(proxy_yaml(fleet, ["sim-0", "sim-2", "sim-3"], CHECKS_FAST))
                await asyncio.sleep(0.8)
                await reload(proxy_yaml(fleet, ["sim-0", "sim-2", "sim-3"], CHECKS_FAST) + "retries: {max_attempts: 0}\n")
                await asyncio.sleep(0.5)
                await reload(proxy_yaml(fleet, ["sim-0", "sim-1", "sim-2", "sim-3"], CHECKS_FAST))

            await asyncio.gather(load(proxy.http_url, model, result, concurrency=concurrency,
                                      duration_s=duration_s, t0=t0), script())
            removed_at = reloads[0][0]
            gone = next((t for t, n, h in timeline.events if n == "sim-1" and h is Health.DRAINING), None)
            joined = timeline.first("sim-3", Health.HEALTHY)
            result.numbers = {
                "reloads_ok_invalid_ok": "/".join("ok" if ok else "invalid" for _, ok, _ in reloads),
                "invalid_kept_old_config": not reloads[1][2],
                "invalid_reported": proxy.resilience.metrics.reloads.labels("invalid")._value.get(),
                "drained_backends": [f"{n} ({how})" for n, how in proxy.resilience.membership.drained],
                "sim-1_draining_after_s": None if gone is None else round(gone - removed_at, 3),
                "sim-1_left_after_s": round(timeline.left["sim-1"] - removed_at, 3) if "sim-1" in timeline.left
                else None,
                "sim-3_joined_after_s": None if joined is None else round(joined - removed_at, 3),
                "served_by_sim-3": result.by_backend["sim-3"],
            }
        finally:
            await proxy.stop()
        return _finish(result, proxy)

    return await with_fleet(4, body)


async def scenario_no_duplicate(duration_s: float = 2.0, concurrency: int = 6) -> Result:
    """sim-0 cuts every stream after 3 chunks, sim-1 answers 503 before any token: retries must help the
    503s and must never touch a stream that has started."""

    async def body(fleet: Fleet, model: str) -> Result:
        await fleet.servers[0].set_faults({"drop_after_chunks": 3})
        await fleet.servers[1].set_faults({"fail_rate": 1.0, "fail_status": 503})
        proxy = await start_proxy(proxy_yaml(fleet, extra=CHECKS_FAST + (
            "outlier_detection: {enabled: false}\nretries: {budget_percent: 100}\n"), policy="round_robin"))
        result = Result("retry vs streams")
        try:
            t0 = time.monotonic()
            await load(proxy.http_url, model, result, concurrency=concurrency, duration_s=duration_s, t0=t0)
            result.numbers = {
                "cut_streams_clean": result.failed_by_backend["sim-0"],
                "answers_from_503_backend": result.by_backend["sim-1"],
                "retries_on_503": proxy.resilience.metrics.retries.labels("503")._value.get(),
            }
        finally:
            await proxy.stop()
        return _finish(result, proxy)

    return await with_fleet(3, body)


async def scenario_sigterm(streams: int = 8, max_tokens: int = 200) -> Result:
    """SIGTERM (serve_until_signal) while long streams are open: each must finish within timeouts.drain_s."""

    async def body(fleet: Fleet, model: str) -> Result:
        proxy = AffinityProxy(parse_config(proxy_yaml(fleet, extra=CHECKS_FAST)))
        result = Result("SIGTERM with open streams")
        serving = asyncio.create_task(proxy.serve_until_signal())
        while proxy._http_runner is None or not proxy._http_runner.addresses:
            await asyncio.sleep(0.01)
        url = proxy.http_url
        first = [asyncio.Event() for _ in range(streams)]

        async def stream(i: int, session: aiohttp.ClientSession) -> Reply:
            body = {"model": model, "messages": [{"role": "user", "content": f"long {i}"}],
                    "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
            try:
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    chunks = []
                    async for line in r.content:
                        first[i].set()
                        chunks.append(line)
                    text = b"".join(chunks).decode()
                    ok = text.count("data: [DONE]") == 1 and '"error"' not in text
                    return Reply(0.0, r.headers.get("x-affinity-backend"), r.status, ok, not ok, frozenset(), 1)
            except aiohttp.ClientError:
                first[i].set()
                return Reply(0.0, None, 0, False, False, frozenset(), 0)

        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.create_task(stream(i, session)) for i in range(streams)]
            await asyncio.gather(*(e.wait() for e in first))
            sent_at = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
            for o in await asyncio.gather(*tasks):
                result.add(o)
            streams_done = time.monotonic() - sent_at
            await serving
            stopped = time.monotonic() - sent_at
        result.numbers = {"streams_open_at_sigterm": streams, "streams_done_after_s": round(streams_done, 3),
                          "proxy_stopped_after_s": round(stopped, 3), "drain_deadline_s": 10.0}
        return _finish(result, proxy)

    return await with_fleet(3, body)


SCENARIOS: dict[str, Callable[[], Awaitable[Result]]] = {
    "kill": scenario_kill,
    "stall": scenario_stall,
    "stall-fixed": lambda: scenario_stall(adaptive=False),
    "5xx": scenario_5xx,
    "reload": scenario_reload,
    "retry": scenario_no_duplicate,
    "sigterm": scenario_sigterm,
}


def table(results: list[Result]) -> str:
    head = f"{'scenario':<26}{'sent':>6}{'ok':>6}{'failed':>8}{'clean':>7}{'retried':>9}{'spliced':>9}  numbers"
    lines = [head, "-" * len(head)]
    for r in results:
        nums = ", ".join(f"{k}={v}" for k, v in r.numbers.items())
        lines.append(f"{r.name:<26}{r.sent:>6}{r.ok:>6}{r.failed:>8}{r.failed_clean:>7}{r.retried:>9}"
                     f"{r.spliced:>9}  {nums}")
    return "\n".join(lines)


async def main_async(names: list[str]) -> list[Result]:
    results = []
    for name in names:
        results.append(await SCENARIOS[name]())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", help=f"which scenarios, of {', '.join(SCENARIOS)} (default: all)")
    args = parser.parse_args()
    unknown = [n for n in args.scenarios if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    import logging

    logging.basicConfig(level=logging.ERROR)
    import uvloop

    results = uvloop.run(main_async(args.scenarios or list(SCENARIOS)))
    print(table(results))


if __name__ == "__main__":
    main()
