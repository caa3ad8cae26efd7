"""A GPU inference engine (vLLM V1-like) as a pure model: no I/O, no clock of its own.

The caller owns time. The same `Engine` runs in real time inside the simulated server (a driver task maps
the wall clock onto it) and in virtual time inside an offline replay, so every number it produces (TTFT,
cache hits, utilisation) means the same thing in both.

Driving API (stable; times are seconds on the caller's clock, any origin, never decreasing)::

    engine = Engine(get_profile("llama3-8b-h100"), seed=0, adapters=("sql-lora",))
    engine.add_request(SimRequest("r1", "a b c ...", max_tokens=64, ignore_eos=True), now=0.0)
    t = engine.next_step_time()          # None when idle, else when the next step can start
    while t is not None:
        result = engine.step(t)          # runs ONE batch step starting at max(t, busy_until)
        for out in result.outputs:       # what each request got when the step ENDED (result.end)
            out.request_id, out.text, out.num_tokens, out.first_token, out.finished, out.finish_reason,
            out.usage
        # add_request()/abort() may be called at any time >= the last step's start; requests added while
        # a step "runs" (now < result.end) join the next step, as in continuous batching.
        t = engine.next_step_time()      # == result.end while there is work

    engine.abort("r1", now)              # frees its blocks (they stay cached); False if unknown/finished

`add_request(req, now, default_max_tokens=None)` raises `InvalidRequest` / `ModelNotFound` (sim.api)
without queueing; `default_max_tokens` applies when `req.max_tokens` is None (else: the rest of the context).
`RequestOutput.usage` (on the finishing output) carries prompt, completion and cached prompt tokens; the
first-token output's `StepResult.end - arrival` is the request's TTFT.

A replay merges `next_step_time()` with its own arrival times: whichever is earlier happens first.
Counters live in `engine.stats` (`EngineStats`: prefix_queries_tokens / prefix_hits_tokens, prompt and
generation tokens, preemptions, lora_loads, busy_seconds, ttft / e2e histograms, ...) and the gauges are
properties: `num_running`, `num_waiting`, `kv_usage`, `num_tokens_in_use`, `busy_time(now)`;
`engine.pool` (kvcache.BlockPool) has num_blocks / num_free / num_cached / evictions. With
`Engine(..., kv_events=True)`, `engine.take_kv_events()` returns the KV-cache events (kvcache.Stored /
Removed / Cleared) of the steps since the last call, in order: what vLLM publishes with `--kv-events-config`
(`sim/kv_events.py` encodes and publishes them); `engine.reset_prefix_cache()` is vLLM's cache reset.

Model (what each part stands for in vLLM V1):
- Tokens are whitespace-separated words. A request holds `prompt + output` tokens; `num_computed` of them
  have KV in the cache. Each step a request processes `tokens - num_computed` new tokens (its whole
  remaining prompt, chunked to the step's budget, or the one token sampled last step) and, when that
  catches up with its tokens, samples one more token.
- Scheduler: running requests first (in admission order), then waiting ones (FIFO) while the
  `max_num_batched_tokens` budget, `max_num_seqs` and free blocks allow. A running request that needs a
  block when none is free preempts the most recently admitted running request (recompute: its blocks are
  freed but stay cached, it goes back to the head of the queue). Admission reuses the longest cached prefix
  (capped at prompt - 1 tokens: the last token is always computed to get logits).
- Step time is a roofline: max(FLOPs / (peak x MFU), bytes / (HBM bandwidth x MBU)) + CPU overhead, with
  FLOPs = 2 x params per token + attention over each sequence's context, and bytes = the weights once plus
  the KV cache of every scheduled sequence. Prefill-heavy steps are compute bound, decode steps memory
  bound. Loading a LoRA adapter into a free slot adds its load time to the step.
- Output text is deterministic per (model, temperature, prompt); with `ignore_eos` exactly `max_tokens`
  tokens, otherwise a seeded log-normal length capped at `max_tokens`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from .api import InvalidRequest, ModelNotFound, SimRequest, Usage
from .kvcache import BlockPool, chain_seed, extend_block_keys
from .profiles import Profile
from .tokens import TextGenerator, request_seed, sample_output_len

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"

# vLLM's time_to_first_token_seconds buckets (vllm/v1/metrics/loggers.py); +Inf is the count.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
# vLLM's e2e_request_latency_seconds buckets.
E2E_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)


@dataclass(slots=True)
class _Seq:
    """Engine-side state of one request (mutable, private)."""

    request_id: str
    adapter: str | None
    tokens: list[str]
    num_prompt: int
    target_len: int
    max_tokens: int
    arrival: float
    gen: TextGenerator
    key_seed: int
    block_keys: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_committed: int = 0  # blocks[:num_committed] carry their key in the pool
    num_computed: int = 0
    num_output: int = 0
    num_cached: int = -1  # prompt tokens served from cache at first admission
    first_token_at: float | None = None
    status: str = WAITING


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one request got from one step (delivered at `StepResult.end`)."""

    request_id: str
    text: str  # new tokens, space-joined, with a leading space unless it starts the completion
    num_tokens: int
    first_token: bool
    finished: bool
    finish_reason: str | None = None
    usage: Usage | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    start: float
    end: float
    outputs: tuple[RequestOutput, ...]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    preempted: tuple[str, ...] = ()
    lora_loads: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(slots=True)
