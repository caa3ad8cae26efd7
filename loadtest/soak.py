"""Soak: steady mixed load through a real `affinity-proxy` process with faults on a schedule.

    python -m loadtest.soak --duration 3600 [--rate 6] [--sample-s 60] [--out loadtest/results/soak]

What runs:

- a simulated fleet (sim/, in this process) of `--backends` servers with HTTP and gRPC;
- the proxy as a child process (this module with ``--proxy-child``: `AffinityProxy` exactly as
  `affinity-proxy run` builds it, plus one read-only admin route, ``GET /soak/stats``, reporting its asyncio
  task count and in-flight requests, since those cannot be read from /proc);
- steady load at `--rate` requests/s, mixed: HTTP unary chat, HTTP streamed chat (SSE to ``[DONE]``),
  gRPC unary Generate and gRPC server-streaming GenerateStream;
- faults, one every `--fault-every-s` seconds, in turn: a backend killed (connections refused) and restarted,
  a backend stalled, a 5xx burst on a backend, a valid reload (a weight changes), an invalid reload (a
  truncated file: the old config must keep serving), and a client disconnect storm (streams abandoned after
  their first event);
- a sample every `--sample-s` seconds: the proxy's RSS and open FDs and sockets (from /proc/PID) and its
  asyncio tasks and in-flight requests (``/soak/stats``).

It fails (exit status 1) when

- a request fails that no fault touched: one whose lifetime overlaps no fault window (kill, stall and 5xx
  windows, each extended by `GRACE_S` for the health checks and outlier ejection to catch up). Reloads, valid
  or not, and the disconnect storm open no window: nothing they do may fail a request;
- the proxy stops answering: a sample's ``/soak/stats`` read takes more than `STATS_TIMEOUT_S`;
- a resource grows without bound: the median of the last quarter of samples is above the median of the
  second quarter by more than 50 % plus a fixed slack (RSS 24 MiB, FDs 24, sockets 24, tasks 64); the first
  quarter is warm-up (pools filling, caches, lazy imports).

The results (every sample, every failure and why, counts per kind) go to OUT.json and a plot of RSS, FDs
and tasks per sample to OUT.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

GRACE_S = 8.0
STATS_TIMEOUT_S = 15.0  # a sample the proxy does not answer within this is a stall (its loop is blocked)
SLACK = {"rss_mib": 24.0, "fds": 24.0, "sockets": 24.0, "tasks": 64.0}
KINDS = ("http_unary", "http_stream", "grpc_unary", "grpc_stream")
GEN_PATH = "/affinity.v1.Generation/Generate"
GEN_STREAM_PATH = "/affinity.v1.Generation/GenerateStream"


# ------------------------------------------------------------------------------------------- proxy child

async def _proxy_child(config_path: str) -> None:
    from aiohttp import web

    from proxy.app import AffinityProxy
    from proxy.config import load_config

    proxy = AffinityProxy(load_config(config_path), config_path=config_path)

    async def stats(request: web.Request) -> web.Response:
        inflight = sum(entry.requests for entry in proxy.inflight.values())
        return web.json_response({"tasks": len(asyncio.all_tasks()), "inflight": inflight})

    proxy.admin_app.router.add_get("/soak/stats", stats)

    async def announce() -> None:
        # The listeners are on port 0 (no race for a "free" port): the parent learns them from this line.
        grpc_port = proxy.grpc.port if proxy.grpc is not None else 0
        print(json.dumps({"http": proxy.http_url, "admin": proxy.admin_url, "grpc": grpc_port}), flush=True)

    proxy.add_task("soak-ports", announce)
    await proxy.serve_until_signal()


# ------------------------------------------------------------------------------------------------ parent

@dataclass
class Result:
    kind: str
    start: float
    end: float
    ok: bool
    error: str = ""


@dataclass
class Fault:
    kind: str
    start: float
    end: float
    target: str = ""
    note: str = ""


@dataclass
class Sample:
    t: float
    rss_mib: float
    fds: int
    sockets: int
    tasks: int
    inflight: int | None


@dataclass
class Soak:
    duration_s: float
    rate: float
    sample_s: float
    fault_every_s: float
    backends: int = 3
    seed: int = 0
    results: list[Result] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    storm_abandoned: int = 0
    access_log_lines: int = 0
    stalls: list[dict[str, Any]] = field(default_factory=list)  # samples the proxy did not answer in time


def _config(fleet: Any, weights: dict[str, float] | None = None) -> str:
    lines = []
    for s in fleet.servers:
        w = (weights or {}).get(s.name, 1.0)
        lines.append(f"  - {{name: {s.name}, url: '{s.url}', grpc: '{s.grpc_address}', weight: {w}}}")
    return (
        "listen: {host: 127.0.0.1, port: 0}\n"
        "grpc_listen: {host: 127.0.0.1, port: 0}\n"
        "admin: {host: 127.0.0.1, port: 0}\n"
        "routing: {policy: affinity}\n"
        "health_checks: {interval_ms: 500, timeout_ms: 500, unhealthy_threshold: 2, healthy_threshold: 2}\n"
        "timeouts: {drain_s: 5}\n"
        "debug_headers: true\n"
        "backends:\n" + "\n".join(lines) + "\n"
    )


def _proc_sample(pid: int) -> tuple[float, int, int]:
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    fds = sockets = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        fds += 1
        with contextlib.suppress(OSError):
            if os.readlink(fd).startswith("socket:"):
                sockets += 1
    return rss_kib / 1024, fds, sockets


class Runner:
    def __init__(self, soak: Soak, workdir: Path, out: Path | None = None) -> None:
        self.soak = soak
        self.out = out  # OUT.json is rewritten after every sample: a run cut short keeps what it measured
        self.workdir = workdir
        self.rng = random.Random(soak.seed)
        self.t0 = 0.0
        self.pending: set[asyncio.Task[None]] = set()
        self._drain: asyncio.Task[None] | None = None
        self.access_lines = 0  # access-log lines the proxy wrote to its standard output

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------------ load
    async def _http_unary(self, s: aiohttp.ClientSession, prompt: str) -> None:
        body = {"model": self.model, "max_tokens": 8, "messages": [{"role": "user", "content": prompt}]}
        async with s.post(self.http + "/v1/chat/completions", json=body) as r:
            data = await r.read()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
            json.loads(data)["choices"][0]

    async def _http_stream(self, s: aiohttp.ClientSession, prompt: str, abandon: bool = False) -> None:
        body = {"model": self.model, "max_tokens": 16, "stream": True,
                "messages": [{"role": "user", "content": prompt}]}
        async with s.post(self.http + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:200]!r}")
            done = False
            async for line in r.content:
                if abandon:
                    return  # the storm: the client goes away after its first event
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif b'"error"' in line:
                    raise RuntimeError(f"error event: {line[:200]!r}")
            if not done:
                raise RuntimeError("stream ended without [DONE]")

    async def _grpc_unary(self, prompt: str) -> None:
        from proxy.protos import generate_pb2 as pb

        call = self.channel.unary_unary(GEN_PATH, request_serializer=pb.GenerateRequest.SerializeToString,
                                        response_deserializer=pb.GenerateResponse.FromString)
        reply = await call(pb.GenerateRequest(model=self.model, prompt=prompt, max_tokens=8), timeout=60)
        if not reply.finished:
            raise RuntimeError("unary reply not finished")

    async def _grpc_stream(self, prompt: str) -> None:
        from proxy.protos import generate_pb2 as pb

        call = self.channel.unary_stream(GEN_STREAM_PATH, request_serializer=pb.GenerateRequest.SerializeToString,
                                         response_deserializer=pb.GenerateResponse.FromString)
        last = None
        async for msg in call(pb.GenerateRequest(model=self.model, prompt=prompt, max_tokens=16), timeout=60):
            last = msg
        if last is None or not last.finished:
            raise RuntimeError("stream ended without its final message")

    async def _one(self, kind: str, s: aiohttp.ClientSession) -> None:
        prompt = f"session {self.rng.randrange(40)} says hello " + "word " * self.rng.randrange(4, 40)
        start = self.now()
        try:
            if kind == "http_unary":
                await asyncio.wait_for(self._http_unary(s, prompt), 60)
            elif kind == "http_stream":
                await asyncio.wait_for(self._http_stream(s, prompt), 60)
            elif kind == "grpc_unary":
                await self._grpc_unary(prompt)
            else:
                await self._grpc_stream(prompt)
            self.soak.results.append(Result(kind, start, self.now(), True))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # recorded and judged against the fault windows
            self.soak.results.append(Result(kind, start, self.now(), False, f"{type(exc).__name__}: {exc}"[:300]))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def load(self, s: aiohttp.ClientSession, until: float) -> None:
        i = 0
        interval = 1.0 / self.soak.rate
        next_at = self.now()
        while self.now() < until:
            self._spawn(self._one(KINDS[i % len(KINDS)], s))
            i += 1
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - self.now()))

    # ---------------------------------------------------------------- faults
    async def _reload(self, s: aiohttp.ClientSession, text: str) -> dict[str, Any]:
        self.config_path.write_text(text)
        async with s.post(self.admin + "/admin/reload") as r:
            return {"status": r.status, "body": (await r.text())[:300]}

    async def fault(self, n: int, s: aiohttp.ClientSession) -> None:
        servers = self.fleet.servers
        target = servers[n % len(servers)]
        kind = ("kill", "stall", "burst_5xx", "reload_valid", "reload_invalid", "disconnect_storm")[n % 6]
        start = self.now()
        note = ""
        if kind == "kill":
            await target.set_faults({"refuse_connections": True})
            await asyncio.sleep(4.0)
            await target.set_faults({"refuse_connections": False})
        elif kind == "stall":
            await target.set_faults({"stall_ms": 2000})
            await asyncio.sleep(2.0)
        elif kind == "burst_5xx":
            await target.set_faults({"fail_rate": 1.0, "fail_status": 503})
            await asyncio.sleep(3.0)
            await target.set_faults({"fail_rate": 0.0})
        elif kind == "reload_valid":
            weights = {x.name: float(self.rng.choice((1, 2, 3))) for x in servers}
            answer = await self._reload(s, _config(self.fleet, weights))
            note = json.dumps(answer)
            if answer["status"] != 200:
                raise RuntimeError(f"a valid reload was refused: {note}")
        elif kind == "reload_invalid":
            good = self.config_path.read_text()
            answer = await self._reload(s, good[: len(good) // 3])  # truncated mid-file
            self.config_path.write_text(good)
            note = json.dumps(answer)
            if answer["status"] == 200:
                raise RuntimeError(f"a truncated config was accepted: {note}")
        else:
            storm = [asyncio.create_task(self._http_stream(s, f"storm {i}", abandon=True)) for i in range(40)]
            done = await asyncio.gather(*storm, return_exceptions=True)
            self.soak.storm_abandoned += sum(1 for d in done if d is None)
        end = self.now()
        # Windows only for faults that may fail requests by design; reloads and the storm get none.
        if kind in ("kill", "stall", "burst_5xx"):
            self.soak.faults.append(Fault(kind, start, end, target.name, note))
        else:
            self.soak.faults.append(Fault(kind, start, start, "", note))

    async def faults(self, s: aiohttp.ClientSession, until: float) -> None:
        n = 0
        while True:
            await asyncio.sleep(self.soak.fault_every_s)
            if self.now() >= until:
                return
            await self.fault(n, s)
            n += 1

    # --------------------------------------------------------------- samples
    async def sampler(self, s: aiohttp.ClientSession, until: float) -> None:
        while True:
            if self.proc.returncode is not None:
                raise RuntimeError(f"the proxy exited ({self.proc.returncode}) during the soak; see "
                                   f"{self.workdir / 'proxy.log'}")
            rss, fds, sockets = _proc_sample(self.proc.pid)
            try:
                async with s.get(self.admin + "/soak/stats", timeout=aiohttp.ClientTimeout(total=STATS_TIMEOUT_S)) as r:
                    stats = await r.json()
            except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                # A proxy that does not answer its admin port is stuck (its event loop blocked): a failed run,
                # said so, rather than a soak that waits for it.
                self.soak.stalls.append({"t": round(self.now(), 1), "error": f"{type(exc).__name__}: {exc}"[:200]})
            else:
                self.soak.samples.append(Sample(round(self.now(), 1), round(rss, 2), fds, sockets, stats["tasks"],
                                                stats.get("inflight")))
            if self.out is not None:
                self.out.with_suffix(".json").write_text(json.dumps(payload(self.soak, verdict(self.soak)), indent=1))
            if self.now() + self.soak.sample_s > until:
                return
            await asyncio.sleep(self.soak.sample_s)

    # ------------------------------------------------------------------ main
    async def _copy_stdout(self, path: Path) -> None:
        assert self.proc.stdout is not None
        with open(path, "wb") as log:
            while chunk := await self.proc.stdout.read(1 << 16):
                log.write(chunk)
                self.access_lines += chunk.count(b"\n")

    async def run(self) -> None:
        import grpc

        from sim.fleet import start_fleet

        self.fleet = await start_fleet(self.soak.backends, grpc_port=0, speed=50.0, seed=self.soak.seed)
        self.model = self.fleet.servers[0].backend.engine.model_name
        self.config_path = self.workdir / "soak.yaml"
        self.config_path.write_text(_config(self.fleet))
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loadtest.soak", "--proxy-child", str(self.config_path),
            stdout=asyncio.subprocess.PIPE, stderr=open(self.workdir / "proxy.log", "wb"),
            cwd=Path(__file__).resolve().parents[1])
        try:
            assert self.proc.stdout is not None
            line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
            if not line:
                raise RuntimeError("the proxy did not come up; see " + str(self.workdir / "proxy.log"))
            ports = json.loads(line)
            self.http, self.admin, grpc_port = ports["http"], ports["admin"], ports["grpc"]
            # The child's standard output carries its access log (a line per request) after the ports: it
            # must be read for the whole run. Left unread, the pipe filled after ~300 requests and the
            # proxy froze in its access-log write (the "hang after the first faults" of issue 18).
            self._drain = asyncio.get_running_loop().create_task(self._copy_stdout(self.workdir / "access.log"))
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as s:
                self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
                self.t0 = time.monotonic()
                until = self.soak.duration_s
                await asyncio.gather(self.load(s, until), self.faults(s, until), self.sampler(s, until))
                if self.pending:
                    await asyncio.wait(self.pending, timeout=90)
                await self.channel.close()
        finally:
            if self.proc.returncode is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(self.proc.wait(), 30)
                except asyncio.TimeoutError:
                    self.proc.kill()
                    await self.proc.wait()
            if self._drain is not None:
                await asyncio.wait([self._drain], timeout=10)
            self.soak.access_log_lines = self.access_lines
            await self.fleet.stop()


# --------------------------------------------------------------------------------------------- verdict

def unexplained(soak: Soak) -> list[Result]:
    windows = [(f.start, f.end + GRACE_S) for f in soak.faults if f.end > f.start]
    return [r for r in soak.results if not r.ok and not any(r.start <= e and r.end >= s for s, e in windows)]


def growth(soak: Soak) -> dict[str, dict[str, float | bool]]:
    out: dict[str, dict[str, float | bool]] = {}
    n = len(soak.samples)
    if n < 8:
        return out
    q = n // 4
    for key, slack in SLACK.items():
        values = [float(getattr(s, key)) for s in soak.samples]
        base = statistics.median(values[q:2 * q])
        last = statistics.median(values[n - q:])
        out[key] = {"baseline": base, "final": last, "max": max(values),
                    "grew": last > base * 1.5 + slack}
    return out


def verdict(soak: Soak) -> dict[str, Any]:
    bad = unexplained(soak)
    grown = growth(soak)
    counts: dict[str, dict[str, int]] = {}
    for r in soak.results:
        c = counts.setdefault(r.kind, {"sent": 0, "failed": 0})
        c["sent"] += 1
        c["failed"] += 0 if r.ok else 1
    reasons: dict[str, int] = {}
    for r in soak.results:
        if not r.ok:
            reasons[r.error.split(":")[0]] = reasons.get(r.error.split(":")[0], 0) + 1
    windows = [f for f in soak.faults if f.end > f.start]

    def fault_of(r: Result) -> str:
        hit = [f"{f.kind}:{f.target}" for f in windows if r.start <= f.end + GRACE_S and r.end >= f.start]
        return ",".join(hit) or "none"

    failures = [{"kind": r.kind, "t": round(r.start, 1), "error": r.error[:160], "fault": fault_of(r)}
                for r in soak.results if not r.ok]
    return {
        "ok": not bad and not soak.stalls and not any(g["grew"] for g in grown.values()) and len(soak.samples) > 0,
        "stalls": soak.stalls[:50],
        "failures": failures[:200],
        "requests": counts,
        "failed_by_reason": reasons,
        "unexplained_failures": [asdict(r) for r in bad[:50]],
        "growth": grown,
        "storm_abandoned": soak.storm_abandoned,
        "access_log_lines": soak.access_log_lines,
    }


def plot(soak: Soak, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t / 60 for s in soak.samples]
    fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    for ax, key, label in zip(axes, ("rss_mib", "fds", "sockets", "tasks"),
                              ("RSS (MiB)", "open FDs", "sockets (connections)", "asyncio tasks")):
        ax.plot(t, [getattr(s, key) for s in soak.samples], marker=".")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        for f in soak.faults:
            ax.axvline(f.start / 60, color="red" if f.end > f.start else "grey", alpha=0.15)
    axes[-1].set_xlabel("minutes (red: kill/stall/5xx, grey: reloads and disconnect storms)")
    fig.suptitle(f"affinity-proxy soak: {soak.duration_s / 60:.0f} min at {soak.rate:g} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


async def run_soak(soak: Soak, workdir: Path, out: Path | None = None) -> dict[str, Any]:
    await Runner(soak, workdir, out).run()
    return verdict(soak)


def payload(soak: Soak, result: dict[str, Any]) -> dict[str, Any]:
    return {"params": {k: getattr(soak, k) for k in ("duration_s", "rate", "sample_s", "fault_every_s", "backends")},
            "verdict": result, "samples": [asdict(s) for s in soak.samples],
            "faults": [asdict(f) for f in soak.faults]}


def markdown(data: dict[str, Any]) -> str:
    """A results section from OUT.json: requests and failures per kind, faults, samples per minute, growth."""
    v, params = data["verdict"], data["params"]
    lines = [f"Run: {params['duration_s'] / 60:.0f} min at {params['rate']:g} req/s, a fault every "
             f"{params['fault_every_s']:g} s, {params['backends']} simulated backends. Verdict: "
             f"**{'pass' if v['ok'] else 'FAIL'}**.", "",
             "| kind | sent | failed |", "|---|---:|---:|"]
    for kind, c in sorted(v["requests"].items()):
        lines.append(f"| {kind} | {c['sent']} | {c['failed']} |")
    lines += ["", f"Failures by reason: {v['failed_by_reason'] or 'none'}; unexplained (outside every fault "
              f"window): {len(v['unexplained_failures'])}; storm streams abandoned: {v['storm_abandoned']}; "
              f"stalls (the proxy's admin port silent for {STATS_TIMEOUT_S:g} s): {len(v.get('stalls', []))}; "
              f"access-log lines read from the proxy's stdout: {v.get('access_log_lines', 'not counted')}.", ""]
    for f in v.get("failures", [])[:20]:
        lines.append(f"- {f['kind']} at {f['t']:.0f} s, during {f['fault']}: {' '.join(f['error'].split())}")
    kinds: dict[str, int] = {}
    for f in data["faults"]:
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    lines += ["", "Faults injected: " + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) + ".", "",
              "| minute | RSS MiB | FDs | sockets (connections) | asyncio tasks | in flight |", "|---:|---:|---:|---:|---:|---:|"]
    for smp in data["samples"]:
        lines.append(f"| {smp['t'] / 60:.1f} | {smp['rss_mib']:.1f} | {smp['fds']} | {smp['sockets']} | "
                     f"{smp['tasks']} | {smp['inflight']} |")
    lines += ["", "| resource | median 2nd quarter | median last quarter | max | grew |", "|---|---:|---:|---:|---|"]
    for key, g in v["growth"].items():
        lines.append(f"| {key} | {g['baseline']:.1f} | {g['final']:.1f} | {g['max']:.1f} | {g['grew']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=3600.0, help="seconds of load (default 3600)")
    p.add_argument("--rate", type=float, default=6.0, help="requests per second, all kinds together")
    p.add_argument("--sample-s", type=float, default=60.0, help="seconds between resource samples")
    p.add_argument("--fault-every-s", type=float, default=60.0, help="seconds between faults")
    p.add_argument("--backends", type=int, default=3)
    p.add_argument("--out", default="loadtest/results/soak", help="OUT.json and OUT.png")
    p.add_argument("--report", metavar="OUT.json", help="print a markdown summary of a run (and replot it)")
    p.add_argument("--proxy-child", metavar="CONFIG", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.report:
        data = json.loads(Path(args.report).read_text())
        replay = Soak(data["params"]["duration_s"], data["params"]["rate"], data["params"]["sample_s"],
                      data["params"]["fault_every_s"])
        replay.samples = [Sample(**smp) for smp in data["samples"]]
        replay.faults = [Fault(**f) for f in data["faults"]]
        plot(replay, Path(args.report).with_suffix(".png"))
        print(markdown(data), end="")
        return 0
    if args.proxy_child:
        import logging

        import uvloop

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        uvloop.run(_proxy_child(args.proxy_child))
        return 0
    soak = Soak(args.duration, args.rate, args.sample_s, args.fault_every_s, backends=args.backends)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="affinity-soak-"))  # the proxy's config file and its log
    print(f"proxy config and log in {workdir}", file=sys.stderr)
    result = asyncio.run(run_soak(soak, workdir, out))
    out.with_suffix(".json").write_text(json.dumps(payload(soak, result), indent=1))
    plot(soak, out.with_suffix(".png"))
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
