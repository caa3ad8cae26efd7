"""Where the HTTP/1.1 data plane's CPU goes on real sockets, system calls included: py-spy on a served proxy.

`bench_h1path.py` times the proxy's own Python work without sockets, and `profile_h2.py` runs cProfile in
process; neither shows what the kernel's side of the four loopback system calls of a proxied request costs
(read the client, write the backend, read the backend, write the client), which is the same work for every
proxy in the side-by-side benchmark. This runs the real thing as `bench_peers.py` does (two fake backends of
the peers harness and wrk on core 1, `affinity-proxy run --workers 1` alone on core 0), measures its CPU per
request from /proc, then samples it with `py-spy record --native` under the same load and prints the
shares: the system calls (leaf frames `write`, `read`, `epoll_pwait` of libc), then the Python functions and
native frames by own samples, and the inclusive share of the proxy's main steps.

    ~/.cache/peers/venv/bin/python loadtest/profile_sockets.py --ap-bin .venv/bin/affinity-proxy --policy round_robin
    ... --access-log off        # the same without the access log

py-spy must be on PATH or next to `--ap-bin` (`.venv/bin/pip install py-spy`); it needs ptrace (root, as here).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run as a script: the tree's loadtest package
from loadtest.bench_peers import load_harness, write_ap_config  # noqa: E402  # after the path

PEERS = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "peers"))
STEPS = ("HttpConnection.data_received", "OpenAIPipeline.summarise", "Lease.enter", "OpenAIPipeline._exchange",
         "UpstreamPool._start", "_Connection.data_received", "HttpConnection._write_answer", "Lease.finish",
         "RequestObservation.answered", "RequestObservation.finish_as_recorded", "create_task")


def _wrk_cmd(port: int, secs: float) -> list[str]:
    """wrk -c64 on core 1 with the peers' small-POST script, as bench_peers.py's CPU row runs it."""
    return ["taskset", "-c", "1", "wrk", "-t2", "-c64", f"-d{max(1, round(secs))}s", "-s",
            os.path.join(PEERS, "post_completions.lua"), f"http://127.0.0.1:{port}/"]


def is_step(frame: str, step: str) -> bool:
    """`frame` (py-spy's function name) is `step` ("Class.method"), interpreted or compiled by mypyc
    (proxy/native): a compiled method is the C function CPyDef_<module>___<Class>___<method>, a compiled
    coroutine's body CPyDef_<module>___<method>_<Class>_gen..."""
    if frame == step:
        return True
    if not frame.startswith("CPyDef_") or "." not in step:
        return False
    cls, _, method = step.partition(".")
    return frame.endswith(f"___{cls}___{method}") or f"___{method}_{cls}_gen" in frame


def _shares(raw: str, top: int) -> None:
    total = 0
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    for line in open(raw):
        stack, _, n = line.rstrip().rpartition(" ")
        count = int(n)
        total += count
        frames = [re.sub(r":\d+\)", ")", f) for f in stack.split(";")]
        own[frames[-1]] += count
        for name in set(frames):
            incl[name] += count
    if not total:
        raise SystemExit("py-spy took no samples")
    sys_calls = {k: v for k, v in own.items() if k.split(" ")[0] in ("write", "read", "epoll_pwait") and "libc" in k}
    print(f"\n{total} samples; system calls (kernel time included) {100 * sum(sys_calls.values()) / total:.1f}%:")
    for name, n in sorted(sys_calls.items(), key=lambda kv: -kv[1]):
        print(f"  {100 * n / total:5.1f}%  {name}")
    print("\nthe proxy's steps (inclusive, system calls inside them included):")
    for step in STEPS:
        n = sum(v for k, v in incl.items() if is_step(k.split(" ")[0], step))
        print(f"  {100 * n / total:5.1f}%  {step}")
    print(f"\nown samples, top {top}:")
    for name, n in own.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {name[:120]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ap-bin", default=os.path.join(HERE, "..", ".venv", "bin", "affinity-proxy"))
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--access-log", choices=("on", "off"), default="on")
    ap.add_argument("--port-base", type=int, default=23800)
    ap.add_argument("--secs", type=float, default=5.0, help="the measured wrk run (CPU per request)")
    ap.add_argument("--profile-secs", type=float, default=8.0)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    py_spy = shutil.which("py-spy") or os.path.join(os.path.dirname(a.ap_bin), "py-spy")
    if not os.path.exists(py_spy):
        raise SystemExit("py-spy not found: .venv/bin/pip install py-spy")
    b = load_harness(PEERS)
    work = tempfile.mkdtemp(prefix="profile-sockets-")
    base = a.port_base
    config = write_ap_config(os.path.join(work, "proxy.yaml"), base + 10, base + 11,
                             [f"http://127.0.0.1:{base + 1}", f"http://127.0.0.1:{base + 2}"], a.policy,
                             tail="logging: {access_log: {enabled: false}}\n" if a.access_log == "off" else "")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for port in (base + 1, base + 2):
            procs.append(subprocess.Popen(
                ["taskset", "-c", "1", sys.executable, os.path.join(PEERS, "fake_backend.py"), "--port", str(port),
                 "--chunks", "200"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(2)
        with open(os.path.join(work, "proxy.log"), "wb") as log:  # the access log goes here (a regular file)
            proxy = subprocess.Popen(["taskset", "-c", "0", a.ap_bin, "run", "--config", config, "--workers", "1"],
                                     stdout=log, stderr=subprocess.STDOUT)
        procs.append(proxy)
        time.sleep(3)
        print(f"warm-up, then {a.secs:g} s of wrk -c64 ...", file=sys.stderr)
        subprocess.run(_wrk_cmd(base + 10, 2), capture_output=True, check=True)
        t0 = b.cpu_ticks(b.tree(proxy.pid))
        n = int(b.parse_result(subprocess.run(_wrk_cmd(base + 10, a.secs), capture_output=True, text=True,
                                              check=True).stdout)["requests"])
        t1 = b.cpu_ticks(b.tree(proxy.pid))
        hz = b.HZ
        print(f"{a.policy}, access log {a.access_log}: {n} requests, proxy CPU "
              f"{(t1 - t0) / hz * 1e6 / n:.1f} µs per request ({100 * (t1 - t0) / hz / a.secs:.0f}% of its core)")
        print(f"py-spy for {a.profile_secs:g} s under the same load ...", file=sys.stderr)
        raw = os.path.join(work, "py-spy.txt")
        load = subprocess.Popen(_wrk_cmd(base + 10, a.profile_secs + 3), stdout=subprocess.DEVNULL)
        time.sleep(1)
        subprocess.run([py_spy, "record", "--native", "-r", "200", "-d", f"{a.profile_secs:g}", "-f", "raw",
                        "-o", raw, "-p", str(proxy.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=True)
        load.wait()
        _shares(raw, a.top)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