class Histogram:
    """Prometheus-style histogram state: per-bucket counts (not cumulative), count and sum."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        i = bisect_left(self.buckets, value)  # first bucket whose upper bound is >= value
        if i < len(self.buckets):
            self.counts[i] += 1


@dataclass(slots=True)
class EngineStats:
    """Monotonic counters (Prometheus counters are derived from these)."""

    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    computed_tokens: int = 0  # tokens whose KV was written (prefill + decode), incl. recompute
    num_steps: int = 0
    num_preemptions: int = 0
    lora_loads: int = 0
    requests_added: int = 0
    requests_aborted: int = 0
    finished_length: int = 0
    finished_stop: int = 0
    busy_seconds: float = 0.0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))


class Engine:
    def __init__(
        self,
        profile: Profile,
        *,
        seed: int = 0,
        adapters: tuple[str, ...] | list[str] = (),
        model_name: str | None = None,
        kv_events: bool = False,
    ) -> None:
        self.profile = profile
        self.model_name = model_name or profile.model.name
        self.seed = seed
        self.known_adapters: tuple[str, ...] = tuple(adapters)
        self.pool = BlockPool(profile.num_gpu_blocks, profile.block_size, record_events=kv_events)
        self.stats = EngineStats()
        self.busy_until = float("-inf")
        self._ready_at = float("-inf")  # arrival that woke an idle engine
        self._seqs: dict[str, _Seq] = {}
        self._running: list[_Seq] = []
        self._waiting: deque[_Seq] = deque()
        self.loaded_adapters: OrderedDict[str, None] = OrderedDict()  # LRU: first = least recent
        m = profile.model
        self._flops_per_token = 2.0 * m.params
        self._attn_flops_per_token_ctx = 4.0 * m.layers * m.hidden
        self._kv_bytes_per_token = m.kv_bytes_per_token

    # ---- gauges -------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage()

    @property
    def num_tokens_in_use(self) -> int:
        """Tokens held by live sequences (SGLang's num_tokens / token_usage numerator)."""
        return sum(s.num_computed for s in self._running)

    @property
    def num_prefilling(self) -> int:
        """Running requests that have not produced their first token yet (TensorRT-LLM's "context")."""
        return sum(1 for s in self._running if s.num_output == 0)

    # ---- runtime LoRA API (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter) --------------------
    def register_adapter(self, name: str) -> bool:
        """Make `name` servable. False if it already was; raises InvalidRequest when every adapter slot
        (`profile.max_loras`, the simulator's limit on registered adapters) is taken."""
        if name in self.known_adapters:
            return False
        if len(self.known_adapters) >= self.profile.max_loras:
            raise InvalidRequest(
                f"Cannot load LoRA adapter '{name}': all {self.profile.max_loras} adapter slots are in use.",
                "lora_name")
        self.known_adapters = (*self.known_adapters, name)
        return True

    def unregister_adapter(self, name: str) -> None:
        """Stop serving `name`; refused while a request for it is running or waiting."""
        if name not in self.known_adapters:
            raise ModelNotFound(f"The lora adapter '{name}' cannot be found.", "lora_name")
        if name in self.running_adapters() or name in self.waiting_adapters():
            raise InvalidRequest(f"LoRA adapter '{name}' has requests in flight.", "lora_name")
        self.known_adapters = tuple(a for a in self.known_adapters if a != name)
        self.loaded_adapters.pop(name, None)

    def running_adapters(self) -> list[str]:
        return sorted({s.adapter for s in self._running if s.adapter})

    def waiting_adapters(self) -> list[str]:
        return sorted({s.adapter for s in self._waiting if s.adapter})

    def busy_time(self, now: float) -> float:
        """GPU-busy seconds up to `now` (a step in progress counts only its elapsed part)."""
        return self.stats.busy_seconds - max(0.0, self.busy_until - now)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def next_step_time(self) -> float | None:
        """When the next step can start, or None while idle (then the next `add_request` decides)."""
        if not self.has_work():
            return None
        return max(self.busy_until, self._ready_at)

    def is_active(self, request_id: str) -> bool:
        return request_id in self._seqs

    def cached_prefix_tokens(self, request_id: str, pool: BlockPool | None = None) -> int:
        """Tokens of a queued or running request's prompt that `pool` (default: this engine's) holds as a
        cached prefix right now: what its admission would hit if it happened now (the last prompt token is
        always computed, as in `_admit`). Changes nothing the engine's behaviour depends on: it may extend the
        request's cached block keys, as admission would. For analysis (loadtest/results/scaleout.py losses)."""
        seq = self._seqs[request_id]
        bs = self.profile.block_size
        extend_block_keys(seq.block_keys, seq.tokens, bs, seq.key_seed)
        return len((pool or self.pool).match(seq.block_keys[: (seq.num_prompt - 1) // bs])) * bs

    def take_kv_events(self) -> list:
        """KV-cache events since the last call (empty unless built with kv_events=True)."""
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (vLLM's POST /reset_prefix_cache); False while requests hold blocks."""
        return self.pool.reset_cache()

    # ---- requests ------------------------------------------------------------------------------------
    def validate(self, req: SimRequest, default_max_tokens: int | None = None) -> tuple[str | None, list[str], int]:
        """Check a request without adding it: (adapter, prompt tokens, max_tokens) or an exception."""
        adapter: str | None = None
        if req.model and req.model != self.model_name:
            if req.model not in self.known_adapters:
                raise ModelNotFound(f"The model `{req.model}` does not exist.", "model")
            adapter = req.model
        tokens = req.prompt.split()
        if not tokens:
            raise InvalidRequest("The prompt cannot be empty.", "prompt")
        limit = self.profile.model.max_model_len
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens if default_max_tokens is not None else limit - len(tokens)
            max_tokens = min(max_tokens, limit - len(tokens))
        if max_tokens < 1:
            if req.max_tokens is not None:
                raise InvalidRequest("max_tokens must be at least 1, got %d." % max_tokens, "max_tokens")
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{len(tokens)} tokens. Please reduce the length of the prompt.",
                "prompt",
            )
        if len(tokens) + max_tokens > limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(tokens) + max_tokens} tokens ({len(tokens)} in the prompt, {max_tokens} in the "
                f"completion). Please reduce the length of the prompt or completion.",
                "max_tokens",
            )
        bs = self.profile.block_size
        if -(-(len(tokens) + max_tokens) // bs) > self.pool.num_blocks:
            raise InvalidRequest(
                f"The request needs {len(tokens) + max_tokens} tokens of KV cache but this server holds "
                f"only {self.pool.num_blocks * bs}.",
                "max_tokens",
            )
        return adapter, tokens, max_tokens

    def add_request(self, req: SimRequest, now: float, default_max_tokens: int | None = None) -> None:
        """Queue a request (raises `InvalidRequest` / `ModelNotFound` without queueing it)."""
        if req.request_id in self._seqs:
            raise InvalidRequest(f"request id {req.request_id!r} is already running", "request_id")
        adapter, tokens, max_tokens = self.validate(req, default_max_tokens)
        seed = request_seed(self.seed, req.model or self.model_name, req.prompt, req.temperature)
        if req.ignore_eos:
            target = max_tokens
        else:
            target = sample_output_len(seed, self.profile.mean_output_tokens, max_tokens)
        seq = _Seq(
            request_id=req.request_id,
            adapter=adapter,
            tokens=tokens,
            num_prompt=len(tokens),
            target_len=target,
            max_tokens=max_tokens,
            arrival=now,
            gen=TextGenerator(seed),
            key_seed=chain_seed(self.model_name, adapter),
        )
        if not self.has_work():
            self._ready_at = now
        self._seqs[req.request_id] = seq
        self._waiting.append(seq)
        self.stats.requests_added += 1
        self.stats.prompt_tokens += len(tokens)

    def abort(self, request_id: str, now: float) -> bool:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq.status == RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self._free(seq)
        seq.status = FINISHED
        self.stats.requests_aborted += 1
        return True

    # ---- one step ------------------------------------------------------------------------------------
    def step(self, now: float) -> StepResult:
        start = max(now, self.busy_until, self._ready_at)
        prof = self.profile
        budget = prof.max_num_batched_tokens
        scheduled: list[tuple[_Seq, int]] = []
        preempted: list[str] = []

        # 1. Running requests keep their place, preempting from the tail when blocks run out.
        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            n = min(len(seq.tokens) - seq.num_computed, budget)
            while not self._grow(seq, seq.num_computed + n):
                victim = self._running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break

        # 2. Admit waiting requests (none while we are preempting: memory is short).
        lora_loads = 0
        if not preempted:
            skipped: list[_Seq] = []
            while self._waiting and budget > 0 and len(self._running) < prof.max_num_seqs:
                seq = self._waiting[0]
                if seq.adapter is not None:
                    slot = self._ensure_adapter(seq.adapter)
                    if slot is None:  # every slot pinned by a running request: let others pass
                        skipped.append(self._waiting.popleft())
                        continue
                    lora_loads += slot
                admitted = self._admit(seq, budget)
                if admitted is None:
                    break
                self._waiting.popleft()
                seq.status = RUNNING
                self._running.append(seq)
                scheduled.append((seq, admitted))
                budget -= admitted
            self._waiting.extendleft(reversed(skipped))

        # 3. Roofline time of the batch.
        flops = 0.0
        kv_bytes = 0.0
        num_prefill = num_decode = 0
        for seq, n in scheduled:
            ctx = seq.num_computed
            flops += n * (self._flops_per_token + self._attn_flops_per_token_ctx * (ctx + n / 2))
            kv_bytes += (ctx + n) * self._kv_bytes_per_token
            if n == 1 and seq.num_output > 0 and len(seq.tokens) - ctx == 1:
                num_decode += n
            else:
                num_prefill += n
        duration = 0.0
        if scheduled:
            compute_s = flops / prof.flops_per_s
            memory_s = (prof.model.weight_bytes + kv_bytes) / prof.bytes_per_s
            duration = (
                max(compute_s, memory_s)
                + prof.step_overhead_s
                + prof.per_seq_overhead_s * len(scheduled)
                + prof.lora_load_s * lora_loads
            )
        end = start + duration

        # 4. Apply: KV written, tokens sampled, finished requests freed.
        outputs: list[RequestOutput] = []
        finished: list[_Seq] = []
        computed_now = 0
        for seq, n in scheduled:
            seq.num_computed += n
            computed_now += n
            self._commit_full_blocks(seq)
            if seq.num_computed < len(seq.tokens):
                continue  # chunked prefill not done yet
            word = seq.gen.next_word()
            first = seq.num_output == 0
            seq.tokens.append(word)
            seq.num_output += 1
            self.stats.generation_tokens += 1
            if first:
                seq.first_token_at = end
                self.stats.ttft.observe(end - seq.arrival)
            done = seq.num_output >= seq.target_len
            reason: str | None = None
            usage: Usage | None = None
            if done:
                reason = "length" if seq.num_output >= seq.max_tokens else "stop"
                usage = Usage(seq.num_prompt, seq.num_output, max(0, seq.num_cached))
                finished.append(seq)
                self.stats.e2e.observe(end - seq.arrival)
                if reason == "length":
                    self.stats.finished_length += 1
                else:
                    self.stats.finished_stop += 1
            outputs.append(
                RequestOutput(
                    request_id=seq.request_id,
                    text=word if first else " " + word,
                    num_tokens=1,
                    first_token=first,
                    finished=done,
                    finish_reason=reason,
                    usage=usage,
                )
            )
        for seq in finished:
            self._running.remove(seq)
            del self._seqs[seq.request_id]
            self._free(seq)
            seq.status = FINISHED

        self.stats.computed_tokens += computed_now
        self.stats.num_preemptions += len(preempted)
        self.stats.lora_loads += lora_loads
        if scheduled:
            self.stats.num_steps += 1
            self.stats.busy_seconds += duration
            self.busy_until = end
        return StepResult(
            start=start,
            end=end,
            outputs=tuple(outputs),
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_decode,
            num_seqs=len(scheduled),
            preempted=tuple(preempted),
            lora_loads=lora_loads,
        )

    # ---- internals -----------------------------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.profile.block_size)

    def _grow(self, seq: _Seq, num_tokens: int) -> bool:
        """Make `seq` own enough blocks for `num_tokens`; False (nothing changed) if the pool is short."""
        need = self._blocks_for(num_tokens) - len(seq.blocks)
        if need <= 0:
            return True
        fresh = self.pool.allocate(need)
        if fresh is None:
            return False
        seq.blocks.extend(fresh)
        return True

    def _admit(self, seq: _Seq, budget: int) -> int | None:
        """Give a waiting request its cached prefix and blocks for its first chunk; tokens to compute."""
        bs = self.profile.block_size
        extend_block_keys(seq.block_keys, seq.tokens, bs, seq.key_seed)
        max_hit_blocks = (len(seq.tokens) - 1) // bs
        hits = self.pool.match(seq.block_keys[:max_hit_blocks])
        hit_tokens = len(hits) * bs
        n = min(len(seq.tokens) - hit_tokens, budget)
        need = self._blocks_for(hit_tokens + n) - len(hits)
        if need > self.pool.free_after_acquire(hits):
            return None
        self.pool.acquire(hits)
        fresh = self.pool.allocate(need)
        assert fresh is not None
        seq.blocks = hits + fresh
        seq.num_committed = len(hits)
        seq.num_computed = hit_tokens
        self.stats.prefix_queries_tokens += len(seq.tokens)
        self.stats.prefix_hits_tokens += hit_tokens
        if seq.num_cached < 0:
            seq.num_cached = min(hit_tokens, seq.num_prompt)
        return n

    def _commit_full_blocks(self, seq: _Seq) -> None:
        full = seq.num_computed // self.profile.block_size
        if full <= seq.num_committed:
            return
        bs = self.profile.block_size
        extend_block_keys(seq.block_keys, seq.tokens, bs, seq.key_seed)
        pool, keys = self.pool, seq.block_keys
        if pool.events is None:
            for b in range(seq.num_committed, full):
                pool.commit(seq.blocks[b], keys[b])
        else:
            run_start = -1  # first block of the current run of newly cached keys (one BlockStored per run)
            for b in range(seq.num_committed, full + 1):
                new = b < full and pool.commit(seq.blocks[b], keys[b])
                if new and run_start < 0:
                    run_start = b
                elif not new and run_start >= 0:
                    pool.log_stored(keys[run_start:b], keys[run_start - 1] if run_start else None,
                                    seq.tokens[run_start * bs : b * bs], seq.adapter)
                    run_start = -1
        seq.num_committed = full

    def _free(self, seq: _Seq) -> None:
        self.pool.release(seq.blocks)
        seq.blocks = []
        seq.num_committed = 0

    def _preempt(self, seq: _Seq) -> None:
        self._free(seq)
        seq.num_computed = 0
        seq.status = WAITING
        self._waiting.appendleft(seq)

    def _ensure_adapter(self, adapter: str) -> int | None:
        """Put `adapter` in a slot (LRU; slots of running requests are pinned): 1 if it had to be loaded,
        0 if it was there, None if no slot can be freed now."""
        slots = self.loaded_adapters
        if adapter in slots:
            slots.move_to_end(adapter)
            return 0
        if len(slots) >= self.profile.max_loras:
            pinned = {s.adapter for s in self._running if s.adapter}
            victim = next((a for a in slots if a not in pinned), None)
            if victim is None:
                return None
            del slots[victim]
        slots[adapter] = None
        return 1
