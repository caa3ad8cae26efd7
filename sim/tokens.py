"""The simulator's tokens: whitespace-separated words in, words from a fixed 1,024-word vocabulary out.

Generated text must be deterministic (the same request gives the same answer, so a multi-turn chat that
sends the answer back as context hits the blocks cached while it was generated) and cheap (one multiply
per token). A 64-bit LCG seeded from the request walks the vocabulary; its top 10 bits pick the word.
"""

from __future__ import annotations

import math

import xxhash

_ONSETS = "b d f g h k l m n p r s t v z y".split() + "ch sh th br dr gr kr pl tr st sk sl sn sp sw wh".split()
_NUCLEI = "a e i o u ai ea ee oo ou ie oa ar er or ur".split() + "an en in on un al el il ol ul am em im om um ay".split()

VOCAB: tuple[str, ...] = tuple(o + n for o in _ONSETS for n in _NUCLEI)
assert len(VOCAB) == 1024 and len(set(VOCAB)) == 1024

_MASK = (1 << 64) - 1
_MUL = 6364136223846793005
_INC = 1442695040888963407


def request_seed(engine_seed: int, model: str, prompt_text: str, temperature: float) -> int:
    """Seed for one request's output: equal requests give equal completions."""
    return xxhash.xxh3_64_intdigest(f"{model}\x1f{temperature:.6g}\x1f{prompt_text}".encode("utf-8", "surrogatepass"), seed=engine_seed & _MASK)


class TextGenerator:
    """Deterministic word stream for one request."""

    __slots__ = ("_state",)

    def __init__(self, seed: int) -> None:
        self._state = seed | 1

    def next_word(self) -> str:
        self._state = (self._state * _MUL + _INC) & _MASK
        return VOCAB[self._state >> 54]

    def uniform(self) -> float:
        self._state = (self._state * _MUL + _INC) & _MASK
        return ((self._state >> 11) + 0.5) / float(1 << 53)


def sample_output_len(seed: int, median: float, max_tokens: int) -> int:
    """Output length when generation may stop early: log-normal around `median` (sigma 0.8), capped.

    Chat outputs in ShareGPT-like traces are roughly log-normal with a long tail; the cap is `max_tokens`
    (finish_reason "length"), anything shorter ends with "stop".
    """
    gen = TextGenerator(seed ^ 0x9E3779B97F4A7C15)
    u1, u2 = gen.uniform(), gen.uniform()
    z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
    length = int(round(median * math.exp(0.8 * z)))
    return max(1, min(max_tokens, length))
