"""Scale-out replays behind loadtest/results/scaleout.md (issue 13): run from the repository root with

    .venv/bin/python loadtest/results/scaleout.py run core      # the rows behind the targets (what was run)
    .venv/bin/python loadtest/results/scaleout.py run views     # item 4: the load view of R replicas
    .venv/bin/python loadtest/results/scaleout.py run matrix    # R = 1, 2, 4 x W = 1, 2, learned vs precise
    .venv/bin/python loadtest/results/scaleout.py table         # markdown tables + scaleout.png
    .venv/bin/python loadtest/results/scaleout.py losses --load 0:300x1   # where R = 1 loses the bound, per request

Each row is one `python -m loadtest.replay` configuration (the flags are printed next to it); results are
appended to loadtest/results/scaleout.jsonl as they finish, so an interrupted run resumes where it stopped.
The replay runs in virtual time: the numbers do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from loadtest.replay import ReplayConfig, parse_affinity_sets, replay, scaleout_label, shm_host_asked  # noqa: E402
from loadtest.report import summarize  # noqa: E402
from loadtest.workloads import load_workload  # noqa: E402
from loadtest.workloads.model import Workload  # noqa: E402

OUT = ROOT / "loadtest" / "results" / "scaleout.jsonl"
TRACES = Path("/work/shared/traces") if Path("/work/shared/traces").is_dir() else ROOT.parent / "shared" / "traces"
MOONCAKE = TRACES / "mooncake_synthetic_trace.jsonl"
AZURE = TRACES / "azure_llm_2023_code.csv"

# (name, trace, window in trace seconds, speed, busy label). Speeds chosen so round robin's GPU busy share
# is ~75% / ~95% on Mooncake; the Azure code trace is bursty: see scaleout.md.
LOADS = [
    ("mooncake", MOONCAKE, (0.0, 300.0), 0.6, "~80% busy"),
    ("mooncake", MOONCAKE, (0.0, 300.0), 1.0, "~96% busy"),
    ("mooncake", MOONCAKE, (900.0, 1200.0), 0.6, "~80% busy, multi-turn"),
    ("mooncake", MOONCAKE, (900.0, 1200.0), 1.0, "~96% busy, multi-turn"),
    ("azure-code", AZURE, (0.0, 900.0), 4.0, "speed 4"),
    ("azure-code", AZURE, (0.0, 900.0), 6.5, "speed 6.5"),
]


def _workload(trace: Path, window: tuple[float, float]) -> Workload:
    return load_workload(str(trace)).window(window[0], window[1], None)  # as --window does


def flags(cfg: ReplayConfig) -> str:
    out = [f"--policies {cfg.policy}"]
    if cfg.replicas != 1:
        out.append(f"--replicas {cfg.replicas}")
    if cfg.workers != 1:
        out.append(f"--workers {cfg.workers}")
        if not cfg.shared_worker_load:
            out.append("--no-shared-worker-load")
        elif shm_host_asked(cfg):
            out.append("--host-table")
    if cfg.index != "learned":
        out.append(f"--index {cfg.index} --kv-event-delay-ms {cfg.kv_event_delay_ms:g}")
        if cfg.precise_lookup != "proxy":
            out.append(f"--precise-lookup {cfg.precise_lookup}")
    if cfg.load_view != "own":
        out.append(f"--load-view {cfg.load_view}")
    if cfg.load_view == "peers":
        out.append(f"--peer-refresh-ms {cfg.peer_refresh_ms:g}")
        if not cfg.peer_recent:
            out.append("--no-peer-recent")
    if cfg.seed:
        out.append(f"--seed {cfg.seed}")
    if cfg.arrival_jitter_ms:
        out.append(f"--arrival-jitter-ms {cfg.arrival_jitter_ms:g}")
    for k, v in cfg.affinity_overrides:
        out.append(f"--affinity-set {k}={v:g}")
    return " ".join(out)


def _one_and_replicas(seed: int, jitter: float, over: tuple) -> list[ReplayConfig]:
    """The pair every perturbed suite compares: one process, and R = 4 replicas of W = 2 workers with the
    shared ledger at 10 ms, both with the precise index, under the same seeded jitter and settings."""
    return [ReplayConfig(policy="affinity", index="precise", seed=seed, arrival_jitter_ms=jitter,
                         affinity_overrides=over),
            ReplayConfig(policy="affinity", replicas=4, workers=2, index="precise", load_view="peers",
                         peer_refresh_ms=10.0, seed=seed, arrival_jitter_ms=jitter, affinity_overrides=over)]


def suite(name: str) -> list[ReplayConfig]:
    cfgs: list[ReplayConfig] = []
    if name == "core":
        # The rows behind the targets, most telling first (the machine this ran on was shared: the full
        # views and matrix suites did not fit): one process, 4 replicas on their own (engines' counts) and
        # with the shared ledger, the upper bound, each with the proxy's precise lookup and with inline.
        cfgs.append(ReplayConfig(policy="round_robin"))
        # (lookup proxy: a long first sighting waits for its tokenisation; proxy-nowait: the proxy before
        # that, routing it by the learned index: round 2's "proxy" rows, renamed.)
        cfgs.append(ReplayConfig(policy="affinity", index="precise"))
        cfgs.append(ReplayConfig(policy="affinity", index="precise", precise_lookup="inline"))
        cfgs.append(ReplayConfig(policy="affinity", index="precise", precise_lookup="proxy-nowait"))
        cfgs.append(ReplayConfig(policy="affinity", index="precise", precise_lookup="proxy-prefix"))
        for lookup in ("proxy", "proxy-nowait", "proxy-prefix", "inline"):
            cfgs.append(ReplayConfig(policy="affinity", replicas=4, index="precise", load_view="engines",
                                     precise_lookup=lookup))
            cfgs.append(ReplayConfig(policy="affinity", replicas=4, index="precise", load_view="peers",
                                     precise_lookup=lookup))
        cfgs.append(ReplayConfig(policy="affinity", workers=4, index="precise", precise_lookup="inline"))
        cfgs.append(ReplayConfig(policy="affinity", workers=4, index="precise"))
        cfgs.append(ReplayConfig(policy="affinity"))
        cfgs.append(ReplayConfig(policy="affinity", replicas=4))
        cfgs.append(ReplayConfig(policy="affinity", replicas=4, load_view="peers"))
        cfgs.append(ReplayConfig(policy="affinity", replicas=2, index="precise", load_view="engines"))
        cfgs.append(ReplayConfig(policy="affinity", replicas=2, index="precise", load_view="peers"))
        cfgs.append(ReplayConfig(policy="affinity", workers=2, index="precise"))
        cfgs.append(ReplayConfig(policy="affinity", replicas=4, index="precise"))
    elif name == "round4":
        # Round 4 (the ledger across replicas): the shared ledger with the fleet estimate from the replicas'
        # entries at the new default refresh (20 ms) and at round 3's 50 ms, next to round 3's sums at 20 ms,
        # each for three random replica assignments (seeds; R = 1 does not depend on it), at R = 4 and 2,
        # with W = 2; and the learned index with the shared ledger.
        for seed in (0, 1, 2):
            for every in (20.0, 50.0):
                cfgs.append(ReplayConfig(policy="affinity", replicas=4, index="precise", load_view="peers",
                                         peer_refresh_ms=every, seed=seed))
            cfgs.append(ReplayConfig(policy="affinity", replicas=4, index="precise", load_view="peers",
                                     peer_recent=False, peer_refresh_ms=20.0, seed=seed))
        cfgs.append(ReplayConfig(policy="affinity", replicas=2, index="precise", load_view="peers"))
        cfgs.append(ReplayConfig(policy="affinity", replicas=2, workers=2, index="precise", load_view="peers"))
        cfgs.append(ReplayConfig(policy="affinity", replicas=4, workers=2, index="precise", load_view="peers"))
        cfgs.append(ReplayConfig(policy="affinity", replicas=4, load_view="peers"))
    elif name == "round4b":
        # Round 4b (a --workers 2 host's ledger entries): R = 2 and 4 hosts of W = 2 workers with the shared
        # ledger at 20 ms, each worker publishing its own part with its entries, three seeds. (The rows
        # before, round 4's --workers host, and the design tried first are in scaleout.jsonl with notes.)
        for seed in (0, 1, 2):
            for r in (4, 2):
                cfgs.append(ReplayConfig(policy="affinity", replicas=r, workers=2, index="precise",
                                         load_view="peers", seed=seed))
    elif name == "round5":
        # Round 5 (a --workers host's mates read from its shared block, counts and entries of one moment;
        # the other hosts' rows from Redis; the default refresh 20 -> 10 ms): every shared-ledger
        # configuration of the targets again at 10 ms, three seeds, R = 4 x W = 2 first. (The same code at
        # 20 ms: `round5-20`.)
        for r, w in ((4, 2), (2, 2), (4, 1), (2, 1)):
            for seed in (0, 1, 2):
                cfgs.append(ReplayConfig(policy="affinity", replicas=r, workers=w, index="precise",
                                         load_view="peers", peer_refresh_ms=10.0, seed=seed))
    elif name == "round5-seeds":  # two more replica assignments for R = 4 x W = 2, at 10 and at 20 ms
        for seed in (3, 4):
            for every in (10.0, 20.0):
                cfgs.append(ReplayConfig(policy="affinity", replicas=4, workers=2, index="precise",
                                         load_view="peers", peer_refresh_ms=every, seed=seed))
    elif name == "round5-20":  # round 5's shared block for the mates alone, at round 4's 20 ms refresh
        cfgs = suite("round4b")
    elif name == "round5-placement":
        # Round 5 (R = 1 hit ratio): eviction-aware placement of new prompts (routing.affinity.
        # eviction_band_tokens, proxy/core/placement.py) at the band of the cost check's new-prompt slack
        # (2048) and twice that, at R = 1 and at R = 4 with the shared ledger (seed 0); the rows without it
        # are round 4's. The R = 4 rows ran at round 4's 20 ms refresh.
        for band in (2048, 4096):
            over = (("eviction_band_tokens", float(band)),)
            cfgs.append(ReplayConfig(policy="affinity", index="precise", affinity_overrides=over))
            for seed in (0, 1, 2) if band == 2048 else (0,):  # R = 4: three replica assignments at 2048
                cfgs.append(ReplayConfig(policy="affinity", replicas=4, index="precise", load_view="peers",
                                         affinity_overrides=over, seed=seed, peer_refresh_ms=20.0))
    elif name == "round8-nps":
        # Round 8 (R = 1 hit ratio again): new prompts placed on the cheapest backend by any margin
        # (routing.affinity.new_prompt_slack_tokens 2048 -> 0), at R = 1 and at every shared-ledger
        # configuration of round 5 (10 ms), R = 4 x W = 2 on three seeds; the rows without it are round 5's.
        over = (("new_prompt_slack_tokens", 0),)
        cfgs.append(ReplayConfig(policy="affinity", index="precise", affinity_overrides=over))
        for r, w in ((4, 2), (2, 2), (4, 1), (2, 1)):
            for seed in (0, 1, 2) if (r, w) == (4, 2) else (0,):
                cfgs.append(ReplayConfig(policy="affinity", replicas=r, workers=w, index="precise",
                                         load_view="peers", peer_refresh_ms=10.0, seed=seed,
                                         affinity_overrides=over))
    elif name in ("round10-chaos", "round10-jitter20"):
        # Round 10 (how much of a difference is the configuration): every arrival moved by a seeded
        # uniform [0, 1 ms) (the traces' timestamps are whole ms; round10-jitter20: [0, 20 ms), which
        # moves one process's trajectory too), eight seeds, for one process and for R = 4 x W = 2 with
        # the shared ledger at 10 ms, at the new-prompt slack of 2048 (the default) and 0.
        jitter = 1.0 if name == "round10-chaos" else 20.0
        for seed in range(8):
            for slack in (2048, 0):
                over = () if slack == 2048 else (("new_prompt_slack_tokens", 0),)
                cfgs += _one_and_replicas(seed, jitter, over)
    elif name == "round10-shapes":
        # Round 10: the other shapes of the targets under the same 1 ms jitter, eight seeds: R = 4 and
        # R = 2 single-worker replicas, and one host of --workers 2, with the shared ledger at 10 ms.
        for seed in range(8):
            for r, w in ((4, 1), (2, 1), (1, 2)):
                cfgs.append(ReplayConfig(policy="affinity", replicas=r, workers=w, index="precise",
                                         load_view="peers", peer_refresh_ms=10.0, seed=seed, arrival_jitter_ms=1.0))
    elif name in ("round11-eviction", "round11-eviction20"):
        # Round 11: round 5's eviction-aware placement of new prompts (routing.affinity.eviction_band_tokens,
        # proxy/core/placement.py; off by default) judged again, now over round 10's eight perturbed seeds
        # (1 ms; round11-eviction20: 20 ms) instead of round 5's one trajectory, at R = 1 and R = 4 x W = 2
        # (shared ledger, 10 ms); the rows without it are round 10's.
        jitter = 1.0 if name == "round11-eviction" else 20.0
        for seed in range(8):
            for band in (4096, 2048):
                cfgs += _one_and_replicas(seed, jitter, (("eviction_band_tokens", float(band)),))
    elif name == "round11-repeats":
        # Round 11: the knobs that only decide whether a repeat leaves the backend holding its prefix (the
        # cost check's factor and slack for an affine backend; new prompts are unaffected), one process,
        # eight seeds at 1 ms: do repeats that stay with their holder buy back round 10's load-driven moves?
        for seed in range(8):
            for over in ((("cost_epsilon", 1.0),), (("cost_slack_tokens", 32768.0),), (("cost_epsilon", 2.0),),
                         (("cost_epsilon", 0.5),)):
                cfgs.append(ReplayConfig(policy="affinity", index="precise", seed=seed, arrival_jitter_ms=1.0,
                                         affinity_overrides=over))
    elif name in ("round11-eps", "round11-eps20"):
        # Round 11: cost_epsilon 1 (round11-repeats' best: repeats leave their holder only for a backend
        # at most half as costly) over round 10's perturbations: eight seeds at 1 ms (round11-eps20:
        # 20 ms), one process and R = 4 x W = 2 with the shared ledger at 10 ms.
        jitter = 1.0 if name == "round11-eps" else 20.0
        over = (("cost_epsilon", 1.0),)
        for seed in range(8):
            cfgs += _one_and_replicas(seed, jitter, over)
    elif name in ("round11-eps-learned", "round11-eps-learned20"):
        # Round 11: the same change without KV events (the learned index, what a fleet without
        # --kv-events-config runs), one process, eight seeds at 1 ms (round11-eps-learned20: 20 ms), next
        # to the default.
        jitter = 1.0 if name == "round11-eps-learned" else 20.0
        for seed in range(8):
            for over in ((), (("cost_epsilon", 1.0),)):
                cfgs.append(ReplayConfig(policy="affinity", seed=seed, arrival_jitter_ms=jitter,
                                         affinity_overrides=over))
    elif name.startswith("round13-weight"):
        # Round 13: the work ledger's queued prefill as the backlog bound the engines' KV events allow,
        # plus routing.affinity.running_weight x what the newest-k sum counts above it (work_ledger
        # "Progress"; 1, the sum alone, is the rows before), over round 10's perturbations: eight seeds at
        # 1 ms and 20 ms, one process and R = 4 x W = 2 with the shared ledger at 10 ms. round13-weight-W:
        # at weight W; round13-weight-W-shapes: round10-shapes' other shapes at 1 ms (a --workers host
        # alone reads the shared table's bound, the path where each worker publishes its progress).
        parts = name.split("-")
        over = (("running_weight", float(parts[2])),)
        for seed in range(8):
            if parts[-1] == "shapes":
                for r, w in ((4, 1), (2, 1), (1, 2)):
                    cfgs.append(ReplayConfig(policy="affinity", replicas=r, workers=w, index="precise",
                                             load_view="peers", peer_refresh_ms=10.0, seed=seed,
                                             arrival_jitter_ms=1.0, affinity_overrides=over))
                continue
            for jitter in (1.0, 20.0):
                cfgs += _one_and_replicas(seed, jitter, over)
    elif name.startswith(ROUND14_SUITES):
        # Round 14: the settings after the colon (k=v,k=v; running_weight 0.5, the default, unless named).
        # round14-R1: a screen, one process, eight seeds at 20 ms and 1 ms (one process at 1 ms is one
        # trajectory: seed 0 alone); round14-pair: round 10's pair (one process and R = 4 x W = 2, shared
        # ledger at 10 ms), eight seeds at 1 and 20 ms; round14-shapes: round10-shapes' other shapes at 1 ms.
        named = parse_affinity_sets(name.partition(":")[2].split(","))
        sets = tuple({"running_weight": 0.5, **named}.items())
        kind = name.partition(":")[0]
        for seed in range(8):
            if kind == "round14-shapes":
                for r, w in ((4, 1), (2, 1), (1, 2)):
                    cfgs.append(ReplayConfig(policy="affinity", replicas=r, workers=w, index="precise",
                                             load_view="peers", peer_refresh_ms=10.0, seed=seed,
                                             arrival_jitter_ms=1.0, affinity_overrides=sets))
            elif kind == "round14-pair":
                for jitter in (1.0, 20.0):
                    cfgs += _one_and_replicas(seed, jitter, sets)
            else:
                for jitter in (1.0, 20.0) if seed == 0 else (20.0,):
                    cfgs.append(ReplayConfig(policy="affinity", index="precise", seed=seed, arrival_jitter_ms=jitter,
                                             affinity_overrides=sets))
    elif name == "round15-host":
        # Round 15: --workers hosts without routing.peer_load, as the Deployment runs them (each worker its
        # own row of the shared-memory table, `host_table`), next to one process: with the engines' KV
        # events (one host of 2 workers, and 2 replicas of one each: the Deployment) and without (the
        # learned index), the defaults, eight seeds at 1 ms. The same suite on round 14's host read is
        # recorded with the note "@ round 14 host read" (`round15`).
        for seed in range(8):
            for index, shapes in (("precise", ((1, 1), (1, 2), (2, 2))), ("learned", ((1, 1), (1, 2)))):
                for r, w in shapes:
                    cfgs.append(ReplayConfig(policy="affinity", replicas=r, workers=w, index=index, seed=seed,
                                             arrival_jitter_ms=1.0, host_table=w > 1,
                                             affinity_overrides=ROUND15_SETS[index]))
    elif name == "prefix":  # the rows of `core` with the matcher's defer_prefix on
        cfgs = [c for c in suite("core") if c.precise_lookup == "proxy-prefix"]
    elif name == "views":
        # Item 4: what a replica reads as a backend's load, at R = 4, next to one process and to 4 processes
        # sharing one load view at once (the upper bound of any estimate); item 2: the precise lookup.
        cfgs.append(ReplayConfig(policy="affinity", index="precise"))
        cfgs.append(ReplayConfig(policy="affinity", index="precise", precise_lookup="inline"))
        cfgs.append(ReplayConfig(policy="affinity", workers=4, index="precise"))
        for view in ("own", "engines"):
            cfgs.append(ReplayConfig(policy="affinity", replicas=4, index="precise", load_view=view))
        for every in (10.0, 50.0, 200.0):
            cfgs.append(ReplayConfig(policy="affinity", replicas=4, index="precise", load_view="peers",
                                     peer_refresh_ms=every))
        cfgs.append(ReplayConfig(policy="affinity", replicas=4, index="precise", load_view="peers",
                                 precise_lookup="inline"))
        cfgs.append(ReplayConfig(policy="affinity", replicas=4, index="precise", load_view="engines",
                                 precise_lookup="inline"))
        cfgs.append(ReplayConfig(policy="affinity", replicas=4, load_view="peers"))
    elif name == "matrix":
        cfgs.append(ReplayConfig(policy="round_robin"))
        for index in ("learned", "precise"):
            for r in (1, 2, 4):
                for w in (1, 2):
                    # What a replica can do on its own: routing.shared_backends with KV events and R > 1.
                    view = "engines" if index == "precise" and r > 1 else "own"
                    cfgs.append(ReplayConfig(policy="affinity", replicas=r, workers=w, index=index, load_view=view))
                    if r > 1:  # with the optional shared ledger (load_view peers, every 50 ms)
                        cfgs.append(ReplayConfig(policy="affinity", replicas=r, workers=w, index=index,
                                                 load_view="peers"))
    else:
        raise SystemExit(f"unknown suite {name!r}")
    return cfgs


def key_of(load: tuple, cfg: ReplayConfig) -> str:
    name, _trace, window, speed, _busy = load
    return f"{name} {window[0]:g}:{window[1]:g} x{speed:g} | {flags(cfg)}"


def run(suite_name: str, only: str | None, load_filter: str | None = None, seed: int | None = None) -> None:
    done = set()
    if OUT.exists():
        done = {json.loads(line)["key"] for line in OUT.read_text().splitlines() if line.strip()}
    workloads: dict[tuple, Workload] = {}
    for load in LOADS:
        if only and only not in load[0]:
            continue
        if load_filter and load_filter != f"{load[2][0]:g}:{load[2][1]:g}x{load[3]:g}":
            continue
        for base in suite(suite_name):
            key = key_of(load, base)
            if key in done or (seed is not None and base.seed != seed):
                continue
            name, trace, window, speed, busy = load
            wl = workloads.get((trace, window))
            if wl is None:
                wl = workloads[(trace, window)] = _workload(trace, window)
            cfg = ReplayConfig(**{**base.__dict__, "speed": speed, "max_model_len": 131072})
            t0 = time.perf_counter()
            result = asyncio.run(replay(wl, cfg))
            s = summarize(result, wl, label=f"{cfg.policy}{scaleout_label(cfg)}")
            row = {"key": key, "load": name, "window": list(window), "speed": speed, "busy": busy, "flags": flags(cfg),
                   "reasons": result.meta["reasons"], "replay_s": time.perf_counter() - t0,
                   **{k: v for k, v in s.items() if isinstance(v, (int, float, str)) or v is None}}
            with OUT.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(f"{key}: hit {100 * (s['hit_ratio'] or 0):.2f}% ({100 * (s['hit_vs_bound'] or 0):.0f}% of LRU) "
                  f"TTFT mean {1000 * s['ttft_mean']:.0f} p90 {1000 * s['ttft_p90']:.0f} p99 {1000 * s['ttft_p99']:.0f} ms "
                  f"util {100 * s['gpu_util_mean']:.0f}% [{row['replay_s']:.0f} s]", flush=True)


def _rows() -> list[dict]:
    return [json.loads(line) for line in OUT.read_text().splitlines() if line.strip()]


def parse_flags(flags: str) -> dict:
    """The configuration a row's flags name (defaults filled in)."""
    words = flags.partition("@")[0].split()  # the note after "@" is words, not flags
    out = {"policy": words[1], "replicas": 1, "workers": 1, "index": "learned", "load_view": "own",
           "delay": 50.0, "shared": True, "every": 0.0, "lookup": "proxy", "recent": True, "seed": 0,
           "note": flags.partition("@")[2].strip()}
    for i, w in enumerate(words):
        if w == "--replicas":
            out["replicas"] = int(words[i + 1])
        elif w == "--workers":
            out["workers"] = int(words[i + 1])
        elif w == "--index":
            out["index"] = words[i + 1]
        elif w == "--load-view":
            out["load_view"] = words[i + 1]
        elif w == "--kv-event-delay-ms":
            out["delay"] = float(words[i + 1])
        elif w == "--no-shared-worker-load":
            out["shared"] = False
        elif w == "--peer-refresh-ms":
            out["every"] = float(words[i + 1])
        elif w == "--precise-lookup":
            out["lookup"] = words[i + 1]
        elif w == "--no-peer-recent":
            out["recent"] = False

        elif w == "--seed":
            out["seed"] = int(words[i + 1])
        elif w == "--arrival-jitter-ms":
            out["jitter"] = float(words[i + 1])
        elif w == "--affinity-set":
            out["affinity_set"] = (out.get("affinity_set", "") + " " + words[i + 1]).strip()
    if out["replicas"] == 1 and out["shared"] and out["load_view"] == "scaled":
        out["load_view"] = "own"  # one load view: routing.replicas = 1, the single-process policy
    return out


