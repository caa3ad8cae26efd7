"""Prompts to token ids with the model's own tokenizer, for the precise KV index (`proxy.core.kv_index`).

A model folder (the one vLLM loads, or the simulator's `sim/tokenizer/`) holds `tokenizer.json`, read by
Hugging Face `tokenizers`, and `tokenizer_config.json`, whose `chat_template` is rendered with jinja2 in the
environment `transformers.apply_chat_template` uses (sandboxed, trim_blocks, lstrip_blocks,
`raise_exception`, `tojson`, the special tokens as variables). Nothing is downloaded; the path comes from
the configuration (`telemetry.kv_events.tokenizers`).

Cost, and how it is kept off the request path:

- Cut points are content-defined: text is split into chunks of at least `chunk_chars` characters, each cut
  at the first "non-space, space, non-space" position after that length. A chunk's ids are cached (LRU,
  `cache_chunks` entries) by its text, so a repeated prompt, or a conversation that grows by one turn,
  re-tokenises only its new tail: the cut points of a shared prefix do not depend on what follows it.
- Tokenising chunks separately is exact only for tokenizers whose pre-tokenizer never merges across such a
  cut (whitespace, GPT-2/Llama-3 byte-level regexes, Metaspace); a normalizer that prepends to every input
  (Llama-2's `Prepend("▁")`) is not. `ModelTokenizer` checks this on load with probe texts and falls back
  to whole-prompt caching when a split would change the ids (`chunked` says which).
- `encode_async` / `encode_chat_async` run a tokenisation whose uncached part exceeds `offload_chars` in
  an executor (HF tokenizers release the GIL while encoding), so a 64k-token prompt does not stall the
  event loop; cached or short prompts are answered inline, cheaper than a thread hop.
- `PreciseMatcher.prepare` (the router's hook, before the pick) makes a request whose prompt needs that
  wait for its own tokenisation in the executor, at most `telemetry.kv_events.precise_wait_ms`: the loop
  stays free, only that request waits (tens of ms for 64k tokens, against the seconds of prefill a
  misrouted continuation costs), and its pick is precise even when another process tokenised its
  earlier turns.
- With `--workers N` the workers share what they tokenised (`shared`, proxy/dataplane/shared_chunks.py): a
  chunk missing from a worker's own cache is looked up among every worker's newest chunks before it is
  tokenised, so a conversation whose earlier turns another worker routed is not tokenised again.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Awaitable, Mapping, Sequence

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from xxhash import xxh3_64_intdigest

from proxy.dataplane.shared_chunks import SharedChunks

__all__ = ["ModelTokenizer", "PreciseMatcher", "TokenizerError", "cut_points", "tokenizer_folder_error"]

log = logging.getLogger(__name__)

# Upper bounds (seconds) of `PreciseMatcher`'s wait histogram (affinity_proxy_precise_wait_seconds).
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0)

# What a chat template is assumed to add per message to the flattened prompt (`role\ncontent\n`), so that
# `PreciseMatcher.prepare` can tell a short chat request without rendering it. A template that adds more
# leaves a prompt just over `offload_chars` to the learned index, as before the wait.
_TEMPLATE_CHARS = 256

_PROBES = (
    "The quick brown fox jumps over the lazy dog, again and again: 12345 67890 tokens.",
    "user\nhello there\nassistant\nGeneral Kenobi!  You are a bold one.\n",
    "def f(x):\n    return x + 1  # comment\n\n\nprint(f(2))",
)


class TokenizerError(ValueError):
    """The tokenizer folder or the chat template cannot be used (or the template raised)."""


_FOLDER_CHECKS: OrderedDict[tuple[str, tuple[tuple[int, int, int] | None, ...]], str | None] = OrderedDict()


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def tokenizer_folder_error(path: str) -> str | None:
    """Why `path` cannot serve as a model's tokenizer folder (what `ModelTokenizer.from_dir` raises), or
    None. The configuration's check (`telemetry.kv_events.tokenizers`, at load and on every reload); the
    answer is remembered per identity of the folder's two files, so re-reading an unchanged configuration
    does not load its tokenizers again."""
    folder = Path(path)
    key = (str(folder.resolve()), (_identity(folder / "tokenizer.json"), _identity(folder / "tokenizer_config.json")))
    if key in _FOLDER_CHECKS:
        _FOLDER_CHECKS.move_to_end(key)
        return _FOLDER_CHECKS[key]
    try:
        ModelTokenizer.from_dir(folder)
        error = None
    except Exception as exc:  # noqa: BLE001 - whatever a folder does to the loader is the config's error
        error = str(exc) if isinstance(exc, TokenizerError) else f"{folder}: {exc!r}"
    _FOLDER_CHECKS[key] = error
    if len(_FOLDER_CHECKS) > 64:
        _FOLDER_CHECKS.popitem(last=False)
    return error


def cut_points(text: str, chunk_chars: int) -> list[int]:
    """Chunk ends: each the first i >= start + chunk_chars with text[i-1] non-space, text[i] == " " and
    text[i+1] non-space (the chunk ends before the space); the last end is len(text)."""
    ends: list[int] = []
    start = 0
    n = len(text)
    while start + chunk_chars < n:
        i = text.find(" ", start + chunk_chars)
        while i != -1 and i + 1 < n and (text[i - 1].isspace() or text[i + 1].isspace()):
            i = text.find(" ", i + 1)
        if i == -1 or i + 1 >= n:
            break
        ends.append(i)
        start = i
    ends.append(n)
    return ends


class ModelTokenizer:
    """One model's tokenizer + chat template, with a chunk cache (safe to share between the event loop and
    executor threads: a chunk tokenised twice at once is simply stored twice). `shared`: the host's chunk
    block of a `--workers` worker, keyed by `identity` (a digest of the tokenizer, so that two tokenizers
    never read each other's ids); `from_dir` sets `identity` from tokenizer.json's bytes."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        config: Mapping[str, Any] | None = None,
        *,
        chunk_chars: int = 2048,
        cache_chunks: int = 16384,
        offload_chars: int = 32768,
        executor: Executor | None = None,
        shared: SharedChunks | None = None,
        identity: int = 0,
    ) -> None:
        if chunk_chars < 16:
            raise ValueError("chunk_chars must be >= 16")
        self._tok = tokenizer
        self.config = dict(config or {})
        self.chunk_chars = chunk_chars
        self.cache_chunks = cache_chunks
        self.offload_chars = offload_chars
        self._executor = executor
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._shared = shared
        self.identity = identity
        self.hits = 0  # chunks found in this process's cache
        self.shared_hits = 0  # ... in another worker's (copied into this cache)
        self.misses = 0  # chunks tokenised here
        template = self.config.get("chat_template")
        if isinstance(template, list):  # several named templates: use "default"
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
        self._template: jinja2.Template | None = None
        if isinstance(template, str):
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            try:
                self._template = env.from_string(template)
            except jinja2.TemplateError as exc:
                raise TokenizerError(f"chat_template does not compile: {exc}") from None
        self._specials = {k: _token_text(self.config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.chunked = self._split_is_exact()

    @classmethod
    def from_dir(cls, path: str | Path, **kwargs: Any) -> ModelTokenizer:
        folder = Path(path)
        try:
            raw = (folder / "tokenizer.json").read_bytes()
            tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:  # tokenizers raises a plain Exception for unreadable files
            raise TokenizerError(f"{folder / 'tokenizer.json'}: {exc}") from None
        kwargs.setdefault("identity", xxh3_64_intdigest(raw))
        config: dict[str, Any] = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.exists():
            try:
                config = json.loads(cfg_path.read_text())
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{cfg_path}: {exc}") from None
        return cls(tok, config, **kwargs)

    # ---- text -----------------------------------------------------------------------------------------
    def _raw(self, text: str) -> list[int]:
        # encode_batch_fast leaves out the character offsets `encode` tracks (the ids are the same): 0.62x the
        # CPU per 2 KB chunk with the simulator's tokenizer, side by side (round 18).
        return self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def _split_is_exact(self) -> bool:
        for probe in _PROBES:
            whole = self._raw(probe)
            parts: list[int] = []
            start = 0
            for end in cut_points(probe, 16):
                parts += self._raw(probe[start:end])
                start = end
            if parts != whole:
                return False
        return True

    def _chunks(self, text: str) -> list[str]:
        if not self.chunked:
            return [text]
        out: list[str] = []
        start = 0
        for end in cut_points(text, self.chunk_chars):
            out.append(text[start:end])
            start = end
        return out

    def _host_key(self, chunk: str) -> int:
        """`chunk`'s key in the host's shared block."""
        return xxh3_64_intdigest(chunk.encode("utf-8", "surrogatepass"), self.identity)

    def _from_host(self, chunk: str, key: int | None = None) -> list[int] | None:
        """`chunk`'s ids from the host's shared block, copied into this cache (None: no worker has them).
        `key`: its `_host_key`, when the caller has it."""
        shared = self._shared
        if shared is None:
            return None
        got = shared.get(self._host_key(chunk) if key is None else key, len(chunk))
        if got is not None:
            self.shared_hits += 1
            self._store(chunk, got)
        return got

    def _store(self, chunk: str, ids: list[int]) -> None:
        cache = self._cache
        with self._lock:
            cache[chunk] = ids
            if len(cache) > self.cache_chunks:
                cache.popitem(last=False)

    def uncached_chars(self, text: str) -> int:
        """Characters of `text` no cache has the ids of (this process's, then the host's)."""
        cache = self._cache
        return sum(len(c) for c in self._chunks(text) if c not in cache and self._from_host(c) is None)

    def leading_text(self, text: str, max_uncached: int) -> str:
        """The longest run of `text`'s leading chunks whose not-yet-cached part is at most `max_uncached`
        characters (chunk cuts are token boundaries, so its tokens are the prompt's first tokens)."""
        cache = self._cache
        n = left = 0
        for chunk in self._chunks(text):
            if chunk not in cache and self._from_host(chunk) is None:
                if len(chunk) > max_uncached - left:
                    break
                left += len(chunk)
            n += len(chunk)
        return text[:n]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS/EOS added: chat templates and engines add their own)."""
        ids: list[int] = []
        cache, lock = self._cache, self._lock
        for chunk in self._chunks(text):
            with lock:  # the executor thread and the event loop share the cache
                got = cache.get(chunk)
                if got is not None:
                    cache.move_to_end(chunk)
            if got is None:
                shared = self._shared
                key = self._host_key(chunk) if shared is not None else 0
                got = self._from_host(chunk, key)
                if got is None:
                    self.misses += 1
                    got = self._raw(chunk)
                    self._store(chunk, got)
                    if shared is not None:
                        shared.put(key, len(chunk), got)
            else:
                self.hits += 1
            ids += got
        return ids

    # ---- chat -----------------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    **extra: Any) -> str:
        if self._template is None:
            raise TokenizerError("this tokenizer has no chat_template")
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **self._specials, **extra)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat_template failed: {exc}") from None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt))

    # ---- off the event loop ---------------------------------------------------------------------------
    async def encode_async(self, text: str) -> list[int]:
        if self.uncached_chars(text) <= self.offload_chars:
            return self.encode(text)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.encode, text)

    async def encode_chat_async(self, messages: Sequence[Mapping[str, Any]], *,
                                add_generation_prompt: bool = True) -> list[int]:
        return await self.encode_async(self.render_chat(messages, add_generation_prompt=add_generation_prompt))


def _token_text(v: Any) -> str | None:
    if isinstance(v, Mapping):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class PreciseMatcher:
    """The affinity policy's `precise` lookup (`proxy.core.affinity.PreciseLookup`): a request summary in,
    the KV index's `PreciseMatch` out, tokenising with the model's tokenizer.

    It runs inside `pick`, on the event loop, so it never tokenises much there: a prompt whose uncached
    part exceeds the tokenizer's `offload_chars` is tokenised in the executor. `prepare(summary)`, awaited
    by the router before the pick (`Router(prepare=...)`), makes that request wait for its own
    tokenisation, at most `wait_s`: its pick then finds the ids memoised and is precise. Concurrent requests
    for one text share one tokenisation. Past the bound (or with `wait_s` 0, or more than `max_warming`
    tokenisations running) the pick answers None (the learned index decides) and the tokenisation goes on
    for the next sighting; a tokeniser error is answered None too. `prepare` returns None, not an
    awaitable, for a short or cached prompt: those take no extra await. Chat requests are rendered from `RequestSummary.messages` with the model's chat template,
    as the engine does; a summary without messages (gRPC extractors) falls back to its flattened prompt
    (`role\\ncontent\\n` per message) when the template renders that same form (the simulator's does:
    checked once per tokenizer), else gets None.
    """

    def __init__(
        self,
        index: Any,  # proxy.core.kv_index.KVIndex
        tokenizers: Mapping[str, ModelTokenizer],
        *,
        default_model: str | None = None,
        executor: Executor | None = None,
        max_warming: int = 4,
        memo_entries: int = 256,
        defer_prefix: bool = False,
        wait_s: float = 0.2,
        paths: Mapping[str, str] | None = None,
        shared_chunks: SharedChunks | None = None,
    ) -> None:
        """`paths`: the folder each of `tokenizers` was loaded from (`load_tokenizers` keeps those that
        did not change). `defer_prefix`: when a long prompt's pick comes before its tokenisation ended (no `prepare`,
        or its wait reached `wait_s`), answer from its leading chunks instead of not at all (at most the
        tokenizer's `offload_chars` of them not yet cached are tokenised inline). Off: such a prompt is
        routed by the learned index that time. `wait_s`: `prepare`'s bound (0: it never waits).
        `shared_chunks`: the host's chunk block (a `--workers` worker), given to the tokenizers `load_tokenizers`
        loads (those passed in were built with it).
        `max_warming`: tokenisations running in the executor at once, waited for or not
        (`telemetry.kv_events.precise_wait_concurrency`); past it a long prompt is not tokenised for now."""
        from proxy.core.kv_index import block_keys, chain_seed

        self._block_keys = block_keys
        self._chain_seed = chain_seed
        self.index = index
        self.tokenizers = dict(tokenizers)
        self._paths = dict(paths or {})
        self._shared_chunks = shared_chunks
        self._pinned_default = default_model
        self.default_model = default_model if default_model is not None else next(iter(self.tokenizers), None)
        self._loading = 0  # generation of the latest `load_tokenizers`: an older load that ends later loses
        self._load_task: asyncio.Task[None] | None = None
        self._executor = executor
        self._warming: set[int] = set()
        self._max_warming = max_warming
        self._chat_suffix: dict[int, str | None] = {}
        # (model, text) -> (token count, keys per block size): a repeat costs a dict lookup, not re-keying.
        self._memo: OrderedDict[tuple[str, str], tuple[int, dict[int, list[int]]]] = OrderedDict()
        self._memo_entries = memo_entries
        self.errors = 0  # requests the lookup could not tokenise (answered None)
        self.deferred = 0  # requests whose prompt was being tokenised off the loop (None, or a prefix answer)
        self._defer_prefix = defer_prefix
        self.wait_s = wait_s
        # Tokenisations running in the executor, by (model, text): what `prepare` waits on and `_warm` joins.
        self._pending: dict[tuple[str, str], asyncio.Future[None]] = {}
        # The waits `prepare` made (seconds, fixed buckets; `wait_counts[i]` counts waits <= WAIT_BUCKETS[i],
        # the last one +Inf) and how many ran into `wait_s` (their requests were routed by the learned index).
        self.wait_counts = [0] * (len(WAIT_BUCKETS) + 1)
        self.wait_sum_s = 0.0
        self.wait_timeouts = 0
        # Long prompts that did not wait because `max_warming` tokenisations were running (the learned index
        # routed them): with `wait_timeouts`, every long first sighting the precise index did not decide.
        self.wait_skipped = 0

    # ---- tokenizers following a reload ----------------------------------------------------------------
    def load_tokenizers(self, paths: Mapping[str, str]) -> Awaitable[None] | None:
        """Follow `telemetry.kv_events.tokenizers` of a reloaded configuration: a model added or whose
        folder changed gets its tokenizer loaded (off the event loop when one runs: a large tokenizer.json
        takes a few hundred ms), one removed is dropped, unchanged ones keep theirs (and their caches). The
        new table is swapped in whole once every new tokenizer loaded; until then the old one routes. A
        folder that cannot be loaded (the configuration's check let it through, then it changed) keeps that
        model's previous tokenizer, if any, and is logged. Returns the load's task when one runs, else None."""
        paths = dict(paths)
        wanted = {m: p for m, p in paths.items() if self._paths.get(m) != p or m not in self.tokenizers}
        if not wanted and set(paths) == set(self.tokenizers):
            self._paths = paths
            return None
        self._loading += 1
        generation = self._loading

        def load() -> dict[str, ModelTokenizer]:
            loaded: dict[str, ModelTokenizer] = {}
            for model, path in wanted.items():
                try:
                    loaded[model] = ModelTokenizer.from_dir(path, shared=self._shared_chunks)
                except Exception as exc:  # noqa: BLE001 - the table in force keeps routing, whatever the folder did
                    log.error("telemetry.kv_events.tokenizers.%s: %s; keeping its previous tokenizer", model, exc)
            return loaded

        def swap(loaded: dict[str, ModelTokenizer]) -> None:
            if generation != self._loading:
                return  # a later reload's table wins
            table: dict[str, ModelTokenizer] = {}
            kept: dict[str, str] = {}
            for model, path in paths.items():
                tok = loaded.get(model) or self.tokenizers.get(model)
                if tok is not None:
                    table[model] = tok
                    kept[model] = path if model in loaded or model not in wanted else self._paths.get(model, "")
            self.tokenizers, self._paths = table, kept
            self._memo.clear()  # keyed by model: a changed tokenizer's ids are not the old ones
            self._chat_suffix.clear()
            self.default_model = (self._pinned_default if self._pinned_default is not None
                                  else next(iter(self.tokenizers), None))
            log.info("KV events: tokenizers now %s (loaded: %s)", sorted(table), ", ".join(sorted(loaded)) or "-")

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            swap(load())
            return None

        async def run() -> None:
            swap(await loop.run_in_executor(self._executor, load))

        self._load_task = loop.create_task(run(), name="load-tokenizers")  # held: a task nobody holds may be collected
        return self._load_task

    def _tokenizer(self, model: str | None) -> ModelTokenizer | None:
        tok = self.tokenizers.get(model) if model is not None else None
        if tok is None and self.default_model is not None:
            tok = self.tokenizers.get(self.default_model)
        return tok

    def _suffix(self, tok: ModelTokenizer) -> str | None:
        """The generation prompt the template appends to the flattened form, or None if it renders
        messages some other way (then a flattened prompt is not what the engine tokenises)."""
        key = id(tok)
        if key not in self._chat_suffix:
            probe = [{"role": "system", "content": "s s"}, {"role": "user", "content": "u u"}]
            flat = "system\ns s\nuser\nu u\n"
            suffix: str | None = None
            if tok.has_chat_template:
                try:
                    rendered = tok.render_chat(probe)
                except TokenizerError:
                    rendered = ""
                if rendered.startswith(flat):
                    suffix = rendered[len(flat):]
            self._chat_suffix[key] = suffix
        return self._chat_suffix[key]

    def __call__(self, req: Any) -> Any:
        try:
            return self._lookup(req)
        except Exception:  # e.g. a lone surrogate the Rust tokenizer rejects: route by the learned index
            self.errors += 1
            log.debug("precise lookup failed; the learned index decides", exc_info=True)
            return None

    def _text(self, req: Any, tok: ModelTokenizer) -> str | None:
        """What the engine tokenises for `req`, or None when this lookup cannot tell."""
        text: str = req.prompt
        if req.endpoint.endswith("/chat/completions"):
            messages = getattr(req, "messages", None)
            if messages and tok.has_chat_template:
                return tok.render_chat(messages)  # what the engine tokenises (add_generation_prompt: vLLM's default)
            suffix = self._suffix(tok)
            if suffix is None:
                return None
            text += suffix
        return text

    def _lookup(self, req: Any) -> Any:
        from proxy.core.kv_index import PreciseMatch

        sizes = self.index.block_sizes()
        if not sizes or not req.prompt:
            return None
        tok = self._tokenizer(req.model)
        if tok is None:
            return None
        text = self._text(req, tok)
        if text is None:
            return None
        model = req.adapter or req.model or self.default_model or ""
        memo = self._memo
        hit = memo.get((model, text))
        if hit is not None and sizes <= hit[1].keys():
            memo.move_to_end((model, text))
            n, keys = hit
            return PreciseMatch(n, self.index.match((), model, keys), max(sizes), self.index.lru_front)
        if tok.uncached_chars(text) > tok.offload_chars:
            head = tok.leading_text(text, tok.offload_chars) if self._defer_prefix else ""  # before the warm-up
            self._warm(tok, text, model)
            self.deferred += 1
            if not head:
                return None
            ids = tok.encode(head)
            seed = self._chain_seed(model)
            keys = {size: self._block_keys(ids, size, seed) for size in sizes}
            total = len(ids) * len(text) // len(head)  # the whole prompt's tokens, at the head's density
            return PreciseMatch(total, self.index.match(ids, model, keys), max(sizes), self.index.lru_front)
        n, keys = self._remember(model, text, tok.encode(text), sizes)
        return PreciseMatch(n, self.index.match((), model, keys), max(sizes), self.index.lru_front)

    def _remember(self, model: str, text: str, ids: list[int], sizes: set[int]
                  ) -> tuple[int, dict[int, list[int]]]:
        seed = self._chain_seed(model)
        keys = {size: self._block_keys(ids, size, seed) for size in sizes}
        memo = self._memo
        memo[(model, text)] = (len(ids), keys)
        memo.move_to_end((model, text))
        if len(memo) > self._memo_entries:
            memo.popitem(last=False)
        return len(ids), keys

    # ---- waiting for a long prompt's tokenisation (before the pick) --------------------------------------
    def _offloaded(self, req: Any) -> tuple[ModelTokenizer, str, str, set[int]] | None:
        """(tokenizer, text, model, block sizes) when `req`'s lookup would tokenise off the loop; else None."""
        prompt = req.prompt
        if not prompt:
            return None
        tok = self._tokenizer(req.model)
        if tok is None or len(prompt) + _TEMPLATE_CHARS * len(getattr(req, "messages", None) or ()) + 64 \
                <= tok.offload_chars:
            return None  # short: the pick answers it inline (checked on the flattened prompt, not rendered)
        sizes = self.index.block_sizes()
        if not sizes:
            return None
        text = self._text(req, tok)
        if text is None or len(text) <= tok.offload_chars:
            return None
        model = req.adapter or req.model or self.default_model or ""
        if (model, text) in self._pending:
            return tok, text, model, sizes  # join it (its thread may have cached some chunks already)
        hit = self._memo.get((model, text))
        if hit is not None and sizes <= hit[1].keys():
            return None
        if tok.uncached_chars(text) <= tok.offload_chars:
            return None
        return tok, text, model, sizes

    def prepare(self, req: Any) -> Awaitable[None] | None:
        """The router's `prepare` hook: None when `req`'s pick can look it up inline (short, cached, or no
        precise lookup at all), else an awaitable that waits, at most `wait_s`, for its tokenisation in the
        executor (shared with concurrent requests for the same text). Never raises."""
        if self.wait_s <= 0:
            return None
        try:
            job = self._offloaded(req)
        except Exception:  # rendering failed: the pick's lookup counts it and answers None
            return None
        if job is None:
            return None
        fut = self._start(*job)
        if fut is None:
            self.wait_skipped += 1  # too many tokenisations running: this one is routed by the learned index
            return None
        return self._wait(fut)

    async def _wait(self, fut: asyncio.Future[None]) -> None:
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.wait_s)
        except asyncio.TimeoutError:
            self.wait_timeouts += 1  # it goes on in the executor, for the next sighting
        except Exception:
            pass  # a tokeniser error: the pick's lookup answers None (and counts it)
        waited = time.monotonic() - t0
        self.wait_sum_s += waited
        self.wait_counts[bisect.bisect_left(WAIT_BUCKETS, waited)] += 1

    def tokenise_now(self, req: Any) -> bool:
        """Do what `prepare` waits for, here and now (the virtual-time replay's model of a wait that takes
        no time): True when `req` needed it."""
        try:
            job = self._offloaded(req)
            if job is None:
                return False
            tok, text, model, sizes = job
            self._remember(model, text, tok.encode(text), sizes)
        except Exception:  # the pick's lookup counts it and answers None
            return False
        return True

    def _start(self, tok: ModelTokenizer, text: str, model: str,
               sizes: set[int]) -> asyncio.Future[None] | None:
        """The running tokenisation of (model, text), started in the executor if none is; its result is
        memoised so that the next lookup of the text is a dict hit. None: `max_warming` are running."""
        key = (model, text)
        fut = self._pending.get(key)
        if fut is not None:
            return fut
        if len(self._pending) >= self._max_warming:
            return None
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._executor, tok.encode, text)
        fut = loop.create_future()
        self._pending[key] = fut

        def done(f: asyncio.Future[list[int]]) -> None:
            self._pending.pop(key, None)
            if f.cancelled():
                fut.cancel()
                return
            exc = f.exception()
            if exc is not None:
                fut.set_exception(exc)
                fut.exception()  # retrieved, so a failure nobody waited for is not logged as never retrieved
                return
            try:
                self._remember(model, text, f.result(), sizes)
            except Exception as err:  # keying failed: the pick's lookup will tell
                fut.set_exception(err)
                fut.exception()
                return
            fut.set_result(None)

        work.add_done_callback(done)
        return fut

    def _warm(self, tok: ModelTokenizer, text: str, model: str) -> None:
        """Tokenise `text` in the executor so that its next sighting finds every chunk cached (unless it is
        being tokenised already, e.g. for a request that stopped waiting at `wait_s`)."""
        if (model, text) in self._pending:
            return
        key = hash(text)
        if key in self._warming or len(self._warming) + len(self._pending) >= self._max_warming:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._warming.add(key)
        fut = loop.run_in_executor(self._executor, tok.encode, text)
        def done(f: asyncio.Future[Any]) -> None:
            self._warming.discard(key)
            if not f.cancelled():
                f.exception()  # retrieved, so a failed warm-up is not logged as never retrieved

        fut.add_done_callback(done)


