"""Mooncake (FAST'25) traces: one JSON object a line, ``timestamp`` (ms), ``input_length``, ``output_length``,
``hash_ids`` (remapped ids of 512-token prefix blocks; equal ids mean a reusable prefix).

Format as published at github.com/kvcache-ai/Mooncake (FAST25-release/traces, and the earlier
``mooncake_trace.jsonl``). Extra keys (e.g. ``session_id`` in derived traces) are ignored.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from loadtest.workloads.model import Workload, WorkItem
from loadtest.workloads.text import segments_for

MOONCAKE_BLOCK_TOKENS = 512


class TraceFormatError(ValueError):
    """A trace line that cannot be read; the message names the file and line."""


def read_mooncake(path: str | Path, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS, limit: int | None = None) -> Workload:
    path = Path(path)
    items: list[WorkItem] = []
    # Ids for blocks a line's hash_ids do not cover; negative so they never meet a published id.
    fresh_ids = itertools.count(-1, -1)
    fresh = fresh_ids.__next__
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
                ts = float(rec["timestamp"]) / 1000.0
                n_in = int(rec["input_length"])
                n_out = int(rec["output_length"])
                ids = rec.get("hash_ids") or []
                if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                    raise TypeError("hash_ids must be a list of integers")
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceFormatError(f"{path}:{lineno}: not a Mooncake trace line ({exc})") from exc
            if n_in < 0 or n_out < 0:
                raise TraceFormatError(f"{path}:{lineno}: negative length")
            items.append(
                WorkItem(
                    t=ts,
                    input_tokens=n_in,
                    output_tokens=max(1, n_out),
                    segments=segments_for(ids, n_in, block_tokens, fresh=fresh),
                )
            )
            if limit is not None and len(items) >= limit:
                break
    items.sort(key=lambda it: it.t)
    if items and items[0].t != 0.0:
        base = items[0].t
        items = [WorkItem(it.t - base, it.input_tokens, it.output_tokens, it.segments) for it in items]
    return Workload(f"mooncake:{path.stem}", items, block_tokens, namespace=1, source=str(path))
