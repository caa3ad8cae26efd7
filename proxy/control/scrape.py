"""A targeted reader of the Prometheus text exposition: only the series the load score needs.

prometheus_client's parser builds every family, sample and label dict of an exposition: ~3-10 ms for a
300-line vLLM page on this kind of machine, which at 5 Hz over 64 backends is one to three cores. We need
about fifteen series out of hundreds, so one regex anchored at line starts picks out only those lines
(see `scan`): ~0.05 ms a page. Labels are only parsed for the few series that carry information in them
(cache_config_info, lora_requests_info, Triton's typed gauges).

The output agrees with prometheus_client's on every engine's fixture (tests/control/test_scrape.py).
"""

from __future__ import annotations

import functools
import re
from typing import Iterable

# (raw label text between the braces, value); labels are parsed on demand with `parse_labels`.
Sample = tuple[str, float]
Samples = dict[str, list[Sample]]

_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE_RE = re.compile(r"\\(.)")
_ESCAPES = {"n": "\n", "\\": "\\", '"': '"'}


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _UNESCAPE_RE.sub(lambda m: _ESCAPES.get(m.group(1), "\\" + m.group(1)), value)


@functools.lru_cache(maxsize=4096)
def _parse_labels_cached(raw: str) -> tuple[tuple[str, str], ...]:
    return tuple(_parse_labels(raw).items())


def parse_labels(raw: str) -> dict[str, str]:
    """`a="x",b="y \\"q\\""` -> {"a": "x", "b": 'y "q"'} (the exposition's escapes: \\\\, \\", \\n).

    Cached by the raw text: the same label sets come back on every scrape of every backend (a vLLM
    cache_config_info line has fifteen labels), so each is parsed once per process, not 5 times a second.
    """
    return dict(_parse_labels_cached(raw))


def _parse_labels(raw: str) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    n = len(raw)
    while pos < n:
        m = _LABEL_RE.match(raw, pos)
        if m is None:
            if raw[pos:].strip():
                raise ValueError(f"malformed labels: {raw!r}")
            break
        out[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
    return out


@functools.lru_cache(maxsize=64)
def _scanner(names: tuple[str, ...]) -> re.Pattern[str]:
    # The character after the name must open the labels or separate the value, so `x` never matches
    # `x_sum` (the optional tails of the trie backtrack). Greedy `.*}` stops at the last brace of the line,
    # which is right even when a label value contains one.
    return re.compile(r"\n(%s)(?:\{(.*)\})?[ \t]+(\S+)" % _trie(set(names)))


def _trie(names: set[str]) -> str:
    """A regex alternation factored by common prefixes (`vllm:(?:num_requests_(?:running|waiting)|...)`).

    Most lines of an engine's page share its prefix, so a flat alternation would re-match `vllm:` once
    per wanted name at every line start; the factored form matches it once.
    """
    root: dict[str, dict] = {}
    for name in names:
        node = root
        for ch in name:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, dict]) -> str:
        ends = "" in node
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch != ""]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        # Optional tail when a name ends here but longer ones continue; the [{ \t] after the group decides.
        return "(?:" + body + ")?" if ends else body

    return build(root)


def scan(text: str, names: Iterable[str]) -> Samples:
    """Every sample of the given sample names (histograms: ask for `x_sum`/`x_count`), in page order.

    One compiled regex whose literal prefix is the newline: the regex engine jumps from line start to
    line start in C and tries the wanted names there, so the cost is one pass over the page whatever the
    number of names (~40 us for a 300-line vLLM page, against ~100x that for a full parse). A name matches
    only as a whole sample name at the start of a line; `# HELP`/`# TYPE` lines are never read. A sample
    whose value does not parse is skipped: one bad line from an engine must not blind the router.
    """
    pattern = _scanner(names if isinstance(names, tuple) else tuple(names))
    out: Samples = {}
    for m in pattern.finditer(text if text.startswith("\n") else "\n" + text):
        try:
            value = float(m.group(3))  # accepts NaN, +Inf, -Inf and exponents, as the format allows
        except ValueError:
            continue
        name = m.group(1)
        sample = (m.group(2) or "", value)
        found = out.get(name)
        if found is None:
            out[name] = [sample]
        else:
            found.append(sample)
    return out


_SELECTOR_RE = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(.*)\})?\s*$")


def parse_selector(selector: str) -> tuple[str, dict[str, str]]:
    """`name{label="v"}` (as written in the YAML metric_map) -> (name, required labels)."""
    m = _SELECTOR_RE.match(selector)
    if m is None:
        raise ValueError(f"not a metric selector: {selector!r} (expected name or name{{label=\"value\"}})")
    return m.group(1), parse_labels(m.group(2) or "")


def select(samples: Samples, name: str, labels: dict[str, str] | None = None) -> list[float]:
    """Values of one sample name whose labels include `labels`."""
    found = samples.get(name)
    if not found:
        return []
    if not labels:
        return [v for _, v in found]
    out = []
    for raw, value in found:
        try:
            have = parse_labels(raw)
        except ValueError:
            continue
        if all(have.get(k) == v for k, v in labels.items()):
            out.append(value)
    return out
