"""Side by side with the Rust LLM routers and nginx: the five rows of issue 19, in one run, with ratios.

The harness is /work/shared/peers/bench.py (process start/stop by PID, /proc CPU accounting, wrk and the
aiohttp SSE client as load, fake OpenAI backends); this script reuses it unchanged (imported from
`--peers-dir`, read-only) and only changes what a shared machine needs:

- every port is moved by `--port-base` (default 28000 instead of 18000), so that this run does not collide
  with another engineer's run of the shared harness on the same machine; the nginx config and the
  affinity-proxy configs are rewritten for those ports into the run folder;
- the "quiet gate" of the harness (wait until foreign CPU < 25 %) is off by default (`--other-max`): on a
  machine shared by several engineers it would wait 45 s before every point; numbers are noisy, so read the
  ratios WITHIN one run and repeat a comparison before believing it;
- `--ap-bin` picks the affinity-proxy under test, `--label` names it in the output (e.g. before/after).

Each proxy is pinned alone on core 0 (`taskset`), backends and load on core 1; `run --workers 1`.

The five rows (per proxy core): CPU µs per small POST (wrk -c64, scenario a), added p50 and p99 at one
connection (wrk -c1, scenario c, minus direct in the same repetition), CPU µs per SSE event (256 paced
streams, scenario d), extra time to the first SSE event (4 streams, scenario t, TTFB minus direct's).

    ~/.cache/peers/venv/bin/python loadtest/bench_peers.py --reps 3 --duration 4 --ap-bin .venv/bin/affinity-proxy

It prints progress on stderr and the table (markdown) on stdout; the raw JSON goes to `--results`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

COLUMNS = ["nginx", "vllm-rr", "sglang-rr", "sglang-cache", "vllm-cache", "ap-rr-base", "ap-aff-base", "ap-rr", "ap-aff"]
DEFAULT_TARGETS = "direct,nginx,vllm-rr,sglang-rr,sglang-cache,ap-rr,ap-aff"


def load_harness(peers_dir: str):  # type: ignore[no-untyped-def]  # the harness module is untyped
    spec = importlib.util.spec_from_file_location("peers_bench", os.path.join(peers_dir, "bench.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def configure(b, base: int, ap_bin: str, run_dir: str, other_max: float,  # type: ignore[no-untyped-def]
              baseline: str | None = None) -> None:
    """Move every port of the harness by `base - 18000` and write the configs that name ports."""
    shift = base - 18000
    b.BACKENDS = [18001 + shift, 18002 + shift]
    b.W = ["http://127.0.0.1:%d" % p for p in b.BACKENDS]
    b.OTHER_MAX = other_max
    b.AP = ap_bin
    os.makedirs(run_dir + "/nginx/logs", exist_ok=True)
    with open(os.path.join(b.HERE, "nginx.conf")) as f:
        conf = f.read()
    for old in (18100, 18001, 18002):
        conf = conf.replace("127.0.0.1:%d" % old, "127.0.0.1:%d" % (old + shift))
    nginx_conf = os.path.join(run_dir, "nginx.conf")
    with open(nginx_conf, "w") as f:
        f.write(conf)
    aps = {}
    for name, policy, port in (("ap-rr", "round_robin", 18108), ("ap-aff", "affinity", 18109)):
        path = os.path.join(run_dir, name + ".yaml")
        with open(path, "w") as f:
            f.write(
                f"listen: {{host: 127.0.0.1, port: {port + shift}}}\n"
                f"admin: {{host: 127.0.0.1, port: {port + 100 + shift}}}\n"
                f"backends:\n  - {{name: be0, url: 'http://127.0.0.1:{b.BACKENDS[0]}'}}\n"
                f"  - {{name: be1, url: 'http://127.0.0.1:{b.BACKENDS[1]}'}}\n"
                f"routing: {{policy: {policy}}}\n"
            )
        aps[name] = (port + shift, [ap_bin, "run", "--config", path, "--workers", "1"], "absdtc")
        # The same config on other ports, run from another source tree (python -P: the current folder, this
        # tree, must not come before PYTHONPATH on sys.path).
        if baseline is not None:
            base_path = os.path.join(run_dir, name + "-base.yaml")
            with open(path) as f:
                text = f.read()
            with open(base_path, "w") as f:
                f.write(text.replace(str(port + shift), str(port + 10 + shift))
                        .replace(str(port + 100 + shift), str(port + 110 + shift)))
            aps[name + "-base"] = (port + 10 + shift, [
                "env", f"PYTHONPATH={baseline}", os.path.join(os.path.dirname(ap_bin), "python"), "-P", "-m", "proxy",
                "run", "--config", base_path,
                "--workers", "1"], "absdtc")
    t = b.TARGETS
    t["direct"] = (b.BACKENDS[0], None, "absdtc")
    t["nginx"] = (18100 + shift, ["nginx", "-p", run_dir + "/nginx", "-c", nginx_conf], "absdtc")
    t["sglang-rr"] = (18102 + shift, b.sglang(18102 + shift, "round_robin"), "absdtc")
    t["sglang-cache"] = (18103 + shift, b.sglang(18103 + shift, "cache_aware"), "absdtc")
    t["vllm-rr"] = (18104 + shift, b.vllm(18104 + shift, "round_robin"), "absdtc")
    t["vllm-cache"] = (18105 + shift, b.vllm(18105 + shift, "cache_aware"), "absdtc")
    t.update(aps)
    for gone in ("haproxy", "aiohttp-mini", "sglang-rr-info"):
        t.pop(gone, None)


def five_rows(raw: dict) -> dict[str, dict[str, float | None]]:
    """Per target: the issue's five numbers (medians over repetitions; 'added' paired within a repetition)."""
    res = raw["results"]
    out: dict[str, dict[str, float | None]] = {}

    def med(xs: list[float]) -> float | None:
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    def per_unit(s: str, n: str, key: str) -> float | None:
        return med([(r["cpu"]["proxy"] / 100.0) / r[key] * 1e6 for r in res.get(s, {}).get(n, [])
                    if r.get("cpu", {}).get("proxy") is not None and r.get(key)])

    def added(s: str, n: str, key: str, scale: float) -> float | None:
        direct = {r["rep"]: r for r in res.get(s, {}).get("direct", [])}
        return med([(r[key] - direct[r["rep"]][key]) * scale for r in res.get(s, {}).get(n, [])
                    if r["rep"] in direct and r.get(key) is not None])

    for n in raw["targets"]:
        if n == "direct":
            continue
        out[n] = {
            "cpu_req": per_unit("a", n, "rps"),
            "p50": added("c", n, "p50_us", 1.0),
            "p99": added("c", n, "p99_us", 1.0),
            "cpu_event": per_unit("d", n, "events_per_s"),
            "ttfe": added("t", n, "ttfb_p50_ms", 1.0),
        }
    return out