def _loads(rows: list[dict]) -> list[tuple]:
    loads: list[tuple] = []
    for r in rows:
        lk = (r["load"], tuple(r["window"]), r["speed"], r["busy"])
        if lk not in loads:
            loads.append(lk)
    return loads


def _window_bound(rows: list[dict], name: str, window: Sequence[float]) -> float | None:
    """One bound per trace window, the corrected one (round 5, loadtest/report.py: only the requests an
    engine computed; the prompts every engine refuses are the same whatever the routing): rows written
    before the fix stored a lower bound, so every row's share is computed against the highest."""
    return max((r["bound_lru"] for r in rows if (r["load"], tuple(r["window"])) == (name, tuple(window))
                and r.get("bound_lru")), default=None)


def _perturbed(rows: list[dict]) -> dict[tuple, dict[tuple, dict[int, dict]]]:
    """The perturbed rows (`--arrival-jitter-ms`, suites round10-* and round11-*) by load, then by configuration
    (R, W, load view, refresh, affinity settings, jitter), then by seed."""
    out: dict[tuple, dict[tuple, dict[int, dict]]] = {}
    for r in rows:
        f = parse_flags(r["flags"])
        if not f.get("jitter"):
            continue
        lk = (r["load"], tuple(r["window"]), r["speed"], r["busy"])
        settings = f.get("affinity_set", "")
        if f["index"] != "precise":  # the learned index (round11-eps-learned): its own group, its own R = 1
            settings = f"{f['index']} index" + (f", {settings}" if settings else "")

        conf = (f["replicas"], f["workers"], f["load_view"], f["every"], settings, f["jitter"])
        out.setdefault(lk, {}).setdefault(conf, {})[f["seed"]] = r
    return out


