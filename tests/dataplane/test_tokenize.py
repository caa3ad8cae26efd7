"""The model tokenizer: the simulator's tokenizer folder reproduces the simulator's own token ids, through
the real code path (HF tokenizers + the jinja2 chat template), and the chunk cache is exact."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from proxy.core.request import RequestSummary
from proxy.dataplane.tokenize import ModelTokenizer, PreciseMatcher, TokenizerError, cut_points
from sim.server import SimHttpApp
from sim.tokenizer import LOADTEST_WORDS, ROLE_TOKENS, TOKENIZER_DIR, token_ids
from sim.tokens import VOCAB


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return ModelTokenizer.from_dir(TOKENIZER_DIR, chunk_chars=64)


def _text(rng: random.Random, n: int) -> str:
    words = VOCAB + LOADTEST_WORDS + ROLE_TOKENS
    seps = [" ", " ", " ", "\n", "  ", "\t", " \n "]
    return "".join(rng.choice(words) + rng.choice(seps) for _ in range(n)).strip()


def _sim_chat(messages: list[dict]) -> str:
    return SimHttpApp._chat_prompt({"messages": messages})  # what the simulator's chat endpoint runs


def test_load_test_words_are_the_load_generators_vocabulary() -> None:
    from loadtest.workloads.text import VOCABULARY

    assert LOADTEST_WORDS == VOCABULARY


def test_text_ids_equal_the_simulators(tok: ModelTokenizer) -> None:
    assert tok.chunked
    rng = random.Random(3)
    for n in (1, 5, 40, 700):
        text = _text(rng, n)
        assert tok.encode(text) == token_ids(text)
        assert tok.encode(text) == token_ids(text)  # cached answer is the same


def test_chat_ids_equal_the_simulators(tok: ModelTokenizer) -> None:
    cases = [
        [{"role": "system", "content": "ba be bi"}, {"role": "user", "content": "dar der\nbaba"}],
        [{"role": "user", "content": [{"type": "text", "text": "bo bu"}, "bai", {"type": "image_url"},
                                      {"type": "text", "text": "bea"}]}],
        [{"role": "user", "content": None}, {"role": "assistant", "content": "ban ben"}],
        [{"role": "tool", "content": "bin"}],
    ]
    for messages in cases:
        assert tok.render_chat(messages) == _sim_chat(messages)
        assert tok.encode_chat(messages) == token_ids(_sim_chat(messages))
    with pytest.raises(TokenizerError):
        ModelTokenizer(Tokenizer(models.WordLevel({"a": 0}, unk_token="a")), {}).render_chat([])


def test_a_continuation_only_tokenises_its_new_tail(tok: ModelTokenizer) -> None:
    rng = random.Random(9)
    first = _text(rng, 400)
    tok.encode(first)
    misses = tok.misses
    more = first + " " + _text(rng, 50)
    assert tok.encode(more) == token_ids(more)
    assert tok.misses - misses <= 1 + (len(more) - len(first)) // 64 + 1
    assert tok.uncached_chars(more) == 0


def test_cut_points_end_before_a_single_space_between_words() -> None:
    text = "aaaa bbbb  cccc dddd\neeee ffff"
    ends = cut_points(text, 3)
    assert ends[-1] == len(text)
    for e in ends[:-1]:
        assert text[e] == " " and not text[e - 1].isspace() and not text[e + 1].isspace()
    assert cut_points("short", 100) == [5]


def test_a_tokenizer_that_merges_across_cuts_falls_back_to_whole_prompts() -> None:
    vocab = {w: i for i, w in enumerate(["[UNK]", "▁The", "▁quick", "▁brown", "▁▁quick"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok = ModelTokenizer(raw, {})
    assert not tok.chunked
    text = "The quick brown " * 50
    assert tok.encode(text) == raw.encode(text, add_special_tokens=False).ids


def test_bad_folder_is_a_tokenizer_error(tmp_path) -> None:
    with pytest.raises(TokenizerError):
        ModelTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text((TOKENIZER_DIR / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{% for %}"}')
    with pytest.raises(TokenizerError):
        ModelTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ raise_exception(\'no system\') }}"}')
    with pytest.raises(TokenizerError, match="no system"):
        ModelTokenizer.from_dir(tmp_path).render_chat([{"role": "user", "content": "x"}])


async def test_big_uncached_prompts_are_tokenised_off_the_event_loop() -> None:
    tok = ModelTokenizer.from_dir(TOKENIZER_DIR, offload_chars=1000)
    threads: list[int] = []
    real = tok._raw

    def spy(text: str) -> list[int]:
        threads.append(threading.get_ident())
        return real(text)

    tok._raw = spy  # type: ignore[method-assign]
    big = _text(random.Random(1), 2000)
    assert await tok.encode_async(big) == token_ids(big)
    assert threads and all(t != threading.get_ident() for t in threads)
    threads.clear()
    assert await tok.encode_async(big) == token_ids(big)  # cached: answered inline, nothing tokenised
    assert threads == []
    small = "ba be"
    assert await tok.encode_chat_async([{"role": "user", "content": small}]) == token_ids("user\nba be\nassistant\n")
    assert threads == [threading.get_ident()]
    await asyncio.sleep(0)


async def test_precise_matcher_tokenises_small_prompts_inline_and_defers_big_ones() -> None:
    from proxy.core.kv_index import KVIndex
    from proxy.core.request import RequestSummary

    index = KVIndex()
    index.track("b0", model="m")
    text = _text(random.Random(4), 64)
    ids = token_ids(text)
    index.stored("b0", (1, 2), None, ids[:32], 16)
    tok = ModelTokenizer.from_dir(TOKENIZER_DIR, offload_chars=5000)
    matcher = PreciseMatcher(index, {"m": tok})
    req = RequestSummary(prompt=text, model="m", endpoint="/v1/completions")
    assert matcher(req) is None  # no fresh backend: nothing to ask, nothing tokenised
    index.mark_fresh("b0")
    got = matcher(req)
    assert got is not None and got.prompt_tokens == len(ids) and got.cached == {"b0": 32}
    chat_req = RequestSummary(prompt="user\n" + text + "\n", model="m", endpoint="/v1/chat/completions")
    assert matcher(chat_req).prompt_tokens == len(ids) + 2  # no messages: flattened + generation prompt
    from proxy.core.request import summary_from_openai

    msgs = [{"role": "user", "content": [{"type": "text", "text": text}]}, {"role": "assistant", "content": "ba"}]
    chat_msgs = summary_from_openai("/v1/chat/completions", {"model": "m", "messages": msgs})
    assert chat_msgs.messages == tuple(msgs)
    assert matcher(chat_msgs).prompt_tokens == len(token_ids(SimHttpApp._chat_prompt({"messages": msgs})))
    big = RequestSummary(prompt=_text(random.Random(5), 3000), model="m", endpoint="/v1/completions")
    assert matcher(big) is None and matcher.deferred == 1  # tokenised in the executor meanwhile
    for _ in range(200):
        if tok.uncached_chars(big.prompt) == 0:
            break
        await asyncio.sleep(0.01)
    assert matcher(big) is not None
    assert matcher(RequestSummary(prompt=text, model="unknown", endpoint="/v1/completions")) is not None  # default
    # text the Rust tokenizer rejects (a lone surrogate from a JSON escape): no answer, never an exception
    assert matcher(RequestSummary(prompt="ba \ud800 be", model="m", endpoint="/v1/completions")) is None
    assert matcher.errors == 1


def test_chat_requests_are_rendered_with_the_models_own_template() -> None:
    from proxy.core.kv_index import KVIndex
    from proxy.core.request import summary_from_openai

    raw = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    template = "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    tok = ModelTokenizer(raw, {"chat_template": template})
    index = KVIndex()
    index.track("b0", model="m")
    index.mark_fresh("b0")
    index.stored("b0", (1,), None, list(range(16)), 16)
    matcher = PreciseMatcher(index, {"m": tok})
    req = summary_from_openai("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "ba be"}]})
    assert matcher(req).prompt_tokens == len("<s> user ba be </s>".split())
    # without the messages (a gRPC extractor's summary) this template cannot be reproduced: no answer
    assert matcher(RequestSummary(prompt=req.prompt, model="m", endpoint="/v1/chat/completions")) is None


def test_the_cost_bench_says_its_usage_and_refuses_a_folder_without_a_tokenizer(tmp_path) -> None:
    # The README's "cost per request" command: `--help` is its usage, not a folder to load, and a folder
    # without tokenizer.json is a usage error, not a traceback.
    import subprocess
    import sys

    helped = subprocess.run([sys.executable, "-m", "proxy.dataplane.tokenize", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "usage: python -m proxy.dataplane.tokenize" in helped.stdout
    refused = subprocess.run([sys.executable, "-m", "proxy.dataplane.tokenize", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stderr
    assert "tokenizer.json" in refused.stderr and "Traceback" not in refused.stderr
