"""Experiment (scaleout.md round 12): the work ledger's queued-prefill estimate, corrected by the prefill the
engines' KV events say they have computed since the oldest counted entry. Round 13 shipped a backlog bound in
its place (proxy/core/work_ledger.py "Progress", routing.affinity.running_weight); this script runs the
replay at running_weight 1 (the bound off) so that its own patch is the only correction, as in round 12.

The cost check reads, per backend, `WorkLedger.pending`: the uncached prompt tokens of the newest k requests
sent there, k its live requests (proxy/core/work_ledger.py). That counts a request's whole prefill for as
long as it is live, decoding included, and nothing of the prefill the engine has already done. With KV events
on, the proxy sees that progress: an engine stores a block as soon as its prefill has computed it. This
script patches two things into the pure-Python core (`AFFINITY_PROXY_NATIVE=0`, set below; a monkeypatch
does not reach the compiled core):
- `KVIndex.stored` counts, per backend, the tokens of the blocks its engine stored;
- `WorkLedger.record` remembers that count with each entry, and `WorkLedger.pending` subtracts what the
  backend stored since the oldest of the newest k entries was recorded (floored at 0).

One process only: the plain in-flight table's path. The `--workers` shared table and the replicas' merged
estimate (`fleet_pending`) are not patched, so R > 1 rows would measure nothing new.

    python loadtest/results/ledger_progress.py losses --load 0:300x1 --seeds 4 --arrival-jitter-ms 20 [--affinity-set k=v]
    python loadtest/results/ledger_progress.py error --load 0:300x1 --seed 0 --arrival-jitter-ms 20 [--corrected]

`losses` is `scaleout.py losses` with the patch on (its tables; no figure). `error` replays once and reports, at every read of the
estimate, how far both estimates (and round 13's bound, alone and at running_weight 0.5) are from what the
engine really had left to prefill (its requests'
prompt tokens not yet computed, a waiting request's cached prefix left out); `--corrected` picks with the
corrected estimate, else with the shipped one.
"""

from __future__ import annotations

import os

os.environ["AFFINITY_PROXY_NATIVE"] = "0"

import argparse  # noqa: E402
import asyncio  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from collections import deque  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Mapping  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtest.results import scaleout  # noqa: E402
from proxy.core import work_ledger  # noqa: E402
from proxy.core.decision import Inflight  # noqa: E402
from proxy.core.inflight import newest_sum  # noqa: E402
from proxy.core.kv_index import KVIndex  # noqa: E402

STORED: dict[str, int] = {}  # backend -> tokens its engine has stored (BlockStored), as the index saw them
_MARKS: dict[tuple[int, str], deque[int]] = {}  # (ledger, backend) -> STORED[backend] at each entry's record
ENGINES: dict[str, Any] = {}  # `error`: the replay's engines, to read what they really have left
ERRORS: dict[str, list[float]] = {"shipped": [], "corrected": [], "round 13 bound": [], "round 13 weight 0.5": []}
PICK_WITH = ["corrected"]


def remaining_prefill(engine: Any) -> int:
    """What an engine really has left to prefill: its live requests' prompt tokens not yet computed (a
    request not yet admitted: its prompt less the prefix its engine holds now)."""
    left = 0
    for seq in engine._seqs.values():
        done = seq.num_computed if seq.num_cached >= 0 else engine.cached_prefix_tokens(seq.request_id)
        left += max(0, seq.num_prompt - done)
    return left