def _cells(r: dict, bound: float | None = None) -> str:
    of_bound = (r["hit_ratio"] or 0) / bound if bound else (r["hit_vs_bound"] or 0)
    return (f"{100 * (r['hit_ratio'] or 0):.2f}% ({100 * of_bound:.0f}%) | {1000 * r['ttft_mean']:,.0f} | "
            f"{1000 * r['ttft_p90']:,.0f} | {1000 * r['ttft_p99']:,.0f} | {100 * r['gpu_util_mean']:.0f}%")


def table() -> None:
    rows = _rows()
    for lk in _loads(rows):
        name, window, speed, busy = lk
        sel, seen = [], set()
        for r in rows:
            f = parse_flags(r["flags"])
            if f.get("jitter"):
                continue  # perturbed rows: `spread`
            ident = tuple(sorted(f.items()))
            if (r["load"], tuple(r["window"]), r["speed"], r["busy"]) == lk and ident not in seen:
                seen.add(ident)  # the same configuration reached by two suites
                sel.append((f, r))
        bound = _window_bound(rows, name, window)
        print(f"\n### {name} {window[0]:g}:{window[1]:g}, speed {speed:g} ({busy}"
              + (f"; fleet-size LRU bound {100 * bound:.2f}%" if bound else "") + ")\n")
        print("| router | index | R | W | load view | hit ratio (of LRU bound) | TTFT mean ms | p90 | p99 | GPU busy |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        order = sorted(sel, key=lambda fr: (fr[0]["policy"] != "round_robin", fr[0]["index"], fr[0]["load_view"] != "own",
                                            fr[0]["load_view"], fr[0]["note"], fr[0]["replicas"], fr[0]["workers"],
                                            not fr[0]["shared"], fr[0]["delay"], not fr[0]["recent"], fr[0]["every"],
                                            fr[0]["lookup"], fr[0]["seed"]))
        for f, r in order:
            view = {"engines": "engines (routing.shared_backends)",
                    "peers": f"shared ledger, every {f['every']:g} ms"
                             + ("" if f["recent"] else " (sums only: round 3)")}.get(f["load_view"], f["load_view"])
            if f["seed"]:
                view += f", seed {f['seed']}"
            if f["note"]:
                view += f" ({f['note']})"
            if f.get("affinity_set"):
                view += f", {f['affinity_set']}"
            extra = []
            if f["workers"] > 1:
                extra.append("shared load" if f["shared"] else "separate load")
            if f["index"] == "precise" and f["delay"] != 50.0:
                extra.append(f"events {f['delay']:g} ms late")
            if f["index"] == "precise" and f["lookup"] != "proxy":
                extra.append(f"{f['lookup']} lookup")
            w = f"{f['workers']}" + (f" ({', '.join(extra)})" if extra else "")
            print(f"| {f['policy']} | {f['index'] if f['policy'] == 'affinity' else '-'} | {f['replicas']} | {w} | "
                  f"{view if f['policy'] == 'affinity' else '-'} | {_cells(r, bound)} |")