def _bench(argv: Sequence[str] | None = None) -> None:
    """`python -m proxy.dataplane.tokenize [TOKENIZER_DIR]`: the precise lookup's CPU per request (tokenise +
    chained keys + index match over 4 backends) for 1k/16k/64k-token prompts: first sighting, repeat and a
    continuation."""
    import argparse
    import random
    import timeit

    from proxy.core.kv_index import KVIndex
    from proxy.core.request import RequestSummary
    from sim.tokenizer import LOADTEST_WORDS, TOKENIZER_DIR

    ap = argparse.ArgumentParser(prog="python -m proxy.dataplane.tokenize", description=(
        "The precise lookup's CPU per request (tokenise + chained keys + index match over 4 backends) for "
        "1k/16k/64k-token prompts: first sighting, repeat, and a +200-token continuation; 5 runs each, min-max."))
    ap.add_argument("folder", nargs="?", default=str(TOKENIZER_DIR),
                    help="a tokenizer folder (tokenizer.json [+ tokenizer_config.json]); default: the simulator's")
    folder = ap.parse_args(argv).folder
    try:
        ModelTokenizer.from_dir(folder)
    except TokenizerError as exc:
        ap.error(str(exc))
    rng = random.Random(0)
    index = KVIndex()
    for b in range(4):
        index.track(f"b{b}", model="m")
        index.mark_fresh(f"b{b}")
    index.stored("b0", [0], None, list(range(16)), 16)  # fixes the block size; the prompts hit nothing
    print(f"tokenizer {folder}; 5 runs each, min-max")
    for n in (1024, 16384, 65536):
        text = " ".join(rng.choice(LOADTEST_WORDS) for _ in range(n))
        req = RequestSummary(prompt=text, model="m", endpoint="/v1/completions")
        firsts, tok_first, repeats, cont = [], [], [], []
        for _ in range(5):
            tok = ModelTokenizer.from_dir(folder, offload_chars=1 << 40)
            m = PreciseMatcher(index, {"m": tok})
            tok_first.append(timeit.timeit(lambda: tok.encode(text), number=1))
            tok._cache.clear()
            firsts.append(timeit.timeit(lambda: m(req), number=1))
            # a repeat arrives as a new str (parsed from a new body): its hash is computed afresh
            again = [RequestSummary(prompt=text[:-1] + text[-1:], model="m", endpoint="/v1/completions")
                     for _ in range(20)]
            repeats.append(min(timeit.timeit(functools.partial(m, r), number=1) for r in again))
            longer = RequestSummary(prompt=text + " " + " ".join(LOADTEST_WORDS[:200]), model="m",
                                    endpoint="/v1/completions")
            cont.append(timeit.timeit(lambda: m(longer), number=1))

        def rng_ms(xs: list[float]) -> str:
            return f"{min(xs) * 1e3:.3f}-{max(xs) * 1e3:.3f} ms"

        print(f"{n:>6} tokens: first sighting {rng_ms(firsts)} (tokenise alone {rng_ms(tok_first)}), "
              f"repeat {rng_ms(repeats)}, continuation +200 tokens {rng_ms(cont)}")


if __name__ == "__main__":
    _bench()
