"""Azure LLM inference traces (2023, Splitwise; 2024, DynamoLLM): CSV with ``TIMESTAMP``,
``ContextTokens``, ``GeneratedTokens``.

Format as published at github.com/Azure/AzurePublicDataset (AzureLLMInferenceTrace_{code,conv}.csv;
timestamps like ``2023-11-16 18:15:46.6805900``, the 2024 files add a UTC offset). The traces carry no
content hashes, so nothing can be said about shared prefixes: every prompt gets blocks of its own, and the
one-cache bound is 0 unless `system_prompt_tokens` prepends one shared prefix to every request (a what-if).
"""

from __future__ import annotations

import csv
import itertools
from datetime import datetime, timezone
from pathlib import Path

from loadtest.workloads.model import Workload, WorkItem
from loadtest.workloads.mooncake import TraceFormatError
from loadtest.workloads.text import Segment, segments_for

AZURE_BLOCK_TOKENS = 512
_SYSTEM_BLOCK_BASE = 1 << 40  # ids of the optional shared system prompt, far from the per-request ids


def parse_timestamp(value: str) -> float:
    """Seconds since the epoch; more than 6 fractional digits are truncated, no offset means UTC."""
    s = value.strip()
    offset = ""
    for sep in ("+", "Z"):
        idx = s.rfind(sep)
        if idx > 10:
            s, offset = s[:idx], s[idx:]
            break
    if "." in s:
        base, frac = s.split(".", 1)
        s = f"{base}.{(frac + '000000')[:6]}"
    dt = datetime.fromisoformat(s.replace("T", " ") + ("+00:00" if offset in ("", "Z") else offset))
    return dt.astimezone(timezone.utc).timestamp()


def read_azure(
    path: str | Path,
    *,
    block_tokens: int = AZURE_BLOCK_TOKENS,
    limit: int | None = None,
    system_prompt_tokens: int = 0,
) -> Workload:
    path = Path(path)
    ids = itertools.count(0)
    fresh = ids.__next__
    rows: list[tuple[float, int, int]] = []
    with path.open("r", encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if reader.fieldnames is None or not need.issubset({f.strip() for f in reader.fieldnames}):
            raise TraceFormatError(f"{path}: expected columns {sorted(need)}, got {reader.fieldnames}")
        for lineno, row in enumerate(reader, 2):
            row = {k.strip(): v for k, v in row.items() if k is not None}
            try:
                rows.append((parse_timestamp(row["TIMESTAMP"]), int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            except (ValueError, TypeError) as exc:
                raise TraceFormatError(f"{path}:{lineno}: bad Azure trace row ({exc})") from exc
            if limit is not None and len(rows) >= limit:
                break
    rows.sort()
    base = rows[0][0] if rows else 0.0
    sys_segs: tuple[Segment, ...] = ()
    if system_prompt_tokens > 0:
        sys_ids = iter(range(_SYSTEM_BLOCK_BASE, _SYSTEM_BLOCK_BASE + 1_000_000))
        sys_segs = segments_for([], system_prompt_tokens, block_tokens, fresh=sys_ids.__next__)
    items = [
        WorkItem(
            t=ts - base,
            input_tokens=n_in + system_prompt_tokens,
            output_tokens=max(1, n_out),
            segments=sys_segs + segments_for([], max(1, n_in), block_tokens, fresh=fresh),
        )
        for ts, n_in, n_out in rows
    ]
    return Workload(f"azure:{path.stem}", items, block_tokens, namespace=2, source=str(path))
