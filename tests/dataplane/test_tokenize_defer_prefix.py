"""`PreciseMatcher(defer_prefix=True)`: a prompt too long to tokenise on the loop is answered from its
leading chunks (issue 13: a continuation whose earlier turns another worker or replica tokenised)."""

from __future__ import annotations

import random

from proxy.core.kv_index import KVIndex
from proxy.core.request import RequestSummary
from proxy.dataplane.tokenize import ModelTokenizer, PreciseMatcher
from sim.tokenizer import TOKENIZER_DIR, token_ids

from .test_tokenize import _text


def _index_holding(ids: list[int], blocks: int) -> KVIndex:
    index = KVIndex()
    index.track("b0", model="m")
    index.stored("b0", tuple(range(1, blocks + 1)), None, ids[: 16 * blocks], 16)
    index.mark_fresh("b0")
    return index


async def test_a_deferred_prompt_is_answered_from_its_leading_chunks() -> None:
    text = _text(random.Random(7), 3000)
    ids = token_ids(text)
    index = _index_holding(ids, 8)  # the engine holds the first 128 tokens (an earlier turn)
    tok = ModelTokenizer.from_dir(TOKENIZER_DIR, offload_chars=5000)
    assert len(text) > tok.offload_chars
    head = tok.leading_text(text, tok.offload_chars)
    assert 0 < len(head) <= tok.offload_chars and text.startswith(head)
    assert token_ids(head) == ids[: len(token_ids(head))]  # cut on a token boundary
    off = PreciseMatcher(index, {"m": tok})
    assert off(RequestSummary(prompt=text, model="m", endpoint="/v1/completions")) is None
    on = PreciseMatcher(index, {"m": ModelTokenizer.from_dir(TOKENIZER_DIR, offload_chars=5000)}, defer_prefix=True)
    got = on(RequestSummary(prompt=text, model="m", endpoint="/v1/completions"))
    assert on.deferred == 1
    assert got is not None and got.cached == {"b0": 128}
    assert abs(got.prompt_tokens - len(ids)) < 0.1 * len(ids)  # the whole prompt, estimated from the head


def test_the_leading_text_counts_only_chunks_not_cached_yet() -> None:
    tok = ModelTokenizer.from_dir(TOKENIZER_DIR, offload_chars=5000)
    text = _text(random.Random(8), 4000)
    first = tok.leading_text(text, 5000)
    tok.encode(first)  # now cached: the next call reaches further for the same budget
    assert len(tok.leading_text(text, 5000)) > len(first)
    assert tok.leading_text(text, 0) == first  # cached chunks cost nothing
    assert ModelTokenizer.from_dir(TOKENIZER_DIR).leading_text(text, 0) == ""
