"""The affinity pick and the OpenAI summary decide exactly as at round 4's branch point (a67f38f).

Round 4 (issue 19) made both cheaper without changing a single decision. These digests are of the
decision traces `loadtest/bench_core.py` generates (random fleets and requests in 8 configurations, 1,000
picks each, in-flight work fed back; 3,000 summaries of random valid and invalid bodies of every endpoint),
recorded on the branch point's code. A speed-up must leave them as they are; a change of behaviour that is
meant (a new rule, a retuned default) changes them: check it with `bench_core.py --diff TREE` against the
tree before the change, then record the new digests here with

    .venv/bin/python -c "import json, hashlib, loadtest.bench_core as b; print({c: hashlib.sha256(json.dumps(b._fuzz_trace(c, 1000, i)).encode()).hexdigest() for i, c in enumerate(b.TRACE_CASES)})"

(The peer-load configurations are left out: `_with_peers` is tuned on its own; `bench_core.py --diff` runs
them, and the replays of the Mooncake sample, against any tree.)
"""

from __future__ import annotations

import hashlib
import json

import pytest

from loadtest.bench_core import TRACE_CASES, _fuzz_trace, _summary_trace

BRANCH_POINT = {
    "default": "836bffffaab2d999909e2e8d6c979d2f7599f931278a490f85936cfacd400073",
    "wide": "51e39f201892f59125f1a64b3ab936cf32d972afa0ea1949ee5aea0ec5436496",
    "nocost": "e800b3bff4d879a8e9189bedb342e948f6d351234a134fa81f13e6f1b290ba25",
    "tight": "269edc9f49d1f191d8deb9ef6a24ce1debc771f5d54dafff73378cc17522fdfc",
    "weights": "85415975285f88d70309bdc3fa29d8dbb58c78b2c0bc27c279adc4618eca37ad",
    "nosession": "8a414755080f0f64ea7f29666c81a2b3d8aa17f66c5821d158195fae02cb1d61",
    "precise": "cf18426034070b4bcce0c95ce829a6a1f0bce4a72a0395e913c100abaec79659",
    "shared": "a447838dcdd39fabcf68acc2f673437b3d02426daa532ba27b1c77f151d17365",
}


def _digest(trace: list[object]) -> str:
    return hashlib.sha256(json.dumps(trace).encode()).hexdigest()


@pytest.mark.parametrize("seed, case", list(enumerate(TRACE_CASES)))
def test_the_pick_decides_as_at_the_branch_point(seed: int, case: str) -> None:
    trace = _fuzz_trace(case, 1000, seed)
    assert len(trace) == 1000
    reasons = {d[1] for d in trace if d[0] != "error"}  # the trace reaches the branches it is there for
    assert {"hash", "prefix_hit", "exact_hit", "balanced"} <= reasons, reasons
    assert _digest(trace) == BRANCH_POINT[case], f"{case}: decisions differ from the branch point's"


def test_the_summary_reads_bodies_as_at_the_branch_point() -> None:
    trace = _summary_trace(3000, 99)
    assert sum(isinstance(x, str) for x in trace) > 500  # summaries, not only errors
    assert _digest(trace) == "d01085967daa239cb918df6a4c55a2f5045b7e2b3f8accfc2b233541935117ed"
