"""`python -m loadtest.calibrate --profile llama3-8b-h100`: the simulator's headline figures next to public ones.

Everything routing claims rest on (how long a prefill takes, how decode slows as batches grow, how many
tokens a GPU can keep cached) comes from the engine model; this command measures those figures on the
model itself, in virtual time (no sockets, no waiting), and prints them beside published vLLM measurements
for the same model and GPU where such a figure exists, with the ratio sim / reference.

References carry their kind: "measured" (a published vLLM measurement on that GPU) or "derived" (vLLM's own
published accounting applied to this GPU). A published figure is never bent to fit a row: where it was
measured in another setup (vLLM's latency test: 8 prompts of 32 tokens, 128 tokens out; vLLM's offline
throughput benchmark: 1000 prompts of 1000 tokens, 100 out), the engine is run in that same setup in virtual
time and that row is compared instead. A row without a reference says
so rather than inventing one; the roofline ideal (peak FLOP/s or bandwidth, no overheads) is always shown to
bound the figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from sim.api import SimRequest
from sim.engine import Engine
from sim.profiles import PROFILES, Profile, get_profile


@dataclass(frozen=True)
class Reference:
    value: float
    kind: str  # measured | derived
    source: str


# vLLM's own performance benchmark report on Buildkite, "Latency tests": input length 32 tokens, output length
# 128 tokens, batch size fixed at 8, end-to-end latency (mean, median, p99) per (model, GPU). The page prints
# neither the vLLM version nor the dtype. The sim runs the same batch in virtual time (batch_latency).
_NIGHTLY_LATENCY = (
    "vLLM 'Performance Benchmark' Buildkite report, 'Latency tests' table (input 32 tokens, output 128 "
    "tokens, batch size 8, end-to-end latency; models llama-3.1 8B tp1, llama-3 70B tp4)"
)

# Llama-3(.1)-8B bf16 served by vLLM on one H100 SXM 80GB.
_H100_8B: dict[str, Reference] = {
    "kv_capacity_tokens": Reference(
        451_000,
        "derived",
        "vLLM memory profiling (gpu_memory_utilization 0.9 of 79.65 GiB) minus the 14.99 GiB of weights and "
        "~1.6 GiB activation/non-torch memory vLLM logs for Llama-3.1-8B (vllm-project/vllm#10517), "
        "/ 128 KiB per token",
    ),
    "decode_tok_s_b1": Reference(
        1000 / 6.48,
        "measured",
        "TPOT p50 6.48 ms at concurrency 1 = 154 tok/s, vLLM 0.21.0, Llama-3.1-8B-Instruct fp16 on one "
        "H100-80GB-HBM3 (InferenceBench 'Recipe: concurrency sweep', yobitelcomm.github.io/bench); "
        "consistent with 75 tok/s = 77% of roofline on an A100 40GB (johnmusgrave.com, vLLM 0.23)",
    ),
    "offline_req_s": Reference(
        20.72,
        "measured",
        "vLLM v0.4.1 on H100, benchmark_throughput.py --input-len 1000 --output-len 100 --model "
        "meta-llama/Meta-Llama-3-8B-Instruct (defaults: 1000 prompts, ignore_eos, no prefix caching, no "
        "chunked prefill): 'Throughput: 20.72 r[equests/s]' (vllm-project/vllm#4600, 'bump version to "
        "v0.4.2', v0.4.1 8B section; the stored excerpt ends after '20.72 r', the unit is the script's "
        "'requests/s' print)",
    ),
    "latency_b8_s": Reference(
        0.997542,
        "measured",
        "mean 997.542 ms for latency_llama8B_tp1 on H100 (GPU column '8xH100': the 8-GPU benchmark machine, "
        "tp=1 uses one) in " + _NIGHTLY_LATENCY + "; stored copy of the report page is filed under "
        "buildkite.com/elastic/enterprise-search-ruby/builds/571 (mis-titled crawl; the content is vLLM's "
        "report). vLLM version and dtype not printed in the table",
    ),
}

# Llama-3.1-8B bf16 on one H200 141GB.
_H200_8B: dict[str, Reference] = {
    "latency_b8_s": Reference(
        0.833421,
        "measured",
        "mean 833.421 ms for latency_llama8B_tp1 on H200 in " + _NIGHTLY_LATENCY
        + " (buildkite.com/vllm/performance-benchmark/builds/9515). vLLM version and dtype not printed in the table",
    ),
}

# Llama-3-70B bf16 on 4 x H100 SXM 80GB, tensor parallel 4.
_H100X4_70B: dict[str, Reference] = {
    "latency_b8_s": Reference(
        2.44447,
        "measured",
        "mean 2444.47 ms for latency_llama70B_tp4 on H100 (tp=4 on the 8xH100 benchmark machine) in "
        + _NIGHTLY_LATENCY + "; same stored page as the 8B H100 row (buildkite.com/elastic/"
        "enterprise-search-ruby/builds/571, mis-titled crawl). vLLM version and dtype not printed in the table",
    ),
}

_REFERENCES: dict[str, dict[str, Reference]] = {
    "llama3-8b-h100": _H100_8B,
    "llama3-8b-h200": _H200_8B,
    "llama3-70b-4xh100": _H100X4_70B,
}

_NO_REFERENCE = (
    "no published vLLM figure for this point, on this model, GPU and dtype, was found in the searched public "
    "material (vLLM blog posts and docs, vLLM nightly benchmark reports, vllm-project issues/PRs, SGLang, "
    "Lambda, Azure, Ori, InferenceBench write-ups): what exists is ShareGPT-mix throughput, FP8 weights, other "
    "GPUs, or numbers only in figures; the roofline ideal bounds it"
)

# vLLM nightly latency-test setup, replayed in the engine for the matched-setup row.
LATENCY_BATCH, LATENCY_PROMPT, LATENCY_OUTPUT = 8, 32, 128
# vLLM benchmark_throughput setup of vllm-project/vllm#4600: 1000 prompts of 1000 tokens, 100 out, all queued
# at once; that vLLM (v0.4.x) scheduled at most 256 sequences (its max_num_seqs default).
OFFLINE_PROMPTS, OFFLINE_INPUT, OFFLINE_OUTPUT, OFFLINE_MAX_SEQS = 1000, 1000, 100, 256


def _words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


def ttft(profile: Profile, prompt_tokens: int) -> float:
    """Seconds from arrival to first token for one request on an idle engine."""
    e = Engine(profile)
    e.add_request(SimRequest("r", _words("t", prompt_tokens), max_tokens=1, ignore_eos=True), 0.0)
    t = e.next_step_time()
    end = 0.0
    while t is not None:
        res = e.step(t)
        end = res.end
        t = e.next_step_time()
    return end


def prefill_throughput(profile: Profile, prompt_tokens: int = 1024, n: int = 64) -> float:
    """Prompt tokens per second while a queue of `n` prompts is prefilled back to back."""
    e = Engine(profile)
    for i in range(n):
        e.add_request(SimRequest(f"r{i}", _words(f"p{i}_", prompt_tokens), max_tokens=1, ignore_eos=True), 0.0)
    t = e.next_step_time()
    tokens = 0
    busy = 0.0
    while t is not None:
        res = e.step(t)
        tokens += res.num_prefill_tokens
        busy += res.duration
        t = e.next_step_time()
    return tokens / busy


def decode_throughput(profile: Profile, batch: int, context: int = 1024, out: int = 128) -> tuple[float, float]:
    """(output tok/s, ms per step) over the pure-decode steps of `batch` requests of `context` tokens."""
    e = Engine(profile)
    for i in range(batch):
        e.add_request(SimRequest(f"r{i}", _words(f"d{i}_", context), max_tokens=out, ignore_eos=True), 0.0)
    t = e.next_step_time()
    tokens = 0
    dur = 0.0
    steps = 0
    while t is not None:
        res = e.step(t)
        if res.num_prefill_tokens == 0 and res.num_seqs == batch:
            tokens += res.num_decode_tokens
            dur += res.duration
            steps += 1
        t = e.next_step_time()
    return tokens / dur, 1000.0 * dur / steps


def batch_latency(profile: Profile, batch: int = LATENCY_BATCH, prompt_tokens: int = LATENCY_PROMPT,
                  output_tokens: int = LATENCY_OUTPUT) -> float:
    """Seconds until the last of `batch` requests, all submitted at once, has produced `output_tokens`.

    This is the shape of vLLM's latency test (one batch of fixed-length prompts generating a fixed number of
    tokens, timed end to end), so its published figure is compared with the engine run in that setup."""
    e = Engine(profile)
    for i in range(batch):
        e.add_request(
            SimRequest(f"b{i}", _words(f"b{i}_", prompt_tokens), max_tokens=output_tokens, ignore_eos=True), 0.0
        )
    t = e.next_step_time()
    end = 0.0
    while t is not None:
        end = e.step(t).end
        t = e.next_step_time()
    return end


def offline_throughput(profile: Profile, n: int = OFFLINE_PROMPTS, prompt_tokens: int = OFFLINE_INPUT,
                       output_tokens: int = OFFLINE_OUTPUT, max_num_seqs: int = OFFLINE_MAX_SEQS) -> float:
    """Requests per second when `n` distinct prompts are queued at once and all run to `output_tokens`.

    The shape of vLLM's benchmark_throughput (LLM.generate over the whole list, ignore_eos). Prompts are
    distinct words so no prefix is shared (that benchmark ran without prefix caching); prefill dominates."""
    e = Engine(profile.with_overrides(max_num_seqs=max_num_seqs))
    for i in range(n):
        e.add_request(
            SimRequest(f"o{i}", _words(f"o{i}_", prompt_tokens), max_tokens=output_tokens, ignore_eos=True), 0.0
        )
    t = e.next_step_time()
    end = 0.0
    while t is not None:
        end = e.step(t).end
        t = e.next_step_time()
    return n / end


def ideal(profile: Profile, key: str) -> float | None:
    m = profile.model
    peak_flops = profile.gpu.peak_bf16_flops * profile.tp
    bw = profile.gpu.hbm_bytes_per_s * profile.tp
    if key == "prefill_tok_s":
        return peak_flops / (2 * m.params)
    if key.startswith("decode_tok_s_b"):
        b = int(key.removeprefix("decode_tok_s_b"))
        return b / ((m.weight_bytes + b * 1024 * m.kv_bytes_per_token) / bw)
    if key == "ttft_1k_s":
        return 1024 * 2 * m.params / peak_flops
    if key == "ttft_8k_s":
        return 8192 * 2 * m.params / peak_flops
    if key == "offline_req_s":
        return peak_flops / (2 * m.params * (OFFLINE_INPUT + OFFLINE_OUTPUT))
    if key == "latency_b8_s":
        b, n_in, n_out = LATENCY_BATCH, LATENCY_PROMPT, LATENCY_OUTPUT
        prefill = b * n_in * 2 * m.params / peak_flops
        decode = n_out * (m.weight_bytes + b * (n_in + n_out / 2) * m.kv_bytes_per_token) / bw
        return prefill + decode
    return None


def calibrate(name: str) -> list[dict[str, object]]:
    profile = get_profile(name)
    rows: list[tuple[str, str, float]] = [
        ("prefill_tok_s", "prefill tokens/s (64 x 1k prompts, queued)", prefill_throughput(profile)),
    ]
    for b in (1, 32, 128):
        tok_s, step_ms = decode_throughput(profile, b)
        rows.append((f"decode_tok_s_b{b}", f"decode tokens/s at batch {b} (1k context; {step_ms:.2f} ms/step)", tok_s))
    rows.append(("ttft_1k_s", "TTFT, 1k-token prompt, idle server (s)", ttft(profile, 1024)))
    rows.append(("ttft_8k_s", "TTFT, 8k-token prompt, idle server (s)", ttft(profile, 8000)))
    rows.append(("kv_capacity_tokens", "KV cache capacity (tokens)", float(profile.kv_capacity_tokens)))
    rows.append((
        "offline_req_s",
        f"{OFFLINE_PROMPTS} x {OFFLINE_INPUT} in / {OFFLINE_OUTPUT} out queued, max {OFFLINE_MAX_SEQS} seqs (req/s)",
        offline_throughput(profile),
    ))
    rows.append((
        "latency_b8_s",
        f"batch {LATENCY_BATCH} x {LATENCY_PROMPT} in / {LATENCY_OUTPUT} out, end to end (s)",
        batch_latency(profile),
    ))
    refs = _REFERENCES.get(name, {})
    out: list[dict[str, object]] = []
    for key, label, value in rows:
        ref = refs.get(key)
        out.append(
            {
                "key": key,
                "label": label,
                "sim": value,
                "ideal": ideal(profile, key),
                "reference": ref.value if ref else None,
                "ratio": value / ref.value if ref else None,
                "kind": ref.kind if ref else None,
                "source": ref.source if ref else _NO_REFERENCE,
            }
        )
    return out


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    assert isinstance(v, (int, float))
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.4g}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="llama3-8b-h100", choices=sorted(PROFILES))
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = p.parse_args(argv)
    rows = calibrate(args.profile)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    prof = get_profile(args.profile)
    print(f"profile {prof.name}: {prof.model.name} on {prof.tp} x {prof.gpu.name} "
          f"(MFU {prof.mfu_prefill}, MBU {prof.mbu_decode}, step overhead {prof.step_overhead_s * 1e3:.1f} ms)")
    print(f"{'figure':58} {'sim':>10} {'ideal':>10} {'vLLM ref':>10} {'ratio':>6}  kind")
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        print(f"{r['label']:58} {_fmt(r['sim']):>10} {_fmt(r['ideal']):>10} {_fmt(r['reference']):>10} {ratio:>6}  {r['kind'] or '-'}")
    print("\nsources:")
    seen = set()
    for r in rows:
        src = str(r["source"])
        if src not in seen:
            seen.add(src)
            print(f"  - [{r['key']}] {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