def patch() -> None:
    stored_orig = KVIndex.stored
    record_orig = work_ledger.WorkLedger.record
    pending_orig = work_ledger.WorkLedger.pending  # round 13's: the backlog bound below weight 1

    def stored(self: KVIndex, backend: str, block_hashes: Any, parent: Any, token_ids: Any, block_size: int,
               **kw: Any) -> int:
        n = stored_orig(self, backend, block_hashes, parent, token_ids, block_size, **kw)
        STORED[backend] = STORED.get(backend, 0) + n * block_size
        return n

    def record(self: work_ledger.WorkLedger, backend: str, tokens: float,
               inflight: Mapping[str, Inflight] | None = None) -> None:
        record_orig(self, backend, tokens, inflight)
        _MARKS.setdefault((id(self), backend), deque(maxlen=self._depth)).append(STORED.get(backend, 0))

    def pending(self: work_ledger.WorkLedger, backend: str, inflight: Inflight | None, weight: float = 1.0) -> float:
        if inflight is None:
            return 0.0
        shipped = newest_sum(self._entries.get(backend), inflight.requests, inflight.tokens)
        marks = _MARKS.get((id(self), backend))
        k = min(inflight.requests, len(marks)) if marks else 0
        corrected = max(0.0, shipped - (STORED.get(backend, 0) - marks[-k])) if marks and k > 0 else shipped
        if ENGINES:
            actual = remaining_prefill(ENGINES[backend])
            ERRORS["shipped"].append(shipped - actual)
            ERRORS["corrected"].append(corrected - actual)
            ERRORS["round 13 bound"].append(pending_orig(self, backend, inflight, 0.0) - actual)
            ERRORS["round 13 weight 0.5"].append(pending_orig(self, backend, inflight, 0.5) - actual)
        return corrected if PICK_WITH[0] == "corrected" else shipped

    KVIndex.stored = stored  # type: ignore[method-assign, assignment]
    work_ledger.WorkLedger.record = record  # type: ignore[method-assign]
    work_ledger.WorkLedger.pending = pending  # type: ignore[method-assign]


def error(load_filter: str, seed: int, jitter: float, corrected: bool, sets: list[str]) -> None:
    from loadtest.replay import parse_affinity_sets, replay
    from loadtest.report import summarize

    load = scaleout.mooncake_load(load_filter)
    PICK_WITH[0] = "corrected" if corrected else "shipped"
    wl = scaleout._workload(load[1], load[2])
    over = tuple(parse_affinity_sets(["running_weight=1", *sets]).items())
    cfg = replace(scaleout._one_and_replicas(seed, jitter, over)[0], speed=load[3], max_model_len=131072)

    def observe(_i: int, _b: str, _rid: str, engines: Mapping[str, Any]) -> None:
        if not ENGINES:
            ENGINES.update(engines)

    s = summarize(asyncio.run(replay(wl, cfg, observe=observe)), wl)
    print(f"{load_filter}, seed {seed}, {jitter:g} ms, picking with the {PICK_WITH[0]} estimate: hit "
          f"{100 * (s['hit_ratio'] or 0) / (s['bound_lru'] or 1):.1f}% of the bound, TTFT mean {1000 * s['ttft_mean']:.0f} ms")
    print("| estimate | bias, tokens | mean abs. error | p90 abs. error | reads |\n|---|---|---|---|---|")
    for name, errs in ERRORS.items():
        absolute = sorted(abs(e) for e in errs)
        print(f"| {name} | {statistics.mean(errs):+,.0f} | {statistics.mean(absolute):,.0f} | "
              f"{absolute[int(0.9 * len(absolute))]:,.0f} | {len(errs)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("losses")
    er = sub.add_parser("error")
    for p in (ls, er):
        p.add_argument("--load", required=True, help="a Mooncake load, e.g. 0:300x1")
        p.add_argument("--affinity-set", action="append", default=[], metavar="KEY=VALUE")
        p.add_argument("--arrival-jitter-ms", type=float, default=20.0)
    ls.add_argument("--seeds", type=int, default=4)
    er.add_argument("--seed", type=int, default=0)
    er.add_argument("--corrected", action="store_true", help="pick with the corrected estimate")
    args = ap.parse_args()
    patch()
    if args.cmd == "losses":
        scaleout.losses(args.load, ["running_weight=1", *args.affinity_set], args.arrival_jitter_ms, args.seeds,
                        plot=False)
    else:
        error(args.load, args.seed, args.arrival_jitter_ms, args.corrected, args.affinity_set)


if __name__ == "__main__":
    main()
