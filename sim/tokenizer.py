"""The simulated model's tokenizer: a Hugging Face WordLevel tokenizer that splits on whitespace.

Peer routers (sglang-router) load the worker's tokenizer from the folder its `/model_info` names; shipping a
real `tokenizer.json` whose tokens are exactly the simulator's tokens (whitespace-separated words) lets
them run here without a model hub. Words of the output vocabulary and chat roles have fixed ids; any other
word gets a stable id above the vocabulary (xxhash), so `/tokenize` and the render endpoints return ids that
differ where words differ - which is what a cache-aware router keys on.
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
_WORDS: tuple[str, ...] = SPECIAL_TOKENS + ROLE_TOKENS + VOCAB
WORD_IDS: dict[str, int] = {w: i for i, w in enumerate(_WORDS)}
VOCAB_SIZE = len(_WORDS)
_HASHED_IDS = 1 << 30
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant\n{% endif %}"
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