def spread() -> None:
    """The perturbed rows (`--arrival-jitter-ms`, suites round10-* and round11-*): per load and configuration, the
    spread over seeds, and each seed of a scale-out shape (R > 1 or W > 1) against one process of the
    same seed (the same arrivals)."""
    rows = _rows()
    for lk, groups in _perturbed(rows).items():
        name, window, speed, busy = lk
        bound = _window_bound(rows, name, window)
        print(f"\n### {name} {window[0]:g}:{window[1]:g}, speed {speed:g} ({busy}"
              + (f"; fleet-size LRU bound {100 * bound:.2f}%" if bound else "") + ")\n")
        print("| jitter | R x W | settings | seeds | hit of the LRU bound: mean (min-max) | TTFT mean ms: mean (min-max) "
              "| vs R = 1, means: hit / TTFT | vs R = 1, same seed: hit (worst) | TTFT mean (worst) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for conf in sorted(groups, key=lambda c: (c[5], c[4], c[0], c[1])):
            by_seed = groups[conf]
            hits = [100 * (r["hit_ratio"] or 0) / bound if bound else 0.0 for r in by_seed.values()]
            ttft = [1000 * r["ttft_mean"] for r in by_seed.values()]
            one = groups.get((1, 1, "own", 0.0, conf[4], conf[5]), {})
            means = " "
            if (conf[0], conf[1]) != (1, 1) and one:
                h1 = sum(r["hit_ratio"] or 0 for r in one.values()) / len(one)
                t1 = sum(r["ttft_mean"] for r in one.values()) / len(one)
                hn = sum(r["hit_ratio"] or 0 for r in by_seed.values()) / len(by_seed)
                tn = sum(r["ttft_mean"] for r in by_seed.values()) / len(by_seed)
                means = f"{100 * (hn / h1 - 1):+.1f}% / {100 * (tn / t1 - 1):+.1f}%" if h1 and t1 else " "
                dh = [100 * ((by_seed[s]["hit_ratio"] or 0) / (one[s]["hit_ratio"] or 1) - 1) for s in by_seed if s in one]
                dt = [100 * (by_seed[s]["ttft_mean"] / one[s]["ttft_mean"] - 1) for s in by_seed if s in one]
                vs = (f"{sum(dh) / len(dh):+.1f}% ({min(dh):+.1f}%) | "
                      f"{sum(dt) / len(dt):+.1f}% ({max(dt):+.1f}%)")
            else:
                vs = " | "
            settings = conf[4] or "defaults"
            rw = f"{conf[0]} x {conf[1]}" + (f", shared ledger {conf[3]:g} ms" if conf[2] == "peers" else "")
            print(f"| {conf[5]:g} ms | {rw} | {settings} | {len(by_seed)} | {sum(hits) / len(hits):.1f}% ({min(hits):.1f}-{max(hits):.1f}) "
                  f"| {sum(ttft) / len(ttft):,.0f} ({min(ttft):,.0f}-{max(ttft):,.0f}) | {means} | {vs} |")


def _mooncake_groups(rows: list[dict]) -> Iterator[tuple[tuple, dict[tuple, dict[int, dict]], float]]:
    """The perturbed rows of each Mooncake load (`_perturbed`), with its window's LRU bound."""
    for lk, groups in _perturbed(rows).items():
        name, window, _speed, _busy = lk
        bound = _window_bound(rows, name, window)
        if name == "mooncake" and bound:
            yield lk, groups, bound


ROUND13_SETTINGS = ("", "running_weight=0.25", "running_weight=0.5", "running_weight=0.75")
# Round 14: running_weight 0.5 (round 13's default) with uncached_weight 3 (the default then) and 2.
ROUND14_SETTINGS = ("running_weight=0.5", "running_weight=0.5 uncached_weight=2")


def progress_table(settings_list: Sequence[str] = ROUND13_SETTINGS, base: str = "",
                   base_label: str = "running_weight=1 (before round 13)", vs_label: str = "vs weight 1") -> None:
    """Round 13 (and 14): per Mooncake load and jitter, one process and R = 4 x W = 2 (and the -shapes
    suites' R = 4 and 2 single-worker replicas and one --workers 2 host) at each of `settings_list`: hit
    of the LRU bound and TTFT mean over seeds, each against the row of the `base` settings of the same
    seed and shape (the same arrivals), and each other shape against R = 1 of the same settings. Round
    13: each running_weight against the rows recorded before it (weight 1, the default then); round 14:
    uncached_weight 2 against 3 at running_weight 0.5."""
    rows = _rows()
    print(f"| load | jitter | R x W | settings | seeds | hit of the bound: mean (min-max) | TTFT mean ms: mean (min-max) "
          f"| {vs_label}, same seeds: hit pts / TTFT | vs R = 1, means: hit / TTFT |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (_name, window, speed, _busy), groups, bound in _mooncake_groups(rows):
        for jitter in (1.0, 20.0):
            for settings in settings_list:
                for shape in ((1, 1, "own", 0.0), (4, 2, "peers", 10.0), (4, 1, "peers", 10.0), (2, 1, "peers", 10.0),
                              (1, 2, "peers", 10.0)):  # (the last three: the -shapes suites)
                    by_seed = groups.get((*shape, settings, jitter))
                    if not by_seed:
                        continue
                    base_rows = groups.get((*shape, base, jitter), {})
                    seeds = sorted(by_seed)
                    hits = [100 * (by_seed[k]["hit_ratio"] or 0) / bound for k in seeds]
                    ttft = [1000 * by_seed[k]["ttft_mean"] for k in seeds]
                    both = [k for k in seeds if k in base_rows]
                    vs = " "
                    if settings != base and both:
                        dh = sum(100 * ((by_seed[k]["hit_ratio"] or 0) - (base_rows[k]["hit_ratio"] or 0)) / bound
                                 for k in both)
                        t_on = sum(by_seed[k]["ttft_mean"] for k in both)
                        t_off = sum(base_rows[k]["ttft_mean"] for k in both)
                        vs = f"{dh / len(both):+.1f} / {100 * (t_on / t_off - 1):+.1f}% ({len(both)})"
                    one = groups.get((1, 1, "own", 0.0, settings, jitter), {})
                    vs1 = " "
                    if shape[:2] != (1, 1) and one:
                        common = [k for k in seeds if k in one]
                        if common:
                            h = sum(by_seed[k]["hit_ratio"] or 0 for k in common) / sum(one[k]["hit_ratio"] or 0 for k in common)
                            t = sum(by_seed[k]["ttft_mean"] for k in common) / sum(one[k]["ttft_mean"] for k in common)
                            vs1 = f"{100 * (h - 1):+.1f}% / {100 * (t - 1):+.1f}%"
                    print(f"| {window[0]:g}:{window[1]:g} x{speed:g} | {jitter:g} ms | {shape[0]} x {shape[1]} | "
                          f"{settings or base_label} | {len(seeds)} | {statistics.mean(hits):.1f}% "
                          f"({min(hits):.1f}-{max(hits):.1f}) | {statistics.mean(ttft):,.0f} ({min(ttft):,.0f}-{max(ttft):,.0f}) "
                          f"| {vs} | {vs1} |")


ROUND15_NOTE = " @ round 14 host read"
# Round 15's settings, the defaults named (rows without settings are of older defaults): with KV events
# (round 14's rows of one process are these), and without (uncached_weight resolves to 3 there).
ROUND15_SETS = {"precise": (("running_weight", 0.5), ("uncached_weight", 2.0)),
                "learned": (("running_weight", 0.5), ("uncached_weight", 3.0))}


def import_rows(other: Path, suite_name: str, note: str) -> None:
    """Append the --workers host rows of `suite_name` that another checkout recorded (its scaleout.jsonl;
    e.g. the suite run on older code) to this one's, each key and its flags with `note` (" @ words":
    parse_flags keeps it apart), unless already there."""
    keys = {key_of(ld, c) for ld in LOADS for c in suite(suite_name)}
    have = {r["key"] for r in _rows()} if OUT.exists() else set()
    added = 0
    with OUT.open("a") as fh:
        for line in other.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if row["key"] in keys and row["key"] + note not in have and "--host-table" in row["key"]:
                row["key"] += note
                row["flags"] += note
                fh.write(json.dumps(row) + "\n")
                added += 1
    print(f"{added} rows of {suite_name} from {other}{note}")


PEERS15 = ROOT / "loadtest" / "results" / "scaleout-round15-peers.jsonl"


def round15_peers(loads: Sequence[str], shapes: Sequence[tuple[int, int]], seeds: Sequence[int],
                  jitter: float = 1.0, table: bool = True, check: bool = False) -> int:
    """Round 15 with peer load: the round14-pair/-shapes configurations (precise, `peer_refresh_ms` 10,
    `running_weight` 0.5, `uncached_weight` 2, `jitter` ms) on this code, each next to its row recorded in
    scaleout.jsonl (round 14's order of a host's entries); appended to scaleout-round15-peers.jsonl (a
    run resumes), then the table. With `check`, each is replayed again and compared with its row there
    (TTFT mean and hit ratio, exactly: code that must not change a decision), nothing written; returns
    how many differ or are missing."""
    rows = {r["key"]: r for r in _rows()}
    recorded = ({json.loads(x)["key"]: json.loads(x) for x in PEERS15.read_text().splitlines() if x.strip()}
                if PEERS15.exists() else {})
    done = set() if check else set(recorded)
    bad = 0
    sets = ROUND15_SETS["precise"]
    for ld in loads:
        load = mooncake_load(ld)
        _name, trace, window, speed, _busy = load
        wl = None
        for r, w in shapes:
            for seed in seeds:
                base = ReplayConfig(policy="affinity", replicas=r, workers=w, index="precise", load_view="peers",
                                    peer_refresh_ms=10.0, seed=seed, arrival_jitter_ms=jitter, affinity_overrides=sets)
                key = key_of(load, base)
                if key in done:
                    continue
                wl = wl or _workload(trace, window)
                cfg = ReplayConfig(**{**base.__dict__, "speed": speed, "max_model_len": 131072})
                s = summarize(asyncio.run(replay(wl, cfg)), wl)
                if check:
                    was = recorded.get(key)
                    same = was is not None and (was["ttft_mean"], was["hit_ratio"]) == (s["ttft_mean"], s["hit_ratio"])
                    bad += not same
                    print(f"{'IDENTICAL' if same else 'DIFFERENT' if was else 'NOT RECORDED'} {key}: TTFT mean "
                          f"{s['ttft_mean']!r}, recorded {was['ttft_mean'] if was else None!r}", flush=True)
                    continue
                old = rows.get(key)
                row = {"key": key, "ttft_mean": s["ttft_mean"], "hit_ratio": s["hit_ratio"],
                       "old_ttft_mean": old["ttft_mean"] if old else None, "old_hit_ratio": old["hit_ratio"] if old else None}
                with PEERS15.open("a") as fh:
                    fh.write(json.dumps(row) + "\n")
                print(f"{key}: TTFT mean {1000 * s['ttft_mean']:.0f} ms (round 14: "
                      f"{1000 * old['ttft_mean'] if old else float('nan'):.0f})", file=sys.stderr, flush=True)
    if not table or check:
        return bad
    got: dict[tuple[str, str, str], list[dict]] = {}
    for x in PEERS15.read_text().splitlines():
        if x.strip():
            d = json.loads(x)
            k = d["key"].split("|")[0].replace("mooncake", "").strip()
            jit = "20 ms" if "--arrival-jitter-ms 20" in d["key"] else "1 ms"
            got.setdefault((k, jit, "4 x 2" if "--replicas 4" in d["key"] else "1 x 2"), []).append(d)
    print("| load | jitter | R x W, peer load | seeds | TTFT mean ms: mean (min-max) | round 14's order: mean (min-max) "
          "| this vs round 14, same seeds: hit ratio pts / TTFT | one process, same seeds |")
    print("|---|---|---|---|---|---|---|---|")
    for (load, jit, shape), v in sorted(got.items()):
        # One process's rows of the same seeds (round 14's: one process has no host).
        one = [rows.get(d["key"].replace("--replicas 4 ", "").replace("--workers 2 ", "")
                        .replace(" --load-view peers --peer-refresh-ms 10", "")) for d in v]
        one_ms = f"{1000 * statistics.mean(r['ttft_mean'] for r in one if r):,.0f}" if all(one) else " "
        new = [1000 * d["ttft_mean"] for d in v]
        old_t = [1000 * d["old_ttft_mean"] for d in v if d["old_ttft_mean"]]
        both = [d for d in v if d["old_ttft_mean"]]
        vs = " "
        if both:
            dh = statistics.mean(100 * (d["hit_ratio"] - d["old_hit_ratio"]) for d in both)
            t = sum(d["ttft_mean"] for d in both) / sum(d["old_ttft_mean"] for d in both)
            vs = f"{dh:+.2f} / {100 * (t - 1):+.1f}% ({len(both)})"
        old_s = f"{statistics.mean(old_t):,.0f} ({min(old_t):,.0f}-{max(old_t):,.0f})" if old_t else " "
        print(f"| {load} | {jit} | {shape} | {len(v)} | {statistics.mean(new):,.0f} ({min(new):,.0f}-{max(new):,.0f}) "
              f"| {old_s} | {vs} | {one_ms} |")
    return bad


def round15_table() -> None:
    """Round 15 (suite round15-host): per Mooncake load, each --workers host without routing.peer_load
    (and one process, the reference) with and without KV events: hit of the LRU bound and TTFT mean over
    seeds, against one process of the same index and seeds, and against the same shape on round 14's
    host read (rows noted ROUND15_NOTE, the suite run on that code)."""
    rows = _rows()
    print("| load | index | R x W | seeds | hit of the bound: mean (min-max) | TTFT mean ms: mean (min-max) "
          "| vs one process, same seeds: hit pts / TTFT | round 14's host read: TTFT mean ms | this vs round 14, same seeds: hit pts / TTFT |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, window, speed in [(ld[0], ld[2], ld[3]) for ld in LOADS if ld[0] == "mooncake"]:
        bound = _window_bound(rows, name, window)
        if not bound:
            continue
        prefix = f"{name} {window[0]:g}:{window[1]:g} x{speed:g} | "
        for index in ("precise", "learned"):
            for r, w in ((1, 1), (1, 2), (2, 2)):
                cfg0 = ReplayConfig(policy="affinity", replicas=r, workers=w, index=index, arrival_jitter_ms=1.0,
                                    host_table=w > 1, affinity_overrides=ROUND15_SETS[index])
                this, old, one = {}, {}, {}
                for seed in range(8):
                    key = prefix + flags(replace(cfg0, seed=seed))
                    this_row = next((x for x in rows if x["key"] == key), None)
                    if this_row is None:
                        continue
                    this[seed] = this_row
                    old_row = next((x for x in rows if x["key"] == key + ROUND15_NOTE), None)
                    if old_row is not None:
                        old[seed] = old_row
                    one_key = prefix + flags(replace(cfg0, seed=seed, replicas=1, workers=1, host_table=False))
                    one_row = next((x for x in rows if x["key"] == one_key), None)
                    if one_row is not None:
                        one[seed] = one_row
                if not this:
                    continue
                seeds = sorted(this)
                hits = [100 * (this[k]["hit_ratio"] or 0) / bound for k in seeds]
                ttft = [1000 * this[k]["ttft_mean"] for k in seeds]

                def vs(ref: dict[int, dict]) -> str:
                    both = [k for k in seeds if k in ref]
                    if not both or ref is this:
                        return " "
                    dh = sum(100 * ((this[k]["hit_ratio"] or 0) - (ref[k]["hit_ratio"] or 0)) / bound for k in both)
                    t = sum(this[k]["ttft_mean"] for k in both) / sum(ref[k]["ttft_mean"] for k in both)
                    return f"{dh / len(both):+.1f} / {100 * (t - 1):+.1f}% ({len(both)})"

                old_t = [1000 * old[k]["ttft_mean"] for k in seeds if k in old]
                old_s = f"{statistics.mean(old_t):,.0f} ({min(old_t):,.0f}-{max(old_t):,.0f})" if old_t else " "
                print(f"| {window[0]:g}:{window[1]:g} x{speed:g} | {index} | {r} x {w} | {len(seeds)} "
                      f"| {statistics.mean(hits):.1f}% ({min(hits):.1f}-{max(hits):.1f}) "
                      f"| {statistics.mean(ttft):,.0f} ({min(ttft):,.0f}-{max(ttft):,.0f}) "
                      f"| {vs(one) if (r, w) != (1, 1) else ' '} | {old_s} | {vs(old)} |")


def screen_table(settings_list: Sequence[str], base: str = "running_weight=0.5") -> None:
    """Round 14's screens (suites round14-R1:...): one process, per Mooncake load and jitter, each setting
    against the `base` rows of the same seeds: hit of the LRU bound, TTFT mean, p90 and p99 (at 1 ms one
    process is one trajectory: seed 0 alone)."""
    rows = _rows()
    print("| load | jitter | settings | seeds | hit of the bound | TTFT mean ms | p90 | p99 "
          "| vs base, same seeds: hit pts / mean / p90 / p99 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (_name, window, speed, _busy), groups, bound in _mooncake_groups(rows):
        for jitter in (1.0, 20.0):
            base_rows = groups.get((1, 1, "own", 0.0, base, jitter), {})
            for settings in settings_list:
                got = groups.get((1, 1, "own", 0.0, settings, jitter), {})
                seeds = [k for k in sorted(got) if k in base_rows and (jitter != 1.0 or k == 0)]
                if not seeds:
                    continue

                def mean(g: dict, key: str) -> float:
                    return statistics.mean(g[k][key] or 0 for k in seeds)

                def change(key: str) -> str:
                    return f"{100 * (mean(got, key) / mean(base_rows, key) - 1):+.1f}%"

                hit = 100 * mean(got, "hit_ratio") / bound
                dh = hit - 100 * mean(base_rows, "hit_ratio") / bound
                label = settings or "running_weight=1 (before round 13)"
                print(f"| {window[0]:g}:{window[1]:g} x{speed:g} | {jitter:g} ms | {label} | {len(seeds)} | {hit:.1f}% "
                      f"| {1000 * mean(got, 'ttft_mean'):,.0f} | {1000 * mean(got, 'ttft_p90'):,.0f} "
                      f"| {1000 * mean(got, 'ttft_p99'):,.0f} | {dh:+.1f} / {change('ttft_mean')} / {change('ttft_p90')} "
                      f"/ {change('ttft_p99')} |")


# Round 14's screens, in the order they ran (running_weight 0.5 each; the base is 0.5 with the defaults then).
ROUND14_SCREENS = ("", "running_weight=0.5 cost_slack_tokens=16384", "running_weight=0.5 uncached_weight=4",
                   "running_weight=0.5 cost_epsilon=0.5", "running_weight=0.5 uncached_weight=2",
                   "running_weight=0.5 uncached_weight=1.5",
                   "running_weight=0.5 uncached_weight=1.5 cost_slack_tokens=4096 new_prompt_slack_tokens=1024",
                   "running_weight=0.5 eviction_band_tokens=4096", "running_weight=0.5 uncached_weight=2.5")


def host_gap(load_filter: str, seeds: int, jitter: float) -> None:
    """Rounds 14-15: where a --workers 2 host loses against one process. Per seed, side by side: one
    process; two workers sharing one in-flight table and ledger (one process's load view, each worker its
    own learned state); the --workers host as the Deployment runs it, without routing.peer_load, each
    worker its own row of the shared table (the host's queued prefill read from the shared block,
    `SharedInflight.backlog`); and the same host with routing.peer_load and no other replica (the
    host-mates' entries merged by age, `FleetView`)."""
    load = mooncake_load(load_filter)
    _name, trace, window, speed, _busy = load
    wl = _workload(trace, window)
    shapes = {
        "one process": {},
        "2 workers, one table": {"workers": 2, "load_view": "own"},
        "2 workers, shared-memory host": {"workers": 2, "host_table": True},
        "2 workers, shared-memory host, peer_load": {"workers": 2, "load_view": "peers", "peer_refresh_ms": 10.0},
    }
    got: dict[str, list[dict]] = {k: [] for k in shapes}
    for seed in range(seeds):
        for label, over in shapes.items():
            cfg = ReplayConfig(policy="affinity", index="precise", seed=seed, arrival_jitter_ms=jitter, speed=speed,
                               max_model_len=131072, **over)  # type: ignore[arg-type]  # fields by name
            s = summarize(asyncio.run(replay(wl, cfg)), wl)
            got[label].append(s)
            print(f"seed {seed} {label}: TTFT mean {1000 * s['ttft_mean']:.0f} ms, hit {100 * (s['hit_ratio'] or 0):.2f}%",
                  file=sys.stderr, flush=True)
    print(f"| {load_filter}, {jitter:g} ms, {seeds} seeds | TTFT mean ms: mean (min-max) | hit: mean | vs one process |")
    print("|---|---|---|---|")
    base = statistics.mean(x["ttft_mean"] for x in got["one process"])
    for label, rs in got.items():
        t = [1000 * x["ttft_mean"] for x in rs]
        print(f"| {label} | {statistics.mean(t):,.0f} ({min(t):,.0f}-{max(t):,.0f}) "
              f"| {100 * statistics.mean(x['hit_ratio'] or 0 for x in rs):.2f}% "
              f"| {100 * (statistics.mean(x['ttft_mean'] for x in rs) / base - 1):+.1f}% |")


def mooncake_load(load_filter: str) -> tuple[str, Path, tuple[float, float], float, str]:
    """The Mooncake load of LOADS named like 0:300x1 (window and speed); exits naming it if there is none."""
    load = next((ld for ld in LOADS if f"{ld[2][0]:g}:{ld[2][1]:g}x{ld[3]:g}" == load_filter and ld[0] == "mooncake"), None)
    if load is None:
        raise SystemExit(f"no Mooncake load {load_filter!r}")
    return load


def fleet_engine(cfg: ReplayConfig) -> ReplayConfig:
    """The bound's one cache as an engine, under `cfg`'s arrivals (speed, seed, jitter): one engine with the
    fleet's KV blocks, compute (tensor parallel over the fleet's GPUs) and batch limits, round robin over
    itself. The same engine timing (queueing, KV held by running requests) with one pool instead of four."""
    from loadtest.replay import make_profile

    n, prof = cfg.backends, make_profile(cfg.profile, cfg.max_model_len)
    return ReplayConfig(policy="round_robin", backends=1, speed=cfg.speed, max_model_len=cfg.max_model_len,
                        seed=cfg.seed, arrival_jitter_ms=cfg.arrival_jitter_ms, profile_overrides=(
                            ("tp", n * prof.tp), ("num_gpu_blocks_override", n * prof.num_gpu_blocks),
                            ("max_num_batched_tokens", n * prof.max_num_batched_tokens),
                            ("max_num_seqs", n * prof.max_num_seqs)))


def decompose(load_filter: str, sets: list[str], jitter: float, seeds: int) -> None:
    """Where one process's gap to the bound is (R = 1, precise): the bound's one cache next to four caches
    of one engine each in the same cache-only model (loadtest/workloads/bound.py `placed_caches`), placed
    by a rule or by the replay's own picks, and the replay itself (the engines). Four caches with the
    replay's placements against the bound: what the placement loses; the replay against that: what the
    engines' timing loses (queueing, KV held by running requests, preemption); one engine as large as the
    whole fleet, what that timing costs one pool."""
    from loadtest.workloads.bound import PLACEMENT_RULES, placed_caches

    load = mooncake_load(load_filter)
    name, trace, window, speed, busy = load
    wl = _workload(trace, window)
    over = tuple(parse_affinity_sets(sets).items())
    print(f"\n### {name} {window[0]:g}:{window[1]:g} x{speed:g} ({busy}), R = 1 precise"
          + (f", {' '.join(sets)}" if sets else "") + (f", jitter {jitter:g} ms x {seeds} seeds" if jitter else "") + "\n")
    print("| seed | one cache (the bound) | 4 caches: " + " | 4 caches: ".join(PLACEMENT_RULES)
          + " | 4 caches: the replay's placements | the replay (engines) | one engine of the fleet's size |")
    print("|---" * (5 + len(PLACEMENT_RULES)) + "|")
    for seed in range(seeds if jitter else 1):
        cfg = ReplayConfig(policy="affinity", index="precise", speed=speed, max_model_len=131072,
                           affinity_overrides=over, seed=seed, arrival_jitter_ms=jitter)
        result = asyncio.run(replay(wl, cfg))
        s = summarize(result, wl)
        sent = [wl.items[r.index] for r in result.records if r.ttft is not None]
        each = min(result.capacity_tokens.values())
        names = sorted(result.capacity_tokens)
        one = s["bound_lru"]  # the fleet-size LRU bound of the requests an engine computed
        cells = [placed_caches(sent, rule, len(names), each).ratio for rule in PLACEMENT_RULES]
        placed = placed_caches(wl.items, [names.index(r.backend) if r.backend and r.ttft is not None else None
                                          for r in result.records], len(names), each).ratio
        row = [f"{100 * one:.2f}%"] + [f"{100 * c:.2f}% ({100 * c / one:.1f}%)" for c in (*cells, placed)]
        row.append(f"{100 * (s['hit_ratio'] or 0):.2f}% ({100 * (s['hit_ratio'] or 0) / one:.1f}%)")
        whole = summarize(asyncio.run(replay(wl, fleet_engine(cfg))), wl)["hit_ratio"] or 0
        row.append(f"{100 * whole:.2f}% ({100 * whole / one:.1f}%)")
        print(f"| {seed} | " + " | ".join(row) + " |", flush=True)


def lottery(seeds: int) -> None:
    """How much of the bound load-blind placement alone keeps, seed by seed: the bound's cache-only model
    over four engine-sized caches (`placed_caches`), a repeat on its holder and a new prompt by a rule drawn
    per seed (SEEDED_RULES: a hash home under another hash function, a random cache, or churn balanced seen
    through noise), next to the deterministic rules and to the replay's one-process rows (round 10's eight
    seeds at 1 ms). No load, no engine timing: the spread is only where each window's new prompts land.
    Writes scaleout-lottery.png."""
    from loadtest.replay import make_profile
    from loadtest.workloads.bound import PLACEMENT_RULES, SEEDED_RULES, one_cache_bound, placed_caches

    cfg = ReplayConfig()
    n, each = cfg.backends, make_profile(cfg.profile, 131072).kv_capacity_tokens
    rows = _rows() if OUT.exists() else []
    windows = list(dict.fromkeys(ld[2] for ld in LOADS if ld[0] == "mooncake"))  # each window once, in order
    found: dict[tuple, dict[str, list[float]]] = {}
    print(f"\n### Load-blind placement over {n} caches of {each:,} tokens, {seeds} seeds per rule (cache-only model)\n")
    print("| window | one cache (the bound) | " + " | ".join(f"{r} (fixed)" for r in PLACEMENT_RULES)
          + " | " + " | ".join(f"{r}, seeded: mean (min–max) [p10–p90] | {r}: seeds < 95%" for r in SEEDED_RULES) + " |")
    print("|---" * (2 + len(PLACEMENT_RULES) + 2 * len(SEEDED_RULES)) + "|")
    for window in windows:
        # The requests an engine computes (the simulator refuses a prompt that leaves no room for its
        # output within the context), as the replay's bound counts them.
        items = [it for it in _workload(MOONCAKE, window).items if it.input_tokens + it.output_tokens <= 131072]
        one = one_cache_bound(items, n * each).ratio
        fixed = [placed_caches(items, rule, n, each).ratio / one for rule in PLACEMENT_RULES]
        cells = [f"{100 * one:.2f}%"] + [f"{100 * f:.1f}%" for f in fixed]
        for rule in SEEDED_RULES:
            got = sorted(placed_caches(items, rule, n, each, seed=k).ratio / one for k in range(seeds))
            found.setdefault(window, {})[rule] = got
            q = lambda p: got[min(len(got) - 1, int(p * len(got)))]  # noqa: E731
            cells.append(f"{100 * sum(got) / len(got):.1f}% ({100 * got[0]:.1f}–{100 * got[-1]:.1f}) "
                         f"[{100 * q(0.1):.1f}–{100 * q(0.9):.1f}]")
            cells.append(f"{sum(g < 0.95 for g in got)} / {len(got)}")
        print(f"| {window[0]:g}:{window[1]:g} | " + " | ".join(cells) + " |", flush=True)
    replay_dots: dict[tuple, dict[float, list[float]]] = {}
    for lk, groups in _perturbed(rows).items():
        bound = _window_bound(rows, lk[0], lk[1])
        for conf, by_seed in groups.items():
            if conf[:2] == (1, 1) and not conf[4] and conf[5] == 1.0 and bound:
                replay_dots.setdefault(lk[1], {})[lk[2]] = [(r["hit_ratio"] or 0) / bound for r in by_seed.values()]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(found), figsize=(5.5 * len(found), 4.2), squeeze=False)
    for ax, (window, by_rule) in zip(axes[0], found.items()):
        columns = [(f"{r}\n(seeded, {len(v)})", v, "tab:grey") for r, v in by_rule.items()]
        columns += [(f"replay R = 1\nx{sp:g}, 1 ms, {len(v)} seeds", v, "tab:blue")
                    for sp, v in sorted(replay_dots.get(window, {}).items())]
        for x, (_label, vals, colour) in enumerate(columns):
            ax.scatter([x] * len(vals), [100 * v for v in vals], s=12, alpha=0.6, color=colour)
            ax.plot([x - 0.3, x + 0.3], [100 * sum(vals) / len(vals)] * 2, color="black", lw=1.5)
        ax.axhline(95, color="red", ls=":", lw=1)
        ax.axhline(100, color="grey", lw=0.8)
        ax.set_xticks(range(len(columns)))
        ax.set_xticklabels([c[0] for c in columns], fontsize=7)
        ax.set_ylabel("hit, % of the fleet-size LRU bound")
        ax.set_title(f"mooncake {window[0]:g}:{window[1]:g}", fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Load-blind placement over {n} engine-sized caches (cache-only model; grey: one dot per seed) "
                 "and the replay (blue)", fontsize=9)
    fig.tight_layout()
    out = ROOT / "loadtest" / "results" / "scaleout-lottery.png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


# How a request's share of the bound is lost, in `losses` (its hits at admission against the bound's):
LOSS_KINDS = (
    ("evicted", "no engine held what the bound held when it arrived (its engine had evicted it)"),
    ("pending", "no engine held it yet: the request that computes it had not produced its first token"),
    ("moved", "an engine held more of it than the one it was sent to (the cost check moved it)"),
    ("queued", "its engine held it on arrival and evicted it before admitting it (negative: computed meanwhile)"),
    ("beyond", "an engine held more than the bound (negative: a gain)"),
)


def split_loss(bound_hit: int, held: Sequence[int], chosen: int, hit: int, pending: bool) -> dict[str, int]:
    """One request's bound hit minus its hit at admission, in tokens, split by LOSS_KINDS (they sum to
    bound_hit - hit). `held`: what each engine held of its prompt as it arrived; `chosen`: the index of
    the engine it was sent to; `pending`: the bound's source of the prefix was not yet computed then."""
    most = max(held)
    return {"evicted": 0 if pending else max(0, bound_hit - most), "pending": max(0, bound_hit - most) if pending else 0,
            "moved": most - held[chosen], "queued": held[chosen] - hit, "beyond": min(0, bound_hit - most)}


def losses(load_filter: str, sets: list[str], jitter: float, seeds: int, replicas: bool = False,
           plot: bool = True) -> None:
    """Where one process's requests lose their share of the bound, request by request (R = 1, precise; with
    `replicas`, R = 4 x W = 2 as the perturbed suites run it):
    what each engine held of a prompt as it arrived (`replay(..., observe=...)`), what it hit when its
    engine admitted it, against what the bound's one cache hit, split by LOSS_KINDS. With each evicted
    prefix: how near the bound's own eviction it was (`bound_steps` depth). And how steep the bound is
    there: the bound of a cache a few percent smaller (the room that KV held by running requests takes
    from a cache). Writes scaleout-losses-<window>x<speed>-<jitter>ms.png (unless not `plot`)."""
    from loadtest.workloads.bound import bound_steps, one_cache_bound

    load = mooncake_load(load_filter)

    name, trace, window, speed, busy = load
    wl = _workload(trace, window)
    over = tuple(parse_affinity_sets(sets).items())
    kinds = [k for k, _ in LOSS_KINDS]
    print(f"\n### {name} {window[0]:g}:{window[1]:g} x{speed:g} ({busy}), {'R = 4 x W = 2' if replicas else 'R = 1'} precise"
          + (f", {' '.join(sets)}" if sets else "") + f", jitter {jitter:g} ms, {seeds} seed(s)\n")
    print("| seed | kept (of the bound) | TTFT mean ms | " + " | ".join(f"{k}, pts" for k in kinds)
          + " | KV held by running requests (mean share of an engine at arrivals) | largest losses: tokens, kind, seconds since its source, depth in the bound's cache |")
    print("|---" * (5 + len(kinds)) + "|")
    dots: list[tuple[float, int]] = []  # evicted repeats: (depth in the bound's cache, tokens lost)
    running: list[float] = []
    capacity = 0
    computed: list[Any] = []
    for seed in range(seeds):
        cfg = replace(_one_and_replicas(seed, jitter, over)[1 if replicas else 0], speed=speed, max_model_len=131072)
        seen: dict[int, tuple[list[int], int]] = {}  # request index -> (held per engine on arrival, its engine)
        used: list[float] = []

        def observe(i: int, backend: str, rid: str, engines: Any) -> None:
            mine = engines[backend]
            seen[i] = ([mine.cached_prefix_tokens(rid, e.pool) for e in engines.values()], list(engines).index(backend))
            used.extend(e.pool.num_used / e.pool.num_blocks for e in engines.values())

        result = asyncio.run(replay(wl, cfg, observe=observe))
        capacity = sum(result.capacity_tokens.values())
        recs = [r for r in result.records if r.ttft is not None and r.index in seen]
        computed = [wl.items[r.index] for r in recs]
        steps = bound_steps(computed, capacity)
        done_at = [r.scheduled + (r.ttft or 0.0) for r in recs]
        total = dict.fromkeys(kinds, 0)
        bound_hits = hits = 0
        big: list[tuple[int, str, float, float]] = []
        for k, r in enumerate(recs):
            st = steps[k]
            held, chosen = seen[r.index]
            hit = min(r.cached_tokens or 0, r.input_tokens)
            bound_hits += st.hit_tokens
            hits += hit
            pending = st.source is not None and done_at[st.source] > r.scheduled
            part = split_loss(st.hit_tokens, held, chosen, hit, pending)
            for kind, v in part.items():
                total[kind] += v
            for kind in ("evicted", "moved", "queued"):
                if part[kind] > 0:
                    gap = r.scheduled - recs[st.source].scheduled if st.source is not None else 0.0
                    big.append((part[kind], kind, gap, st.depth))
                    if kind == "evicted":
                        dots.append((st.depth, part[kind]))
        used.sort()
        running.append(sum(used) / len(used) if used else 0.0)
        peak = used[int(0.9 * len(used))] if used else 0.0
        big.sort(reverse=True)
        pts = lambda v: 100 * v / bound_hits if bound_hits else 0.0  # noqa: E731
        ttft = 1000 * sum(r.ttft or 0.0 for r in recs) / max(1, len(recs))
        print(f"| {seed} | {pts(hits):.1f}% | {ttft:.0f} | " + " | ".join(f"{pts(total[k]):.1f}" for k in kinds)
              + f" | {100 * running[-1]:.1f}% (p90 {100 * peak:.1f}%) | "
              + "; ".join(f"{t:,} {kind} {gap:.0f} s {depth:.2f}" for t, kind, gap, depth in big[:4]) + " |", flush=True)
    # The bound's one cache as an engine (`fleet_engine`), first seed's arrivals. Its requests finish
    # sooner (tensor parallel over the fleet's GPUs), so by Little's law it holds less KV for running
    # requests.
    big_used: list[float] = []
    big_cfg = fleet_engine(replace(cfg, seed=0))
    whole = summarize(asyncio.run(replay(wl, big_cfg, observe=lambda i, b, rid, engines: big_used.extend(
        e.pool.num_used / e.pool.num_blocks for e in engines.values()))), wl)
    big_used.sort()
    print(f"\nOne engine of the fleet's size (seed 0): {100 * (whole['hit_ratio'] or 0) / (whole['bound_lru'] or 1):.1f}% "
          f"of the bound; KV held by running requests {100 * sum(big_used) / max(1, len(big_used)):.1f}% "
          f"(p90 {100 * big_used[int(0.9 * len(big_used))]:.1f}%) at arrivals.")
    # How steep the bound is around the fleet's capacity: the room running requests' KV takes from it.
    full = one_cache_bound(computed, capacity).ratio
    factors = (0.85, 0.9, 0.93, 0.95, 0.97, 1.0, 1.05)
    steep = [one_cache_bound(computed, int(capacity * f)).ratio / full if full else 0.0 for f in factors]
    print("\nThe bound of a smaller or larger cache, as a share of the bound (the last seed's computed requests):\n")
    print("| cache size | " + " | ".join(f"{f:g} x" for f in factors) + " |")
    print("|---" * (1 + len(factors)) + "|")
    print("| kept | " + " | ".join(f"{100 * v:.1f}%" for v in steep) + " |")
    # How much of the bound hangs on blocks near its cache's end, which a fleet of separate engines
    # keeps only if the engine holding one took no more than its share of the churn since and had room.
    hit_total = sum(s.hit_tokens for s in steps) or 1
    depths = (0.5, 0.7, 0.8, 0.85, 0.9)
    print("\nThe bound's hits by how deep in its cache they were (the last seed's computed requests):\n")
    print("| depth above | " + " | ".join(f"{d:g}" for d in depths) + " |")
    print("|---" * (1 + len(depths)) + "|")
    print("| share of the bound's hit tokens | "
          + " | ".join(f"{100 * sum(s.hit_tokens for s in steps if s.depth > d) / hit_total:.1f}%" for d in depths) + " |")
    if not plot:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    if dots:
        left.scatter([d for d, _t in dots], [t for _d, t in dots], s=14, alpha=0.6)
    mean_room = 1.0 - sum(running) / len(running) if running else 1.0
    left.axvline(mean_room, color="red", ls=":", lw=1, label=f"1 - KV held by running requests ({100 * mean_room:.0f}%)")
    left.set_xlabel("depth of the lost prefix in the bound's cache (share of its capacity used more recently)")
    left.set_ylabel("tokens lost (evicted by its engine)")
    left.set_xlim(0, 1.0)
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    left.set_title(f"evicted repeats, {seeds} seed(s), {jitter:g} ms", fontsize=9)
    right.plot(factors, [100 * v for v in steep], marker="o")
    right.axhline(95, color="red", ls=":", lw=1)
    right.axvline(mean_room, color="red", ls=":", lw=1)
    right.set_xlabel("cache size, share of the fleet's KV")
    right.set_ylabel("hit, % of the fleet-size LRU bound")
    right.grid(alpha=0.3)
    right.set_title("the bound of one smaller cache", fontsize=9)
    fig.suptitle(f"{name} {window[0]:g}:{window[1]:g} x{speed:g}: where {'R = 4 x W = 2' if replicas else 'R = 1'} loses the bound",
                 fontsize=10)
    fig.tight_layout()
    shape = "-r4w2" if replicas else ""
    out = ROOT / "loadtest" / "results" / f"scaleout-losses-{window[0]:g}-{window[1]:g}x{speed:g}-{jitter:g}ms{shape}.png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


# Which perturbed configurations each spread figure shows: their affinity settings, and their (R, W) shapes
# (None: every shape). Round 10's (the shipped defaults and new-prompt slack 0, every shape) and round 11's
# (the placements it re-judged, one process against R = 4 x W = 2).
SPREAD_FIGURES: dict[str, tuple[tuple[str, ...], tuple[tuple[int, int], ...] | None]] = {
    "scaleout-spread.png": (("", "new_prompt_slack_tokens=0"), None),
    "scaleout-round11.png": (("", "eviction_band_tokens=4096", "eviction_band_tokens=2048", "cost_epsilon=1",
                              "learned index", "learned index, cost_epsilon=1"), ((1, 1), (4, 2))),
    "scaleout-round13.png": (ROUND13_SETTINGS, ((1, 1), (4, 2))),
    "scaleout-round14.png": (("",) + ROUND14_SETTINGS, ((1, 1), (4, 2))),
}


# (round 14's Azure check has no rows at the settings compared: its Mooncake columns only)
MOONCAKE_FIGURES = ("scaleout-round14.png",)


def spread_plot() -> None:
    """SPREAD_FIGURES: the perturbed rows, one column per load, each configuration's seeds as dots (hit of
    the LRU bound above, TTFT mean below), R = 1 and R = 4 x W = 2 side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows()
    for fname, (settings, shapes) in SPREAD_FIGURES.items():
        perturbed = {lk: {c: g for c, g in groups.items() if c[4] in settings and (shapes is None or c[:2] in shapes)}
                     for lk, groups in _perturbed(rows).items()
                     if lk[0] == "mooncake" or fname not in MOONCAKE_FIGURES}
        if any(perturbed.values()):
            # (rows without settings ran at the defaults of their day: before round 13, running_weight 1)
            plain = "weight 1" if fname in ("scaleout-round13.png", "scaleout-round14.png") else "default"
            _spread_figure(plt, rows, perturbed, ROOT / "loadtest" / "results" / fname, plain)


def _spread_figure(plt: Any, rows: list[dict], perturbed: dict, out: Path, plain: str = "default") -> None:
    fig, axes = plt.subplots(2, len(perturbed), figsize=(3.8 * len(perturbed), 6.5), squeeze=False)
    for col, (lk, groups) in enumerate(perturbed.items()):
        name, window, speed, busy = lk
        bound = _window_bound(rows, name, window)
        labels = []
        for x, conf in enumerate(sorted(groups, key=lambda c: (c[5], c[4], c[0], c[1]))):
            rr, ww, _view, _every, settings, jitter = conf
            colour = "tab:blue" if rr == 1 else "tab:red"
            rs = list(groups[conf].values())
            hits = [100 * (r["hit_ratio"] or 0) / bound for r in rs] if bound else [100 * (r["hit_ratio"] or 0) for r in rs]
            ttft = [1000 * r["ttft_mean"] for r in rs]
            axes[0][col].scatter([x] * len(hits), hits, color=colour, s=14, alpha=0.7)
            axes[1][col].scatter([x] * len(ttft), ttft, color=colour, s=14, alpha=0.7)
            axes[0][col].plot([x - 0.3, x + 0.3], [sum(hits) / len(hits)] * 2, color="black", lw=1.5)
            axes[1][col].plot([x - 0.3, x + 0.3], [sum(ttft) / len(ttft)] * 2, color="black", lw=1.5)
            short = settings.replace("new_prompt_slack_tokens", "slack").replace("eviction_band_tokens", "band") \
                .replace("cost_epsilon", "eps").replace("cost_slack_tokens", "cslack").replace(" index", "") \
                .replace("uncached_weight=", "uw ")
            labels.append(f"{jitter:g}ms {short.replace('running_weight=', 'weight ') or plain}\nR{rr}xW{ww}")
        for ax in axes[:, col]:
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, fontsize=6, rotation=90)
            ax.grid(alpha=0.3)
        if bound:
            axes[0][col].axhline(95, color="grey", ls=":", lw=1)
        axes[0][col].set_title(f"{name} {window[0]:g}:{window[1]:g} x{speed:g}\n({busy})", fontsize=9)
        axes[0][col].set_ylabel("hit, % of the fleet LRU bound")
        axes[1][col].set_ylabel("TTFT mean, ms")
    fig.suptitle("Perturbed replays (seeded arrival jitter): each dot one seed, bar the mean; "
                 "blue one host (R = 1, W = 1 or 2), red several replicas", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    print(f"wrote {out}")


def plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows()
    loads = _loads(rows)
    fig, axes = plt.subplots(2, len(loads), figsize=(3.6 * len(loads), 6.5), squeeze=False)
    for col, lk in enumerate(loads):
        sel = [(parse_flags(r["flags"]), r) for r in rows if (r["load"], tuple(r["window"]), r["speed"], r["busy"]) == lk]
        # (index, load view, refresh, ledger entries published, colour, label); R = 1 is one process (own).
        lines = (("learned", "own", 0.0, True, "tab:orange", "learned"),
                 ("precise", "engines", 0.0, True, "tab:blue", "precise, engines' counts"),
                 ("precise", "peers", 50.0, False, "tab:olive", "precise, shared ledger sums 50 ms (round 3)"),
                 ("precise", "peers", 20.0, True, "tab:green", "precise, shared ledger entries 20 ms"),
                 ("precise", "peers", 10.0, True, "tab:red", "precise, shared ledger entries 10 ms (round 5)"))
        for index, view, every, recent, colour, label in lines:
            for w, style in ((1, "-"), (2, "--")):
                pts = sorted(
                    (f["replicas"], r) for f, r in sel
                    if f["policy"] == "affinity" and f["index"] == index and f["workers"] == w and f["shared"]
                    and f["delay"] == 50.0 and f["lookup"] == "proxy" and f["seed"] == 0 and not f["note"]
                    and not f.get("affinity_set") and not f.get("jitter")
                    and (f["replicas"] == 1 or (f["every"] == every and f["recent"] == recent))
                    and f["load_view"] == (view if f["replicas"] > 1 else "own")
                )
                if len(pts) < 2:
                    continue
                xs = [p[0] for p in pts]
                axes[0][col].plot(xs, [100 * (p[1]["hit_ratio"] or 0) for p in pts], style, marker="o", color=colour, label=f"{label}, W={w}")
                axes[1][col].plot(xs, [1000 * p[1]["ttft_mean"] for p in pts], style, marker="o", color=colour, label=f"{label}, W={w}")
        rr = next((r for f, r in sel if f["policy"] == "round_robin"), None)
        if rr is not None:
            axes[0][col].axhline(100 * (rr["hit_ratio"] or 0), color="grey", lw=1, label="round robin")
            axes[1][col].axhline(1000 * rr["ttft_mean"], color="grey", lw=1, label="round robin")
            if rr.get("bound_lru"):
                axes[0][col].axhline(100 * rr["bound_lru"], color="black", ls=":", lw=1, label="fleet LRU bound")
        name, window, speed, busy = lk
        axes[0][col].set_title(f"{name} {window[0]:g}:{window[1]:g} x{speed:g}\n({busy})", fontsize=9)
        axes[0][col].set_ylabel("prefix hit ratio, %")
        axes[1][col].set_ylabel("TTFT mean, ms")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("replicas R")
            ax.set_xticks([1, 2, 4])
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Scale-out in the offline replay: affinity with learned vs precise (KV events) index, 4 x H100", fontsize=10)
    fig.tight_layout()
    out = ROOT / "loadtest" / "results" / "scaleout.png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


SUITES = ("core", "prefix", "views", "matrix", "round4", "round4b", "round5", "round5-20", "round5-seeds",
          "round5-placement", "round8-nps", "round10-chaos", "round10-jitter20", "round10-shapes",
          "round11-eviction", "round11-eviction20", "round11-repeats", "round11-eps", "round11-eps20",
          "round11-eps-learned", "round11-eps-learned20", "round13-weight-0", "round13-weight-0.25",
          "round13-weight-0.5", "round13-weight-0.75", "round13-weight-0.25-shapes", "round13-weight-0.5-shapes",
          "round13-weight-0.75-shapes", "round15-host")
# Round 14's suites take affinity settings after the colon: round14-R1:uncached_weight=2,cost_epsilon=0.5.
ROUND14_SUITES = ("round14-R1:", "round14-pair:", "round14-shapes:")


def _suite_name(name: str) -> str:
    """argparse: a suite `suite` knows (round14-{R1,pair,shapes}:k=v[,k=v] for any affinity settings)."""
    if name in SUITES:
        return name
    if name.startswith(ROUND14_SUITES):
        try:
            parse_affinity_sets(name.partition(":")[2].split(","))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"suite {name!r}: {e}") from None
        return name
    raise argparse.ArgumentTypeError(f"unknown suite {name!r}")


def live_workers(path: Path) -> None:
    """Round 17: live runs of one replica at W = 1 and W = 2 (scaleout-live-round17.json), as a table of
    means and a plot of every run beside the replay's 20 ms-jitter range."""
    import statistics

    data = json.loads(path.read_text())
    runs = data["runs"]
    print("| | runs | TTFT mean, mean of runs (min-max) | TTFT p50 | hit of the LRU bound | engines' TTFT mean "
          "| added by the proxy | proxy CPU per request |")
    print("|---|---|---|---|---|---|---|---|")
    for w in (1, 2):
        rs = [r for r in runs if r["workers"] == w]

        def mean(key: str, fmt: str = "{:,.0f}") -> str:
            xs = [r[key] for r in rs if r.get(key) is not None]
            return (fmt.format(statistics.mean(xs)) + f" ({len(xs)})") if xs else "-"
        ttft = [r["ttft_mean_ms"] for r in rs]
        print(f"| W = {w} | {len(rs)} | {statistics.mean(ttft):,.0f} ms ({min(ttft):,.0f}-{max(ttft):,.0f}) "
              f"| {mean('ttft_p50_ms')} ms | {mean('hit_vs_bound', '{:.1%}')} | {mean('engine_ttft_mean_ms')} ms "
              f"| {mean('ttft_added_mean_ms', '{:.1f}')} ms | {mean('proxy_cpu_ms_per_req', '{:.1f}')} ms |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rep = data["replay_20ms_jitter_seeds_0_7"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for w, lo, hi, mid in ((1, *rep["W1_range_ms"], rep["W1_mean_ms"]), (2, *rep["W2_host_range_ms"], rep["W2_host_mean_ms"])):
        ax.fill_between([w - 0.3, w + 0.3], lo, hi, color="tab:gray", alpha=0.25,
                        label="replay, 20 ms jitter, seeds 0-7 (range)" if w == 1 else None)
        ax.plot([w - 0.3, w + 0.3], [mid, mid], color="tab:gray")
        xs = [r["ttft_mean_ms"] for r in runs if r["workers"] == w]
        ax.scatter([w + 0.12 * ((i % 5) - 2) / 2 for i in range(len(xs))], xs, color="tab:blue" if w == 1 else "tab:orange",
                   zorder=3, label=f"live W = {w} ({len(xs)} runs)")
        ax.plot([w - 0.2, w + 0.2], [statistics.mean(xs)] * 2, color="black", lw=2)
    ax.set_xticks([1, 2], ["--workers 1", "--workers 2"])
    ax.set_ylabel("TTFT mean (ms)")
    ax.set_title("Mooncake 900:1200 x1, one replica, precise: live runs vs replay", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("suite", type=_suite_name, help="a suite: " + ", ".join(SUITES) + ", or round14-{R1,pair,shapes}:k=v[,k=v]")
    r.add_argument("--only", help="only the loads whose name contains this (mooncake, azure)")
    r.add_argument("--load", help="only the load of this window and speed, e.g. 0:300x1")
    r.add_argument("--seed", type=int, help="only the configurations of this replica-assignment seed")
    sub.add_parser("table")
    sub.add_parser("spread")
    sub.add_parser("progress", help="round 13: with and without the ledger's progress, side by side")
    sub.add_parser("round14", help="round 14: the screens at running_weight 0.5, then uncached_weight 2 against 3")
    sub.add_parser("round15", help="round 15: --workers hosts without routing.peer_load (suite round15-host)")
    p15 = sub.add_parser("round15-peers", help="round 15: --workers hosts with peer load, against round 14's rows")
    p15.add_argument("--loads", default="900:1200x1,0:300x1,900:1200x0.6,0:300x0.6")
    p15.add_argument("--shapes", default="1x2,4x2", help="R x W, comma-separated")
    p15.add_argument("--seeds", type=int, default=8)
    p15.add_argument("--arrival-jitter-ms", type=float, default=1.0)
    p15.add_argument("--no-table", action="store_true", help="run only (the table reads the whole file)")
    p15.add_argument("--seed", type=int, help="this seed only (else 0 .. --seeds - 1)")
    p15.add_argument("--check", action="store_true",
                     help="replay each again and compare with its recorded row (exit 1 if any differs); write nothing")
    imp = sub.add_parser("import-rows", help="append another checkout's rows of a suite with a note (round15)")
    imp.add_argument("jsonl", type=Path, help="the other checkout's loadtest/results/scaleout.jsonl")
    imp.add_argument("--suite", default="round15-host")
    imp.add_argument("--note", default=ROUND15_NOTE)
    d = sub.add_parser("decompose")
    d.add_argument("--load", required=True, help="a Mooncake load, e.g. 0:300x1")
    d.add_argument("--affinity-set", action="append", default=[], metavar="KEY=VALUE")
    d.add_argument("--arrival-jitter-ms", type=float, default=0.0)
    d.add_argument("--seeds", type=int, default=1, help="with --arrival-jitter-ms: this many seeds")
    ls = sub.add_parser("losses")
    ls.add_argument("--load", required=True, help="a Mooncake load, e.g. 0:300x1")
    ls.add_argument("--affinity-set", action="append", default=[], metavar="KEY=VALUE")
    ls.add_argument("--arrival-jitter-ms", type=float, default=1.0)
    ls.add_argument("--seeds", type=int, default=8)
    ls.add_argument("--replicas", action="store_true", help="R = 4 x W = 2 (shared ledger, 10 ms) instead of one process")
    hg = sub.add_parser("host-gap", help="round 14: one process, two workers on one table, a --workers 2 host")
    hg.add_argument("--load", required=True, help="a Mooncake load, e.g. 900:1200x1")
    hg.add_argument("--seeds", type=int, default=8)
    hg.add_argument("--arrival-jitter-ms", type=float, default=1.0)
    lo = sub.add_parser("lottery")
    lo.add_argument("--seeds", type=int, default=30, help="seeds per seeded placement rule")
    lw = sub.add_parser("live-workers", help="round 17: live --workers 1 / 2 runs (table and plot)")
    lw.add_argument("--json", type=Path, default=OUT.parent / "scaleout-live-round17.json")
    sub.add_parser("plot")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args.suite, args.only, args.load, args.seed)
    elif args.cmd == "table":
        table()
    elif args.cmd == "decompose":
        decompose(args.load, args.affinity_set, args.arrival_jitter_ms, args.seeds)
    elif args.cmd == "losses":
        losses(args.load, args.affinity_set, args.arrival_jitter_ms, args.seeds, args.replicas)
    elif args.cmd == "host-gap":
        host_gap(args.load, args.seeds, args.arrival_jitter_ms)
    elif args.cmd == "lottery":
        lottery(args.seeds)
    elif args.cmd == "live-workers":
        live_workers(args.json)
    elif args.cmd == "spread":
        spread()
        spread_plot()
    elif args.cmd == "progress":
        progress_table()
    elif args.cmd == "round15":
        round15_table()
    elif args.cmd == "round15-peers":
        bad = round15_peers(args.loads.split(","),
                            [(int(a), int(b)) for a, b in (x.split("x") for x in args.shapes.split(","))],
                            range(args.seeds) if args.seed is None else [args.seed], args.arrival_jitter_ms,
                            not args.no_table, args.check)
        if bad:
            raise SystemExit(1)
    elif args.cmd == "import-rows":
        import_rows(args.jsonl, args.suite, args.note)
    elif args.cmd == "round14":
        screen_table(ROUND14_SCREENS)
        print()
        progress_table(ROUND14_SETTINGS, base="running_weight=0.5", base_label="running_weight=0.5",
                       vs_label="vs uncached_weight 3")
        print()
        progress_table(ROUND14_SETTINGS[1:], vs_label="vs weight 1 (before round 13)")
    else:
        plot()


if __name__ == "__main__":
    main()
