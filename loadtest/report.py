"""Turn load runs (live or replayed) into one report: a markdown table, a JSON file and PNG plots.

    python -m loadtest.report run-a.json run-b.json --out loadtest/results/my-report

Every figure is defined in loadtest/stats.py and printed under the table, so a reader can tell what
"±9%" or "6.3 points" means here. The prefix-cache hit ratio is shown next to two bounds computed from the
workload itself: one infinite cache shared by the fleet (the trace's ideal), and one shared LRU cache as
large as the whole fleet's KV memory (the best any router can do with these GPUs).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from statistics import pstdev
from typing import Any, Iterable, Sequence

from loadtest import stats
from loadtest.records import Record, RunResult
from loadtest.workloads import Workload
from loadtest.workloads.bound import one_cache_bound

# A 10 s window needs this many requests for its p99 to count (at a few requests/s the p99 of a window is
# close to its maximum; fewer would make it a single request's latency).
MIN_WINDOW_REQUESTS = 5

DEFINITIONS = """\
Definitions:
- Throughput: successful requests (and output tokens) per second between the first send and the last completion.
- TTFT: send to first streamed token, at the client; e2e: send to end of stream; TPOT: (e2e - TTFT) / (output tokens - 1).
- Hit ratio: prefix-cache hit tokens / query tokens summed over the backends (the engines' own counters, delta over the run).
  Bound ∞: one infinite cache shared by the fleet; bound LRU: one shared LRU cache of the fleet's total KV capacity.
  Both are computed from the requests an engine computed (those that produced a first token). hit/bound = hit ratio / LRU bound (∞ bound when capacity is unknown).
- GPU util: each backend's busy fraction (busy-time counter). std "10 s": cross-backend population std-dev per 10 s
  window, averaged over windows (imbalance that comes and goes counts); std "run": cross-backend std-dev of each
  backend's utilisation over the whole run (lasting imbalance only). Both in percentage points.
- p99 fluct.: coefficient of variation of the p99 TTFT of consecutive 10 s windows (by send time, windows with >= 5
  requests; at a few requests/s a window's p99 is close to its maximum); shown as ±CV. report.json also has the
  half-range ((max - min) / 2 / mean) and the same figure for end-to-end latency.
- Router CPU: CPU time of the router process over the run, as a share of one core and per successful request (it
  includes the router's background work: telemetry scrapes, health checks; at a few requests/s that dominates).
  For an offline replay it is the time spent building summaries and picking.
"""


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1000:.0f}"


def _pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x * 100:.{digits}f}%"


def summarize(result: RunResult, workload: Workload | None = None, *, label: str | None = None) -> dict[str, Any]:
    """Everything the report shows about one run, as plain JSON-able values."""
    recs: list[Record] = result.records
    ok = [r for r in recs if r.status == 200 and r.error is None and r.ttft is not None]
    errors = [r for r in recs if not (r.status == 200 and r.error is None and r.ttft is not None)]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    span = None
    if ok:
        start = min(r.sent for r in recs)
        end = max(r.sent + (r.e2e or 0.0) for r in ok)
        span = end - start if end > start else None
    out_tokens = sum(r.output_tokens for r in ok)
    windows = stats.window_p99s([r.sent for r in ok], ttft, 10.0, MIN_WINDOW_REQUESTS)
    fluct = stats.fluctuation(windows)
    e2e_fluct = stats.fluctuation(stats.window_p99s([r.sent for r in ok if r.e2e is not None], e2e, 10.0, MIN_WINDOW_REQUESTS))

    # Fleet counters: per backend, deltas between its first and last sample.
    by_backend: dict[str, list[dict[str, Any]]] = {}
    for s in result.samples:
        by_backend.setdefault(s["backend"], []).append(s)
    hits = queries = 0.0
    busy_series: dict[str, list[tuple[float, float]]] = {}
    kv_mean: dict[str, float | None] = {}
    waiting_max: dict[str, float | None] = {}
    util_total: dict[str, float | None] = {}
    steps = 0.0
    late_s = 0.0
    late_max: float | None = None
    engine_ttft_s = engine_ttft_n = 0.0
    engine_e2e_s = engine_e2e_n = 0.0
    for name, ss in sorted(by_backend.items()):
        ss.sort(key=lambda s: s["t"])
        f, l = ss[0], ss[-1]
        if l.get("ttft_sum") is not None and l.get("ttft_count") is not None:
            engine_ttft_s += l["ttft_sum"] - (f.get("ttft_sum") or 0.0)
            engine_ttft_n += l["ttft_count"] - (f.get("ttft_count") or 0.0)
        if l.get("e2e_sum") is not None and l.get("e2e_count") is not None:
            engine_e2e_s += l["e2e_sum"] - (f.get("e2e_sum") or 0.0)
            engine_e2e_n += l["e2e_count"] - (f.get("e2e_count") or 0.0)
        if f.get("steps") is not None and l.get("steps") is not None and l.get("late_s") is not None:
            steps += l["steps"] - f["steps"]
            late_s += l["late_s"] - (f.get("late_s") or 0.0)
            late_max = max(late_max or 0.0, l.get("late_max_s") or 0.0)
        if f.get("prefix_hits") is not None and l.get("prefix_hits") is not None:
            hits += l["prefix_hits"] - f["prefix_hits"]
            queries += l["prefix_queries"] - f["prefix_queries"]
        busy = [(s["t"], s["busy_s"]) for s in ss if s.get("busy_s") is not None]
        if busy:
            busy_series[name] = busy
            span_b = busy[-1][0] - busy[0][0]
            util_total[name] = (busy[-1][1] - busy[0][1]) / span_b if span_b > 0 else None
        kvs = [s["kv_usage"] for s in ss if s.get("kv_usage") is not None]
        kv_mean[name] = stats.mean_or_none(kvs)
        ws = [s["waiting"] for s in ss if s.get("waiting") is not None]
        waiting_max[name] = max(ws) if ws else None
    per_window = stats.windowed_utilisation(busy_series, 10.0)
    spread = stats.utilisation_spread(per_window)
    whole = [u for u in util_total.values() if u is not None]

    capacity = sum(result.capacity_tokens.values()) or None
    bound_inf = bound_lru = None
    if workload is not None:
        # The requests an engine computed (it produced their first token), as the measured hit ratio counts
        # them: a prompt every engine refused (longer than the context: 400) is in neither its queries nor
        # any cache, so it must not be in the bound's either (it used to be: its tokens diluted the bound
        # and its blocks evicted ~7% of the fleet-size cache at once on the Mooncake 0:300 window).
        sent = [workload.items[r.index] for r in recs if r.index < len(workload.items) and r.ttft is not None]
        bound_inf = one_cache_bound(sent).ratio
        if capacity:
            bound_lru = one_cache_bound(sent, capacity).ratio
    hit_ratio = hits / queries if queries > 0 else None
    cached = [r for r in ok if r.cached_tokens is not None]
    client_hit = (sum(r.cached_tokens or 0 for r in cached) / sum(r.input_tokens for r in cached)) if cached else None
    share = Counter(r.backend for r in ok if r.backend)
    cpu = result.proxy_cpu_s
    return {
        "label": label or result.meta.get("label") or "",
        "requests": len(recs),
        "ok": len(ok),
        "errors": len(errors),
        "error_kinds": Counter((r.error or f"status {r.status}")[:80] for r in errors).most_common(5),
        "wall_s": result.wall_s,
        "throughput_rps": stats.safe_ratio(len(ok), span),
        "output_tps": stats.safe_ratio(out_tokens, span),
        "ttft_p50": stats.percentile(ttft, 50),
        "ttft_p90": stats.percentile(ttft, 90),
        "ttft_p99": stats.percentile(ttft, 99),
        "ttft_mean": stats.mean_or_none(ttft),
        "e2e_p50": stats.percentile(e2e, 50),
        "e2e_p99": stats.percentile(e2e, 99),
        "tpot_p50": stats.percentile(tpot, 50),
        "tpot_p99": stats.percentile(tpot, 99),
        "p99_windows": windows,
        "p99_fluct_cv": fluct["cv"],
        "p99_fluct_half_range": fluct["half_range"],
        "p99_e2e_fluct_cv": e2e_fluct["cv"],
        "p99_windows_counted": fluct["windows"],
        "hit_ratio": hit_ratio,
        "client_hit_ratio": client_hit,
        "bound_inf": bound_inf,
        "bound_lru": bound_lru,
        "capacity_tokens": capacity,
        "hit_vs_bound": stats.safe_ratio(hit_ratio, bound_lru if bound_lru else bound_inf),
        "gpu_util_mean": spread["mean"],
        "gpu_util_std": spread["std"],
        "gpu_util_whole_run": util_total,
        "gpu_util_std_whole_run": (pstdev(whole) if len(whole) > 1 else None),
        "gpu_util_windows": per_window,
        "kv_usage_mean": kv_mean,
        "waiting_max": waiting_max,
        "backend_share": dict(sorted(share.items())),
        "proxy_cpu_s": cpu,
        "proxy_cpu_us_per_req": (cpu / len(ok) * 1e6) if cpu is not None and ok else None,
        "proxy_cpu_cores": (cpu / result.wall_s) if cpu is not None and result.wall_s else None,
        # A live fleet of simulators only: how far their drivers fell behind the engine model, per step
        # (the machine's CPU; the live latencies carry it, the replay's do not).
        **({"sim_late_mean_ms": 1000 * late_s / steps, "sim_late_max_ms": 1000 * (late_max or 0.0)}
           if steps > 0 else {}),
        # The engines' own TTFT mean (their histograms, every request they answered in the run) and what the
        # client saw on top of it on average: the proxy's routing, tokenisation waits and forwarding.
        **({"engine_ttft_mean": engine_ttft_s / engine_ttft_n,
            "ttft_added_mean_ms": (1000 * (stats.mean_or_none(ttft) - engine_ttft_s / engine_ttft_n)
                                   if ttft and engine_ttft_n == len(ttft) else None)}
           if engine_ttft_n > 0 else {}),
        # The same for the whole answer: client e2e less the engines'. Against the TTFT's, how much later
        # than its first token the path delivered each answer's end (when the proxy frees its slot).
        **({"engine_e2e_mean": engine_e2e_s / engine_e2e_n,
            "e2e_added_mean_ms": (1000 * (stats.mean_or_none(e2e) - engine_e2e_s / engine_e2e_n)
                                  if e2e and engine_e2e_n == len(e2e) else None)}
           if engine_e2e_n > 0 else {}),
        "meta": result.meta,
    }


# The design write-up's table (shared/design, chapter 1), for a mixed 128/2,048-token generation workload:
# p99 latency fluctuation and GPU-utilisation standard deviation per strategy.
DESIGN_TABLE = (
    ("round robin", "round_robin", "±38%", "22.1%"),
    ("least connections", "least_request", "±26%", "18.7%"),
    ("compute-load weighting (the design)", "least_load", "±9%", "6.3%"),
)


def _fmt_pct(x: float | None, sign: bool = False) -> str:
    if x is None:
        return "–"
    return f"{'±' if sign else ''}{x * 100:.0f}%"


def design_comparison(summaries: Sequence[dict[str, Any]]) -> str:
    by = {s["label"].replace("replay ", ""): s for s in summaries}
    rows = [
        "| strategy | design: p99 fluct. | design: GPU util std | ours: policy | ours: p99 TTFT fluct. (CV / half-range) | ours: p99 e2e fluct. (CV) | ours: GPU util std, pts (10 s / run) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, policy, fl, std in DESIGN_TABLE + (("prefix affinity + bounded load (this proxy)", "affinity", "–", "–"),):
        s = by.get(policy)
        ours_fl = "not run" if s is None else f"{_fmt_pct(s['p99_fluct_cv'], True)} / {_fmt_pct(s['p99_fluct_half_range'], True)}"
        ours_std = "not run" if s is None or s["gpu_util_std"] is None else f"{s['gpu_util_std'] * 100:.1f}"
        if s is not None and s.get("gpu_util_std_whole_run") is not None:
            ours_std += f" / {s['gpu_util_std_whole_run'] * 100:.1f}"
        ours_e2e = "not run" if s is None else _fmt_pct(s.get("p99_e2e_fluct_cv"), True)
        rows.append(f"| {name} | {fl} | {std} | {policy} | {ours_fl} | {ours_e2e} | {ours_std} |")
    return "\n".join(rows) + "\n"


def markdown_table(summaries: Sequence[dict[str, Any]]) -> str:
    head = (
        "| policy | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | e2e p99 ms | hit ratio | bound ∞ / LRU | hit/bound "
        "| GPU util mean | GPU util std, pts (10 s / run) | p99 fluct. | errors | router CPU: % core, µs/req |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for s in summaries:
        bound = f"{_pct(s['bound_inf'], 0)} / {_pct(s['bound_lru'], 0)}"
        std = "–" if s["gpu_util_std"] is None else f"{s['gpu_util_std'] * 100:.1f}"
        if s.get("gpu_util_std_whole_run") is not None:
            std += f" / {s['gpu_util_std_whole_run'] * 100:.1f}"
        cpu = "–" if s["proxy_cpu_us_per_req"] is None else (
            f"{(s['proxy_cpu_cores'] or 0) * 100:.1f}%, {s['proxy_cpu_us_per_req']:.0f}"
        )
        fl = "–" if s["p99_fluct_cv"] is None else f"±{s['p99_fluct_cv'] * 100:.0f}%"
        rows.append(
            f"| {s['label']} | {s['throughput_rps'] or 0:.2f} | {s['output_tps'] or 0:.0f} | {_ms(s['ttft_p50'])} | "
            f"{_ms(s['ttft_p99'])} | {_ms(s['e2e_p99'])} | {_pct(s['hit_ratio'])} | {bound} | "
            f"{_pct(s['hit_vs_bound'], 0)} | {_pct(s['gpu_util_mean'], 0)} | {std} | {fl} | {s['errors']} | {cpu} |"
        )
    return head + "\n".join(rows) + "\n"


def plot(summaries: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [s["label"] for s in summaries]
    x = range(len(labels))
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    ax = axes[0][0]
    ax.bar([i - 0.2 for i in x], [(s["ttft_p50"] or 0) * 1000 for s in summaries], 0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [(s["ttft_p99"] or 0) * 1000 for s in summaries], 0.4, label="p99")
    ax.set_title("TTFT (ms)")
    ax.legend()
    ax = axes[0][1]
    ax.bar(list(x), [(s["hit_ratio"] or 0) * 100 for s in summaries], 0.6, label="measured")
    for key, style, name in (("bound_lru", "--", "one LRU cache of fleet size"), ("bound_inf", ":", "one infinite cache")):
        vals = [s[key] for s in summaries if s[key] is not None]
        if vals:
            ax.axhline(max(vals) * 100, linestyle=style, color="k", label=name)
    ax.set_title("prefix-cache hit ratio (%)")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    ax.bar(list(x), [(s["gpu_util_std"] or 0) * 100 for s in summaries], 0.6)
    ax.set_title("GPU utilisation std-dev across backends (points)")
    ax = axes[1][1]
    for s in summaries:
        ws = s["p99_windows"]
        ax.plot([10 * i for i in range(len(ws))], [w * 1000 for w in ws], marker=".", label=s["label"])
    ax.set_title("p99 TTFT per 10 s window (ms)")
    ax.set_xlabel("s")
    ax.legend(fontsize=8)
    for a in (axes[0][0], axes[0][1], axes[1][0]):
        a.set_xticks(list(x))
        a.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    fig.tight_layout()
    main = out / "report.png"
    fig.savefig(main, dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(len(summaries), 1, figsize=(10, 2.2 * len(summaries)), squeeze=False)
    for a, s in zip(axes[:, 0], summaries):
        for name, ws in sorted(s["gpu_util_windows"].items()):
            a.plot([10 * i for i in range(len(ws))], [None if w is None else w * 100 for w in ws], label=name)
        a.set_ylim(0, 105)
        a.set_ylabel("busy %")
        a.set_title(s["label"], fontsize=9)
    axes[0][0].legend(fontsize=7, ncol=4)
    fig.tight_layout()
    util = out / "gpu_util.png"
    fig.savefig(util, dpi=80)
    plt.close(fig)
    return [main, util]


def write_report(
    summaries: Sequence[dict[str, Any]],
    out: str | Path,
    *,
    title: str,
    workload: Workload | None = None,
    preface: str = "",
    appendix: str = "",
) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pngs = plot(summaries, out)
    md = [f"# {title}", ""]
    if preface:
        md += [preface, ""]
    if workload is not None:
        w = workload.summary()
        md.append(
            f"Workload: `{w['name']}` ({w['source']}), {w['requests']} requests over {w['duration_s']:.0f} s of trace time, "
            f"mean input {w['input_tokens_mean']:.0f} tokens (p50 {w['input_tokens_p50']}), mean output {w['output_tokens_mean']:.0f}."
        )
        md.append("")
    md.append(markdown_table(summaries))
    md.append(DEFINITIONS)
    for s in summaries:
        if s["errors"]:
            md.append(f"- {s['label']} errors: {s['error_kinds']}")
    md.append("")
    md += [f"![{p.stem}]({p.name})" for p in pngs]
    if appendix:
        md += ["", appendix]
    path = out / "report.md"
    path.write_text("\n".join(md) + "\n")
    slim = [{k: v for k, v in s.items()} for s in summaries]
    (out / "report.json").write_text(json.dumps({"title": title, "summaries": slim}, indent=1, default=str))
    return path


def main(argv: Iterable[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.report", description="report from saved runs")
    ap.add_argument("runs", nargs="+", type=Path, help="run JSON files written by loadtest.run --out")
    ap.add_argument("--workload", help="the workload spec the runs used (for the one-cache bounds)")
    ap.add_argument("--window")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(list(argv) if argv is not None else None)
    workload = None
    if args.workload:
        from loadtest.workloads import load_workload, parse_window

        workload = load_workload(args.workload)
        start, end = parse_window(args.window)
        if start is not None or end is not None or args.limit:
            workload = workload.window(start, end, args.limit)
    summaries = [summarize(RunResult.load(p), workload) for p in args.runs]
    path = write_report(summaries, args.out, title="load test report", workload=workload)
    print(path)


if __name__ == "__main__":
    main()
