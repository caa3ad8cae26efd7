"""The engine model in virtual time: batching, prefix reuse, eviction, preemption, roofline, LoRA."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from sim.api import InvalidRequest, ModelNotFound, SimRequest
from sim.engine import Engine
from sim.profiles import PROFILES, get_profile


@dataclass
class Seen:
    text: str = ""
    tokens: int = 0
    first_at: float | None = None
    done_at: float | None = None
    reason: str | None = None
    cached: int = -1
    prompt: int = -1


@dataclass
class Run:
    seen: dict[str, Seen] = field(default_factory=dict)
    steps: int = 0
    busy: float = 0.0


def drive(engine: Engine, arrivals: list[tuple[float, SimRequest]], default_max: int | None = None) -> Run:
    """Replay arrivals against the engine the way a virtual-time replay would."""
    run = Run()
    pending = sorted(arrivals, key=lambda a: a[0])
    i = 0
    while True:
        t_step = engine.next_step_time()
        t_arr = pending[i][0] if i < len(pending) else None
        if t_step is None and t_arr is None:
            return run
        if t_arr is not None and (t_step is None or t_arr <= t_step):
            engine.add_request(pending[i][1], t_arr, default_max)
            run.seen[pending[i][1].request_id] = Seen()
            i += 1
            continue
        assert t_step is not None
        res = engine.step(t_step)
        run.steps += 1
        run.busy += res.duration
        for out in res.outputs:
            s = run.seen[out.request_id]
            s.text += out.text
            s.tokens += out.num_tokens
            if out.first_token:
                s.first_at = res.end
            if out.finished:
                s.done_at = res.end
                s.reason = out.finish_reason
                assert out.usage is not None
                s.cached = out.usage.cached_tokens
                s.prompt = out.usage.prompt_tokens


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


@pytest.fixture
def h100() -> Engine:
    return Engine(get_profile("llama3-8b-h100"), seed=1)


def test_profiles_derive_capacity_from_memory() -> None:
    p = get_profile("llama3-8b-h100")
    assert p.model.kv_bytes_per_token == 128 * 1024  # 2 x 32 layers x 8 heads x 128 dims x 2 bytes
    usable = p.gpu.memory_bytes * 0.9 - p.model.weight_bytes - p.reserved_bytes
    assert p.num_gpu_blocks == int(usable // (16 * 128 * 1024))
    assert 400_000 < p.kv_capacity_tokens < 500_000
    assert PROFILES["llama3-8b-h200"].kv_capacity_tokens > 2 * p.kv_capacity_tokens - 50_000
    big = PROFILES["llama3-70b-4xh100"]
    assert big.tp == 4 and big.model.weight_bytes > 4 * 30e9


def test_ignore_eos_gives_exactly_max_tokens_and_text_is_deterministic(h100: Engine) -> None:
    req = SimRequest("a", words("w", 40), max_tokens=17, ignore_eos=True)
    run = drive(h100, [(0.0, req)])
    s = run.seen["a"]
    assert s.tokens == 17 and len(s.text.split()) == 17 and s.reason == "length"
    again = drive(Engine(get_profile("llama3-8b-h100"), seed=1), [(0.0, req)])
    assert again.seen["a"].text == s.text


def test_without_ignore_eos_length_is_seeded_and_capped() -> None:
    lengths = set()
    for k in range(20):
        e = Engine(get_profile("llama3-8b-h100"), seed=0)
        run = drive(e, [(0.0, SimRequest("r", words(f"p{k}_", 8), max_tokens=300))])
        s = run.seen["r"]
        assert 1 <= s.tokens <= 300
        assert s.reason == ("length" if s.tokens == 300 else "stop")
        lengths.add(s.tokens)
    assert len(lengths) > 5  # a distribution, not a constant


def test_shared_prefix_hits_and_counters_match_usage(h100: Engine) -> None:
    system = words("sys", 160)  # 10 full blocks
    reqs = [(float(i), SimRequest(f"r{i}", system + " " + words(f"q{i}_", 20), max_tokens=4, ignore_eos=True)) for i in range(4)]
    run = drive(h100, reqs)
    assert run.seen["r0"].cached == 0
    for i in range(1, 4):
        assert run.seen[f"r{i}"].cached == 160
    st = h100.stats
    assert st.prefix_hits_tokens == sum(s.cached for s in run.seen.values()) == 480
    assert st.prefix_queries_tokens == sum(s.prompt for s in run.seen.values()) == 4 * 180


def test_a_fully_cached_prompt_still_computes_its_last_token(h100: Engine) -> None:
    p = words("x", 64)
    run = drive(h100, [(0.0, SimRequest("a", p, max_tokens=1, ignore_eos=True)), (1.0, SimRequest("b", p, max_tokens=1, ignore_eos=True))])
    assert run.seen["b"].cached == 48  # 64 tokens = 4 blocks; the last block is recomputed for logits


def test_prefix_hit_makes_ttft_shorter(h100: Engine) -> None:
    doc = words("doc", 4000)
    run = drive(h100, [(0.0, SimRequest("a", doc + " q1", max_tokens=1, ignore_eos=True)), (5.0, SimRequest("b", doc + " q2", max_tokens=1, ignore_eos=True))])
    ttft_a = run.seen["a"].first_at - 0.0  # type: ignore[operator]
    ttft_b = run.seen["b"].first_at - 5.0  # type: ignore[operator]
    assert ttft_b < ttft_a / 5


def test_adapter_requests_do_not_share_the_base_models_cache() -> None:
    e = Engine(get_profile("llama3-8b-h100"), adapters=("lora-a",))
    p = words("x", 100)
    run = drive(e, [(0.0, SimRequest("a", p, max_tokens=1, ignore_eos=True)), (1.0, SimRequest("b", p, max_tokens=1, ignore_eos=True, model="lora-a")),
                    (2.0, SimRequest("c", p, max_tokens=1, ignore_eos=True, model="lora-a"))])
    assert run.seen["b"].cached == 0 and run.seen["c"].cached == 96


def test_eviction_under_memory_pressure() -> None:
    e = Engine(get_profile("llama3-8b-h100", num_gpu_blocks_override=16), seed=0)  # 256 tokens
    first = SimRequest("first", words("a", 96), max_tokens=1, ignore_eos=True)
    later = [(1.0 + i, SimRequest(f"f{i}", words(f"fill{i}_", 200), max_tokens=8, ignore_eos=True)) for i in range(3)]
    again = (10.0, SimRequest("again", words("a", 96), max_tokens=1, ignore_eos=True))
    run = drive(e, [(0.0, first), *later, again])
    assert run.seen["again"].cached == 0
    assert e.pool.evictions > 0
    # Without the pressure the same sequence hits.
    e2 = Engine(get_profile("llama3-8b-h100"), seed=0)
    run2 = drive(e2, [(0.0, first), again])
    assert run2.seen["again"].cached == 80


def test_ttft_grows_with_queueing(h100: Engine) -> None:
    reqs = [(0.0, SimRequest(f"r{i}", words(f"u{i}_", 4000), max_tokens=8, ignore_eos=True)) for i in range(8)]
    run = drive(h100, reqs)
    ttfts = [run.seen[f"r{i}"].first_at for i in range(8)]
    assert all(t is not None for t in ttfts)
    assert ttfts == sorted(ttfts)  # FIFO: a later place in the queue never answers earlier
    assert ttfts[-1] > 3 * ttfts[0]  # 8192-token budget: two prompts per step, so four prefill rounds


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    e = Engine(get_profile("llama3-8b-h100", max_num_batched_tokens=1024))
    run = drive(e, [(0.0, SimRequest("a", words("x", 4000), max_tokens=2, ignore_eos=True))])
    assert run.steps == 4 + 1  # ceil(4000 / 1024) prefill steps, then one decode step
    assert run.seen["a"].tokens == 2


def test_decode_joins_while_a_long_prefill_is_chunked() -> None:
    e = Engine(get_profile("llama3-8b-h100", max_num_batched_tokens=512))
    run = drive(e, [(0.0, SimRequest("short", "a b c", max_tokens=5, ignore_eos=True)), (0.001, SimRequest("long", words("y", 4000), max_tokens=1, ignore_eos=True))])
    assert run.seen["short"].done_at < run.seen["long"].first_at  # type: ignore[operator]


def test_preemption_recomputes_and_every_request_still_finishes() -> None:
    e = Engine(get_profile("llama3-8b-h100", num_gpu_blocks_override=12), seed=0)  # 192 tokens
    reqs = [(0.0, SimRequest(f"r{i}", words(f"z{i}_", 40), max_tokens=60, ignore_eos=True)) for i in range(3)]
    run = drive(e, reqs)
    assert e.stats.num_preemptions > 0
    assert all(s.tokens == 60 for s in run.seen.values())
    assert e.pool.num_used == 0 and e.num_running == 0 and e.num_waiting == 0


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound(h100: Engine) -> None:
    p = h100.profile
    h100.add_request(SimRequest("a", words("x", 8000), max_tokens=2, ignore_eos=True), 0.0)
    prefill = h100.step(0.0)
    decode = h100.step(prefill.end)
    assert prefill.num_prefill_tokens == 8000 and decode.num_decode_tokens == 1
    weights_s = p.model.weight_bytes / p.bytes_per_s
    assert decode.duration >= weights_s
    assert decode.duration < weights_s * 1.5
    compute_s = 8000 * 2 * p.model.params / p.flops_per_s
    assert prefill.duration >= compute_s and prefill.duration > 10 * decode.duration


def test_larger_batches_raise_throughput_but_slow_each_step() -> None:
    def decode_step(batch: int) -> float:
        e = Engine(get_profile("llama3-8b-h100"))
        for i in range(batch):
            e.add_request(SimRequest(f"r{i}", words(f"b{i}_", 500), max_tokens=4, ignore_eos=True), 0.0)
        t = 0.0
        while True:
            res = e.step(t)
            t = res.end
            if res.num_prefill_tokens == 0:
                return res.duration

    d1, d32, d128 = decode_step(1), decode_step(32), decode_step(128)
    assert d1 < d32 < d128
    assert 128 / d128 > 32 / d32 > 1 / d1


def test_busy_time_accounts_steps_and_partial_step(h100: Engine) -> None:
    h100.add_request(SimRequest("a", words("x", 100), max_tokens=3, ignore_eos=True), 10.0)
    total = 0.0
    t = h100.next_step_time()
    assert t == 10.0
    first = None
    while t is not None:
        res = h100.step(t)
        first = first or res
        total += res.duration
        t = h100.next_step_time()
    assert h100.stats.busy_seconds == pytest.approx(total)
    assert h100.busy_time(1e9) == pytest.approx(total)
    assert first is not None
    assert h100.busy_time(first.start + first.duration / 2) < h100.busy_time(first.end) + 1e-12


def test_abort_frees_blocks_and_drops_outputs(h100: Engine) -> None:
    h100.add_request(SimRequest("a", words("x", 100), max_tokens=50, ignore_eos=True), 0.0)
    res = h100.step(0.0)
    assert h100.kv_usage > 0
    assert h100.abort("a", res.end)
    assert not h100.abort("a", res.end)
    assert h100.kv_usage == 0 and not h100.has_work() and h100.next_step_time() is None
    assert h100.stats.requests_aborted == 1


def test_lora_slots_are_lru_with_a_load_cost() -> None:
    e = Engine(get_profile("llama3-8b-h100", max_loras=1), adapters=("l1", "l2"))
    run = drive(e, [(0.0, SimRequest("a", "x y", max_tokens=2, ignore_eos=True, model="l1")),
                    (0.0, SimRequest("b", "x y", max_tokens=2, ignore_eos=True, model="l2")),
                    (5.0, SimRequest("c", "x y", max_tokens=2, ignore_eos=True, model="l2"))])
    assert all(s.tokens == 2 for s in run.seen.values())
    assert e.stats.lora_loads == 2  # l1, then l2 once l1's request left its slot; c finds l2 loaded
    assert list(e.loaded_adapters) == ["l2"]
    assert run.seen["b"].first_at > run.seen["a"].done_at - 1e-9  # type: ignore[operator]


def test_lora_load_adds_its_cost_to_the_step() -> None:
    prof = get_profile("llama3-8b-h100")
    base = Engine(prof, adapters=("l1",))
    lora = Engine(prof, adapters=("l1",))
    base.add_request(SimRequest("a", "x y", max_tokens=1, ignore_eos=True), 0.0)
    lora.add_request(SimRequest("a", "x y", max_tokens=1, ignore_eos=True, model="l1"), 0.0)
    assert lora.step(0.0).duration == pytest.approx(base.step(0.0).duration + prof.lora_load_s)


def test_validation_errors(h100: Engine) -> None:
    with pytest.raises(ModelNotFound):
        h100.add_request(SimRequest("a", "x", model="nope"), 0.0)
    with pytest.raises(InvalidRequest):
        h100.add_request(SimRequest("a", "   "), 0.0)
    with pytest.raises(InvalidRequest, match="maximum context length"):
        h100.add_request(SimRequest("a", words("x", 8000), max_tokens=500), 0.0)
    h100.add_request(SimRequest("a", "x"), 0.0)
    with pytest.raises(InvalidRequest, match="already"):
        h100.add_request(SimRequest("a", "x"), 0.0)
    tiny = Engine(get_profile("llama3-8b-h100", num_gpu_blocks_override=2))
    with pytest.raises(InvalidRequest, match="KV cache"):
        tiny.add_request(SimRequest("a", words("x", 30), max_tokens=10), 0.0)


def test_default_max_tokens_applies_when_unset(h100: Engine) -> None:
    run = drive(h100, [(0.0, SimRequest("a", "x y", ignore_eos=True))], default_max=16)
    assert run.seen["a"].tokens == 16


def test_multi_turn_chat_reuses_the_generated_answer() -> None:
    """Turn 2 carries turn 1's answer; the blocks cached while generating it are hit."""
    e = Engine(get_profile("llama3-8b-h100"))
    turn1 = words("t", 30)
    run = drive(e, [(0.0, SimRequest("a", turn1, max_tokens=40, ignore_eos=True))])
    turn2 = turn1 + " " + run.seen["a"].text + " " + words("next", 10)
    run2 = drive(e, [(10.0, SimRequest("b", turn2, max_tokens=1, ignore_eos=True))])
    assert run2.seen["b"].cached == 64  # 30 + 40 - 1 tokens had KV; 4 full blocks of them are reusable
