"""The in-process HTTP/2 bridge benchmark measures what it says: every request it sends is answered, with
this tree's ways and with each of h2's/hpack's own put back (`--ablate`)."""

from __future__ import annotations

import pytest

from loadtest.bench_h2_bridge import one_round


@pytest.mark.parametrize("without", [frozenset(), frozenset({"encoder", "decoder"}), frozenset({"headers"}),
                                     frozenset({"whole"}), frozenset({"fast"})])
async def test_a_round_answers_every_request(without: frozenset[str]) -> None:
    # one_round raises SystemExit unless every request (including a last partial batch) ended its stream.
    assert await one_round(50, 3, without) > 0
