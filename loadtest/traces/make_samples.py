"""Generate the shipped trace samples: synthetic look-alikes of the published traces, in their exact formats.

The real traces are not redistributed with the project (no network here, and their own repositories are
the place to get them). These samples are generated from published statistics, seeded, so anyone can
regenerate them byte for byte:

    python -m loadtest.traces.make_samples            # writes the three samples next to this file
    python -m loadtest.traces.make_samples --mooncake-seconds 3600 --out /tmp/hour.jsonl --only mooncake

Sources of the statistics (see README.md in this folder for the table and the measured values):
- Mooncake FAST'25 `synthetic_trace.jsonl` (Qin et al., FAST'25, Table 2, and the released file): 3,993
  requests over ~1,022 s (Poisson arrivals), mean input 15,325 tokens (median ~11.6k, p99 ~66k), mean
  output 149, one-cache (ideal) hit ratio 64-66 %; built from ShareGPT, L-Eval and LooGLE mixed 1:1:1;
  about 42 % of new blocks are ever reused, median time to first reuse ~150 s.
- Azure LLM inference trace 2023 (Patel et al., "Splitwise", ISCA'24; AzurePublicDataset):
  code: 2.57 req/s, context median 1,469 / mean 2,048 / p99 7,436, generated median 13 / mean 28 / p99 249;
  conversation: 5.53 req/s, context median 1,020 / mean 1,155 / p99 4,142, generated median 129 /
  mean 211 / p99 601 (nearly bimodal).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
from datetime import datetime, timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLOCK = 512


def _lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


def mooncake_synthetic(seconds: float = 600.0, seed: int = 0, rate: float = 3993 / 1022) -> list[dict]:
    """A Mooncake-format trace shaped like FAST'25's synthetic trace.

    Three sources, 1:1:1 by request count, with Poisson arrivals overall:
    - conversation (ShareGPT-like): sessions whose turns re-send a growing history;
    - long-document QA (L-Eval-like, ~12k-token documents) and (LooGLE-like, ~24k-token documents): several
      questions about one document, each prompt = the document's blocks + a question of its own.
    A session or document starts uniformly in time; its follow-ups come after exponential gaps (mean
    150 s, matching the published median time to first reuse). Hash ids are allocated in order of first
    appearance, as in the published file.
    """
    rng = random.Random(seed)
    n_target = int(seconds * rate)
    # Each "group" (a conversation or a document) yields several requests; draw groups until the request
    # count is met, then drop follow-ups that would fall past the end.
    groups: list[list[tuple[float, list[tuple[str, int]], int]]] = []
    produced = 0
    uid = itertools.count()
    while produced < n_target:
        kind = rng.choice(("conv", "leval", "loogle"))
        start = rng.uniform(0.0, seconds)
        reqs: list[tuple[float, list[tuple[str, int]], int]] = []
        if kind == "conv":
            turns = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / 5.0))
            history: list[tuple[str, int]] = []
            t = start
            for _ in range(turns):
                user = (f"u{next(uid)}", _lognormal(rng, 600, 0.9, 20, 8000))
                history.append(user)
                out = _lognormal(rng, 200, 0.6, 10, 1500)
                reqs.append((t, list(history), out))
                history.append((f"a{next(uid)}", out))
                t += rng.expovariate(1.0 / 60.0)
        else:
            median = 11500 if kind == "leval" else 27000
            doc = (f"d{next(uid)}", _lognormal(rng, median, 0.5, 2000, 90000))
            questions = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / 11.0))
            t = start
            for _ in range(questions):
                q = (f"q{next(uid)}", _lognormal(rng, 60, 0.5, 10, 400))
                reqs.append((t, [doc, q], _lognormal(rng, 60, 0.9, 4, 1200)))
                t += rng.expovariate(1.0 / 150.0)
        reqs = [r for r in reqs if r[0] < seconds]
        produced += len(reqs)
        groups.append(reqs)
    flat = sorted((r for g in groups for r in g), key=lambda r: r[0])

    # Cut every prompt into 512-token blocks. A block's identity is (its text pieces): the prefix up to and
    # including it. Ids are assigned in order of first use.
    ids: dict[tuple, int] = {}
    lines = []
    for t, pieces, out in flat:
        tokens = sum(n for _, n in pieces)
        # Walk the concatenated pieces block by block; the key of block i is the tuple of (piece, offset)
        # boundaries covering tokens [0, 512*(i+1)), i.e. the whole prefix, as prefix hashing does.
        hash_ids = []
        prefix_key = 0
        pos = 0
        piece_iter = iter(pieces)
        cur, cur_len = next(piece_iter)
        cur_off = 0
        while pos < tokens:
            take_total = min(BLOCK, tokens - pos)
            parts = []
            need = take_total
            while need > 0:
                avail = cur_len - cur_off
                if avail == 0:
                    cur, cur_len = next(piece_iter)
                    cur_off = 0
                    continue
                n = min(avail, need)
                parts.append((cur, cur_off, n))
                cur_off += n
                need -= n
            pos += take_total
            # Chain the parent's key, as prefix-cache block hashes do: equal keys mean equal prefixes.
            key = prefix_key = hash((prefix_key, tuple(parts)))
            if key not in ids:
                ids[key] = len(ids)
            hash_ids.append(ids[key])
        lines.append({"timestamp": int(t * 1000), "input_length": tokens, "output_length": out, "hash_ids": hash_ids})
    return lines


def _azure_rows(seconds: float, rate: float, ctx, gen, seed: int) -> list[tuple[str, int, int]]:
    rng = random.Random(seed)
    t0 = datetime(2023, 11, 16, 18, 15, 46, 680590)
    rows = []
    t = 0.0
    while t < seconds:
        stamp = (t0 + timedelta(seconds=t)).strftime("%Y-%m-%d %H:%M:%S.%f") + str(rng.randrange(10))
        rows.append((stamp, ctx(rng), gen(rng)))
        t += rng.expovariate(rate)
    return rows


def azure_code(seconds: float = 300.0, seed: int = 0) -> list[tuple[str, int, int]]:
    return _azure_rows(
        seconds, 2.57,
        lambda r: _lognormal(r, 1469, 0.80, 3, 7743),
        lambda r: _lognormal(r, 13, 1.20, 1, 1500),
        seed,
    )


def azure_conv(seconds: float = 300.0, seed: int = 0) -> list[tuple[str, int, int]]:
    def gen(r: random.Random) -> int:
        # Nearly bimodal: short acknowledgements and full answers (Splitwise, Fig. 3).
        if r.random() < 0.3:
            return _lognormal(r, 25, 0.8, 1, 200)
        return int(min(1000, max(20, r.gauss(270, 140))))

    return _azure_rows(seconds, 5.53, lambda r: _lognormal(r, 1020, 0.50, 2, 14050), gen, seed)


def _write_csv(path: Path, rows: list[tuple[str, int, int]]) -> None:
    with path.open("w", encoding="utf-8") as fh:
        fh.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for stamp, c, g in rows:
            fh.write(f"{stamp},{c},{g}\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mooncake-seconds", type=float, default=600.0)
    ap.add_argument("--azure-seconds", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("mooncake", "azure-code", "azure-conv"))
    ap.add_argument("--out", type=Path, help="output file (with --only)")
    args = ap.parse_args(argv)
    todo = [args.only] if args.only else ["mooncake", "azure-code", "azure-conv"]
    for what in todo:
        if what == "mooncake":
            path = args.out or HERE / "mooncake_synthetic_sample.jsonl"
            lines = mooncake_synthetic(args.mooncake_seconds, args.seed)
            with path.open("w", encoding="utf-8") as fh:
                for rec in lines:
                    fh.write(json.dumps(rec, separators=(", ", ": ")) + "\n")
        elif what == "azure-code":
            path = args.out or HERE / "azure_code_sample.csv"
            _write_csv(path, azure_code(args.azure_seconds, args.seed))
        else:
            path = args.out or HERE / "azure_conv_sample.csv"
            _write_csv(path, azure_conv(args.azure_seconds, args.seed + 1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
