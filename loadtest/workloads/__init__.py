"""Workloads: published traces (Mooncake jsonl, Azure CSV) and seeded synthetic generators.

`load_workload(spec)` is the one entry point every tool uses, so `run`, `compare` and `replay` accept the
same specs:

- a path to a ``.jsonl`` (Mooncake) or ``.csv`` (Azure) file, or ``mooncake:PATH`` / ``azure:PATH``;
- ``mooncake`` / ``azure-code`` / ``azure-conv``: the real trace under ``../shared/traces`` when that
  folder exists, else the small synthetic look-alike shipped in ``loadtest/traces``;
- ``mix``, ``chat``, ``sysprompt``, ``lora``, optionally with parameters: ``chat:sessions=50,think_s=5``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from loadtest.workloads.azure import read_azure
from loadtest.workloads.model import (
    CHAT,
    COMPLETIONS,
    Message,
    Workload,
    WorkItem,
    build_body,
    parse_window,
)
from loadtest.workloads.mooncake import TraceFormatError, read_mooncake
from loadtest.workloads.synthetic import GENERATORS
from loadtest.workloads.text import BlockText, Segment

__all__ = [
    "CHAT", "COMPLETIONS", "BlockText", "Message", "Segment", "TraceFormatError", "Workload", "WorkItem",
    "build_body", "load_workload", "parse_window", "find_trace",
]

REPO = Path(__file__).resolve().parents[2]
SHARED_TRACES = REPO.parent / "shared" / "traces"
SAMPLES = REPO / "loadtest" / "traces"

# (glob under ../shared/traces, shipped sample) for each named trace.
_NAMED = {
    "mooncake": ("**/synthetic_trace*.jsonl", "mooncake_synthetic_sample.jsonl"),
    "mooncake-conversation": ("**/conversation_trace*.jsonl", None),
    "mooncake-toolagent": ("**/toolagent_trace*.jsonl", None),
    "azure-code": ("**/AzureLLMInferenceTrace_code*.csv", "azure_code_sample.csv"),
    "azure-conv": ("**/AzureLLMInferenceTrace_conv*.csv", "azure_conv_sample.csv"),
}


def find_trace(name: str, *, prefer_sample: bool = False) -> Path:
    """The real trace when ../shared/traces has it (unless `prefer_sample`), else the shipped sample."""
    if name not in _NAMED:
        raise ValueError(f"unknown trace {name!r}; known: {', '.join(sorted(_NAMED))}")
    pattern, sample = _NAMED[name]
    if not prefer_sample and SHARED_TRACES.is_dir():
        found = sorted(SHARED_TRACES.glob(pattern))
        if found:
            return found[0]
    if sample is None:
        raise FileNotFoundError(f"trace {name!r} needs {SHARED_TRACES}/{pattern}; no sample is shipped")
    return SAMPLES / sample


def _coerce(value: str, like: Any) -> Any:
    if isinstance(like, bool):
        return value.lower() in ("1", "true", "yes")
    if isinstance(like, int):
        return int(value)
    if isinstance(like, float):
        return float(value)
    if isinstance(like, tuple):
        a, b = value.split("-", 1)
        return (type(like[0])(a), type(like[1])(b))
    return value


def _synthetic(kind: str, args: str, seed: int | None) -> Workload:
    fn, params_cls = GENERATORS[kind]
    defaults = params_cls()
    changes: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in args.split(","))):
        key, _, value = part.partition("=")
        if not hasattr(defaults, key):
            fields = ", ".join(f.name for f in dataclasses.fields(params_cls))
            raise ValueError(f"{kind}: unknown parameter {key!r} (parameters: {fields})")
        changes[key] = _coerce(value, getattr(defaults, key))
    if seed is not None and "seed" not in changes:
        changes["seed"] = seed
    return fn(dataclasses.replace(defaults, **changes))


def load_workload(
    spec: str,
    *,
    seed: int | None = None,
    limit: int | None = None,
    prefer_sample: bool = False,
    system_prompt_tokens: int = 0,
) -> Workload:
    kind, _, rest = spec.partition(":")
    if kind in GENERATORS:
        w = _synthetic(kind, rest, seed)
        return w.window(limit=limit) if limit else w
    if kind == "mooncake" and rest:
        return read_mooncake(rest, limit=limit)
    if kind == "azure" and rest:
        return read_azure(rest, limit=limit, system_prompt_tokens=system_prompt_tokens)
    if spec in _NAMED:
        path = find_trace(spec, prefer_sample=prefer_sample)
        return load_workload(str(path), limit=limit, system_prompt_tokens=system_prompt_tokens)
    path = Path(spec)
    if path.suffix == ".jsonl":
        return read_mooncake(path, limit=limit)
    if path.suffix == ".csv":
        return read_azure(path, limit=limit, system_prompt_tokens=system_prompt_tokens)
    raise ValueError(
        f"unknown workload {spec!r}: give a .jsonl/.csv path, mooncake:PATH, azure:PATH, "
        f"one of {sorted(_NAMED)} or a generator {sorted(GENERATORS)}[:k=v,...]"
    )
