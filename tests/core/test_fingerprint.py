"""Exact fingerprints, chained prefix-block hashes and the distinguishing-prefix hash key."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.fingerprint import Fingerprinter, block_hashes, chain_seed, exact_fingerprint
from proxy.core.request import RequestSummary, estimate_tokens, summary_from_openai
from proxy.core.routing_config import AffinityConfig

from .helpers import chat, prompt

FIELDS = AffinityConfig().fingerprint_fields


def fp(req: RequestSummary, fields=FIELDS) -> int:
    return exact_fingerprint(req, fields)


def test_fingerprint_combines_prompt_max_tokens_and_temperature():
    base = prompt("tell me a story", max_tokens=64, temperature=0.7)
    assert fp(base) == fp(prompt("tell me a story", max_tokens=64, temperature=0.7))
    assert fp(base) != fp(prompt("tell me a story!", max_tokens=64, temperature=0.7))
    assert fp(base) != fp(prompt("tell me a story", max_tokens=65, temperature=0.7))
    assert fp(base) != fp(prompt("tell me a story", max_tokens=64, temperature=0.8))
    assert fp(base) != fp(prompt("tell me a story", max_tokens=64, temperature=None))
    assert fp(prompt("x", temperature=0.0)) != fp(prompt("x", temperature=None))


def test_fingerprint_fields_are_configurable():
    only_prompt = ("prompt",)
    a = prompt("same", max_tokens=1, temperature=0.1, model="a")
    b = prompt("same", max_tokens=2, temperature=0.9, model="b")
    assert fp(a, only_prompt) == fp(b, only_prompt)
    assert fp(a, ("prompt", "model")) != fp(b, ("prompt", "model"))
    assert fp(a, ("max_tokens",)) != fp(b, ("max_tokens",))
    assert fp(prompt("one", max_tokens=1), ("max_tokens",)) == fp(prompt("two", max_tokens=1), ("max_tokens",))


@given(st.binary(max_size=2000), st.binary(max_size=2000), st.integers(min_value=16, max_value=300))
@settings(max_examples=150, deadline=None)
def test_block_hashes_are_equal_exactly_on_the_shared_prefix(a, b, block):
    seed = chain_seed("m", None)
    ha, hb = block_hashes(a, block, seed), block_hashes(b, block, seed)
    assert len(ha) == len(a) // block
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    shared_blocks = common // block
    for i in range(min(len(ha), len(hb))):
        assert (ha[i] == hb[i]) == (i < shared_blocks)


def test_chain_is_seeded_by_model_and_adapter():
    data = b"x" * 1024
    hashes = {
        tuple(block_hashes(data, 256, chain_seed(m, ad)))
        for m, ad in [("m", None), ("m", ""), ("n", None), ("m", "lora-1"), (None, None)]
    }
    assert len(hashes) == 5


def test_keys_for_a_chat_share_hash_key_across_turns_but_not_across_conversations():
    f = Fingerprinter(AffinityConfig())
    system = "You are a careful assistant. " * 30
    t1 = chat([("system", system), ("user", "What is the capital of France?")])
    t2 = chat(
        [("system", system), ("user", "What is the capital of France?"), ("assistant", "Paris. " * 40),
         ("user", "And of Italy?")]
    )
    other = chat([("system", system), ("user", "Summarise the French revolution.")])
    k1, k2, ko = f.keys(t1), f.keys(t2), f.keys(other)
    assert k1.structured and k2.structured
    assert k1.hash_key == k2.hash_key != ko.hash_key
    # The system prompt is a shared prefix of all three: their leading blocks agree.
    b1, b2, bo = f.blocks(k1), f.blocks(k2), f.blocks(ko)
    assert b1[:3] == bo[:3] and b2[: len(b1)] == b1 and len(b2) > len(b1)
    assert k1.fingerprint != k2.fingerprint


def test_unstructured_hash_key_covers_the_prompt_up_to_the_cap():
    cfg = AffinityConfig(block_bytes=64, hash_prefix_max_blocks=4)
    f = Fingerprinter(cfg)
    shared = "s" * 200
    a, b = f.keys(prompt(shared + "aaa")), f.keys(prompt(shared + "bbb"))
    assert not a.structured and a.hash_key != b.hash_key  # differ after the first 3 blocks
    long_a, long_b = f.keys(prompt("p" * 256 + "tail-a")), f.keys(prompt("p" * 256 + "tail-b"))
    assert long_a.hash_key == long_b.hash_key  # identical within the 4-block cap


def test_structured_key_is_byte_exact_for_non_ascii():
    f = Fingerprinter(AffinityConfig())
    a = f.keys(chat([("system", "Système " * 50), ("user", "café ?")]))
    b = f.keys(chat([("system", "Système " * 50), ("user", "café ?"), ("assistant", "oui"), ("user", "et ça")]))
    c = f.keys(chat([("system", "Système " * 50), ("user", "café !")]))
    assert a.hash_key == b.hash_key != c.hash_key


def test_summary_marks_the_first_non_system_message():
    s = summary_from_openai(
        "/v1/chat/completions",
        {"messages": [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"},
                      {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]},
    )
    assert s.prompt[: s.key_prefix_chars] == "system\nS\ndeveloper\nD\nuser\nU\n"
    assert summary_from_openai("/v1/completions", {"prompt": "abc"}).key_prefix_chars is None


def test_estimate_tokens_ascii_fast_path_matches_bytes():
    for text in ["", "a", "abcd", "abcde", "é" * 5, "日本語テキスト", "x" * 4097]:
        assert estimate_tokens(text) == (len(text.encode()) + 3) // 4


def test_non_ascii_and_surrogates_hash():
    f = Fingerprinter(AffinityConfig(block_bytes=16))
    k = f.keys(prompt("héllo wörld 日本 \udcff" * 10))
    assert len(f.blocks(k)) == len(prompt("héllo wörld 日本 \udcff" * 10).prompt_bytes) // 16