def table(rows: dict[str, dict[str, float | None]], label: str) -> str:
    names = [n for n in COLUMNS if n in rows]
    head = ["per proxy core"] + [n if not n.startswith("ap-") else f"**{n}**" if n.endswith("-base") else
                                 f"**{n}** ({label})" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    spec = [("CPU µs per small POST, 64 connections", "cpu_req", "%.1f"),
            ("added p50 at 1 connection (µs)", "p50", "%.0f"),
            ("added p99 at 1 connection (µs)", "p99", "%.0f"),
            ("CPU µs per SSE event (256 paced streams)", "cpu_event", "%.1f"),
            ("extra time to first SSE event, 4 streams (ms)", "ttfe", "%+.2f")]
    for title, key, fmt in spec:
        cells = [("-" if rows[n][key] is None else fmt % rows[n][key]) for n in names]
        lines.append("| " + " | ".join([title] + cells) + " |")
    return "\n".join(lines)


def ratios(rows: dict[str, dict[str, float | None]]) -> str:
    """The issue's checks: ours against the peer each target names."""
    def r(a: str, b: str, key: str) -> str:
        x, y = rows.get(a, {}).get(key), rows.get(b, {}).get(key)
        if x is None or y is None or y <= 0:
            return "-"
        return "%.2f×" % (x / y)

    checks = [
        ("CPU/request: ap-rr vs vllm-rr (target ≤ 1)", r("ap-rr", "vllm-rr", "cpu_req")),
        ("CPU/request: ap-aff vs sglang-cache (target ≤ 1)", r("ap-aff", "sglang-cache", "cpu_req")),
        ("CPU/request: ap-rr vs nginx", r("ap-rr", "nginx", "cpu_req")),
        ("added p50: ap-rr vs vllm-rr (target ≤ 1)", r("ap-rr", "vllm-rr", "p50")),
        ("added p50: ap-aff vs vllm-rr (target ≤ 1)", r("ap-aff", "vllm-rr", "p50")),
        ("added p99: ap-rr vs vllm-rr (target ≤ 1.2)", r("ap-rr", "vllm-rr", "p99")),
        ("added p99: ap-aff vs vllm-rr (target ≤ 1.2)", r("ap-aff", "vllm-rr", "p99")),
        ("CPU/event: ap-rr vs sglang-rr (target ≤ 1)", r("ap-rr", "sglang-rr", "cpu_event")),
        ("CPU/event: ap-aff vs sglang-rr (target ≤ 1)", r("ap-aff", "sglang-rr", "cpu_event")),
    ]
    if "ap-rr-base" in rows:
        checks += [
            ("CPU/request: ap-rr vs ap-rr-base (this tree vs the baseline)", r("ap-rr", "ap-rr-base", "cpu_req")),
            ("CPU/request: ap-aff vs ap-aff-base", r("ap-aff", "ap-aff-base", "cpu_req")),
            ("added p50: ap-rr vs ap-rr-base", r("ap-rr", "ap-rr-base", "p50")),
            ("added p50: ap-aff vs ap-aff-base", r("ap-aff", "ap-aff-base", "p50")),
            ("CPU/event: ap-rr vs ap-rr-base", r("ap-rr", "ap-rr-base", "cpu_event")),
        ]
    lines = ["| check | ratio |", "|---|---|"] + [f"| {a} | {b} |" for a, b in checks]
    for n in ("ap-rr", "ap-aff"):
        v = rows.get(n, {}).get("ttfe")
        lines.append(f"| extra time to first SSE event, {n} (target ≤ +0.5 ms) | "
                     f"{'-' if v is None else '%+.2f ms' % v} |")
    return "\n".join(lines)


def ab_cpu(peers_dir: str, baseline: str, ap_bin: str, policy: str, reps: int, conns: int, base_port: int) -> None:
    """This tree against `baseline`, the two proxies up side by side, wrk runs of 3 s alternating between
    them (ABBA order); CPU µs per request of each proxy's process tree (/proc) and wrk's p50, medians.
    Both share every disturbance of a busy machine, so their ratio is steadier than the full run's."""
    import signal
    import subprocess

    hz = os.sysconf("SC_CLK_TCK")
    py = os.path.join(os.path.dirname(os.path.abspath(ap_bin)), "python")
    fake_py = os.path.join(os.environ.get("PEERS_VENV", os.path.expanduser("~/.cache/peers/venv")), "bin", "python")
    lua = os.path.join(peers_dir, "post_completions.lua")
    run_dir = os.path.join(os.environ.get("PEERS_RUN", os.path.expanduser("~/.cache/peers")), f"ab-{base_port}")
    os.makedirs(run_dir, exist_ok=True)
    tok = os.path.join(run_dir, "fake-tokenizer")
    b = load_harness(peers_dir)
    b.TOKDIR = tok
    b.ensure_tokenizer()
    procs: list[subprocess.Popen[bytes]] = []
    logf = open(os.path.join(run_dir, "ab.log"), "a")

    def start(cmd: list[str], cpus: str, env: dict[str, str] | None = None) -> int:
        p = subprocess.Popen(["taskset", "-c", cpus, *cmd], stdout=logf, stderr=logf, env=env, start_new_session=True)
        procs.append(p)
        return p.pid

    trees = {"base": os.path.abspath(baseline), "this": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    backends = [base_port + 1, base_port + 2]
    ports = {"base": base_port + 11, "this": base_port + 12}
    try:
        for port in backends:
            start([fake_py, os.path.join(peers_dir, "fake_backend.py"), "--port", str(port), "--chunks", "200",
                   "--model-path", tok], "1")
        pids = {}
        for name, tree in trees.items():
            cfg = os.path.join(run_dir, f"{name}.yaml")
            with open(cfg, "w") as f:
                f.write(f"listen: {{host: 127.0.0.1, port: {ports[name]}}}\n"
                        f"admin: {{host: 127.0.0.1, port: {ports[name] + 100}}}\nbackends:\n"
                        + "".join(f"  - {{name: be{i}, url: 'http://127.0.0.1:{p}'}}\n" for i, p in enumerate(backends))
                        + f"routing: {{policy: {policy}}}\n")
            pids[name] = start([py, "-P", "-m", "proxy", "run", "--config", cfg, "--workers", "1"], "0",
                               dict(os.environ, PYTHONPATH=tree))
        time.sleep(6)

        def wrk(port: int, secs: int) -> dict[str, float]:
            out = subprocess.run(["taskset", "-c", "1", "wrk", "-t1" if conns == 1 else "-t2", f"-c{conns}",
                                  f"-d{secs}s", "--latency", "-s", lua, f"http://127.0.0.1:{port}"],
                                 capture_output=True, text=True).stdout
            return b.parse_result(out)  # type: ignore[no-any-return]  # the harness is untyped

        for name in trees:
            wrk(ports[name], 2)  # warm-up
        res: dict[str, list[tuple[float, float]]] = {n: [] for n in trees}
        for rep in range(reps):
            for name in (list(trees) if rep % 2 == 0 else list(trees)[::-1]):
                t0 = b.cpu_ticks(b.tree(pids[name]))
                r = wrk(ports[name], 3)
                t1 = b.cpu_ticks(b.tree(pids[name]))
                res[name].append(((t1 - t0) / hz / r["requests"] * 1e6, r["p50_us"]))
                b.log(f"ab {policy} c{conns} rep{rep} {name}: {res[name][-1][0]:.1f} µs CPU/req, p50 {r['p50_us']:.0f} µs")
        med = {n: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for n, v in res.items()}
        print(f"| {policy}, wrk -c{conns}, {reps}× 3 s alternating | baseline | this tree | ratio |\n|---|---|---|---|")
        print(f"| CPU µs per request | {med['base'][0]:.1f} | {med['this'][0]:.1f} | {med['this'][0] / med['base'][0]:.2f}× |")
        print(f"| p50 µs (wrk) | {med['base'][1]:.0f} | {med['this'][1]:.0f} | {med['this'][1] / med['base'][1]:.2f}× |")
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait(timeout=15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers-dir", default=os.environ.get("PEERS_DIR", "/work/shared/peers"))
    ap.add_argument("--port-base", type=int, default=28000)
    ap.add_argument("--ap-bin", default=".venv/bin/affinity-proxy")
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--baseline", help="a source tree (e.g. `git archive main proxy | tar -x -C DIR`) run "
                    "beside this one as ap-rr-base / ap-aff-base, with --ap-bin's Python")
    ap.add_argument("--targets", default=DEFAULT_TARGETS)
    ap.add_argument("--scenarios", default="a,c,d,t")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--duration", type=int, default=4)
    ap.add_argument("--other-max", type=float, default=1000.0,
                    help="the harness's quiet gate: %% of one core of foreign CPU tolerated (1000 = off)")
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--render", help="print the tables of a raw JSON file written by an earlier run")
    ap.add_argument("--ab", metavar="POLICY", help="only the A/B CPU comparison of this tree and --baseline")
    ap.add_argument("--ab-conns", type=int, default=64)
    ap.add_argument("--ab-reps", type=int, default=6)
    a = ap.parse_args()
    if a.ab:
        if not a.baseline:
            raise SystemExit("--ab needs --baseline")
        ab_cpu(a.peers_dir, a.baseline, a.ap_bin, a.ab, a.ab_reps, a.ab_conns, a.port_base + 600)
        return
    if a.render:
        with open(a.render) as f:
            raw = json.load(f)
        rows = five_rows(raw)
        print(table(rows, a.label) + "\n\n" + ratios(rows))
        return
    run_dir = os.path.join(os.environ.get("PEERS_RUN", os.path.expanduser("~/.cache/peers")), f"run-{a.port_base}")
    os.makedirs(run_dir, exist_ok=True)
    b = load_harness(a.peers_dir)
    configure(b, a.port_base, os.path.abspath(a.ap_bin), run_dir, a.other_max,
              os.path.abspath(a.baseline) if a.baseline else None)
    targets = a.targets
    if a.baseline and "ap-rr-base" not in targets:
        targets += ",ap-rr-base,ap-aff-base"
    b.RESULTS = a.results
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = os.path.join(a.results, f"peers-raw-{stamp}.json")
    # The harness's main() does the run (start, warm up, interleave, stop by PID) and writes raw-<stamp>.json.
    sys.argv = ["bench.py", "--scenarios", a.scenarios, "--reps", str(a.reps), "--duration", str(a.duration),
                "--targets", targets]
    before = set(os.listdir(a.results)) if os.path.isdir(a.results) else set()
    b.main()
    new = sorted(f for f in os.listdir(a.results) if f not in before and f.startswith("raw-") and f.endswith(".json"))
    if not new:
        raise SystemExit("the harness wrote no raw results")
    os.replace(os.path.join(a.results, new[-1]), out)
    for f in os.listdir(a.results):  # the harness's own markdown summary: the tables below replace it
        if f not in before and f.startswith("summary-"):
            os.remove(os.path.join(a.results, f))
    with open(out) as f:
        raw = json.load(f)
    rows = five_rows(raw)
    print(f"raw: {out}\n")
    print(table(rows, a.label) + "\n\n" + ratios(rows))


if __name__ == "__main__":
    main()
