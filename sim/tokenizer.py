"""The simulated model's tokenizer: a Hugging Face WordLevel tokenizer that splits on whitespace.

Peer routers (sglang-router) load the worker's tokenizer from the folder its `/model_info` names; shipping a
real `tokenizer.json` whose tokens are exactly the simulator's tokens (whitespace-separated words) lets
them run here without a model hub. Words of the output vocabulary and chat roles have fixed ids; any other
word gets a stable id above the vocabulary (xxhash), so `/tokenize` and the render endpoints return ids that
differ where words differ - which is what a cache-aware router keys on.

The fixed vocabulary also holds the load generator's words (`loadtest/workloads/text.py` VOCABULARY, the
text every trace replay sends, rebuilt here so `sim` does not import `loadtest`), so the shipped
`tokenizer.json` reproduces `token_ids` exactly for the simulator's own output, chat roles and load-test
prompts: the proxy's precise KV index tokenises with that file and must get the ids the KV events carry.
Other words get a hashed id here but `[UNK]` from the file (a WordLevel model cannot hash); prompts made of
them still route, only without precise KV matches. The chat template reproduces `sim.api.render_chat`
plus the generation prompt the server adds when the last message is not the assistant's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import xxhash

from .tokens import VOCAB

TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer"
SPECIAL_TOKENS = ("[UNK]", "<s>", "</s>")
ROLE_TOKENS = ("system", "user", "assistant", "tool")
_CONSONANTS = "bcdfghjklmnprstvz"
_VOWELS = "aeiou"
LOADTEST_WORDS: tuple[str, ...] = tuple(
    c1 + v1 + c2 + v2 for c1 in _CONSONANTS for v1 in _VOWELS for c2 in _CONSONANTS for v2 in _VOWELS
)
_WORDS: tuple[str, ...] = SPECIAL_TOKENS + ROLE_TOKENS + VOCAB + LOADTEST_WORDS
WORD_IDS: dict[str, int] = {w: i for i, w in enumerate(_WORDS)}
VOCAB_SIZE = len(_WORDS)
_HASHED_IDS = 1 << 30
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}{{ '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is iterable and message['content'] is not mapping %}"
    "{% for part in message['content'] if part is string or (part is mapping and part.get('type') == 'text') %}"
    "{% if not loop.first %}{{ '\n' }}{% endif %}"
    "{% if part is string %}{{ part }}{% else %}{{ part.get('text', '') }}{% endif %}{% endfor %}"
    "{% elif message['content'] is not none %}{{ message['content'] }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt and messages[-1]['role'] != 'assistant' %}assistant{{ '\n' }}{% endif %}"
)


def token_id(word: str) -> int:
    known = WORD_IDS.get(word)
    if known is not None:
        return known
    return VOCAB_SIZE + xxhash.xxh32_intdigest(word.encode("utf-8", "surrogatepass")) % _HASHED_IDS


def token_ids(text: str) -> list[int]:
    return [token_id(w) for w in text.split()]


def token_str(tid: int) -> str:
    return _WORDS[tid] if 0 <= tid < VOCAB_SIZE else f"<{tid}>"


def tokenizer_files(model_name: str, max_model_len: int) -> dict[str, Any]:
    """The folder's files as JSON values (written by `write_tokenizer_dir`, checked by the tests)."""
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": dict(WORD_IDS), "unk_token": "[UNK]"},
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "[UNK]",
        "model_max_length": max_model_len,
        "chat_template": CHAT_TEMPLATE,
    }
    model_config = {
        "_name_or_path": model_name,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "max_position_embeddings": max_model_len,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config, "config.json": model_config}


def write_tokenizer_dir(path: Path = TOKENIZER_DIR, model_name: str = "sim", max_model_len: int = 8192) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, value in tokenizer_files(model_name, max_model_len).items():
        (path / name).write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    write_tokenizer_dir()
