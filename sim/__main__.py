"""`python -m sim`: run a fleet of simulated GPU servers until Ctrl-C / SIGTERM.

    python -m sim --host 127.0.0.1 --port 8001 --servers 4 --grpc-port 9001 \\
        --profile llama3-8b-h100 --flavor vllm

serves HTTP on 8001..8004 and gRPC on 9001..9004 and prints one line per server
(`name http://host:port grpc=host:port`). Port 0 picks free ports.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import uvloop

from .faults import Faults
from .fleet import grpc_available, start_fleet
from .kv_events import ENCODINGS, PUBLISH_AT, KVEventsConfig
from .metrics import FLAVORS
from .profiles import PROFILES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001, help="first HTTP port (0 = free ports)")
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--grpc-port", type=int, default=None, help="first gRPC port (0 = free ports); off if absent")
    p.add_argument("--profile", default="llama3-8b-h100", choices=sorted(PROFILES))
    p.add_argument("--flavor", default="vllm", help=f"metrics flavor, or a comma list per server: {', '.join(FLAVORS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speed", type=float, default=1.0, help="simulated seconds per wall second")
    p.add_argument("--model-name", default=None, help="served model name (default: the profile's model)")
    p.add_argument("--lora", action="append", default=[], help="a LoRA adapter name the servers know (repeat)")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="override the KV cache size in blocks")
    p.add_argument("--max-model-len", type=int, default=None, help="override the context length (e.g. 131072)")
    k = p.add_argument_group("KV-cache events (vLLM's --kv-events-config: ZeroMQ PUB + replay ROUTER)")
    k.add_argument("--kv-events-endpoint", default=None,
                   help="publish KV events here, e.g. tcp://127.0.0.1:5557 (server i: port + i; :* = free port); off if absent")
    k.add_argument("--kv-events-replay-endpoint", default=None, help="replay ROUTER endpoint (server i: port + i)")
    k.add_argument("--kv-events-topic", default="", help="ZeroMQ topic (first frame)")
    k.add_argument("--kv-events-encoding", default="map", choices=ENCODINGS,
                   help="map: tagged maps keyed by 'type' (vLLM main); array: positional arrays (vLLM <= 0.10)")
    k.add_argument("--kv-events-at", default="end", choices=PUBLISH_AT,
                   help="end: a step's events go out with its outputs (vLLM main); start: when it is scheduled, "
                        "before its blocks are computed (earlier vLLM releases)")
    k.add_argument("--block-size", type=int, default=None, help="KV block size in tokens (default: the profile's, 16)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve https:// (and grpcs://) with it")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g = p.add_argument_group("faults (also settable at run time: POST /sim/faults)")
    g.add_argument("--stall-ms", type=float, default=0.0, help="stall everything this long right after start")
    g.add_argument("--drop-after-chunks", type=int, default=None)
    g.add_argument("--fail-rate", type=float, default=0.0)
    g.add_argument("--fail-status", type=int, default=500)
    g.add_argument("--metrics-delay-ms", type=float, default=0.0)
    g.add_argument("--metrics-absent", action="store_true")
    g.add_argument("--health-fail", action="store_true")
    g.add_argument("--refuse-connections", action="store_true")
    g.add_argument("--background-requests", type=int, default=0)
    return p


async def _run(args: argparse.Namespace) -> int:
    flavors = args.flavor.split(",")
    for f in flavors:
        if f not in FLAVORS:
            print(f"error: unknown --flavor {f!r}; known: {', '.join(FLAVORS)}", file=sys.stderr)
            return 2
    if len(flavors) not in (1, args.servers):
        print(f"error: --flavor lists {len(flavors)} flavors for {args.servers} servers", file=sys.stderr)
        return 2
    if args.grpc_port is not None and not grpc_available():
        print("error: --grpc-port needs sim/grpc.py (the simulator's gRPC front end), which is missing",
              file=sys.stderr)
        return 2
    if (args.tls_cert is None) != (args.tls_key is None):
        print("error: --tls-cert and --tls-key are given together", file=sys.stderr)
        return 2
    faults = Faults()
    try:
        faults.update(
            {
                "stall_ms": args.stall_ms,
                "drop_after_chunks": args.drop_after_chunks,
                "fail_rate": args.fail_rate,
                "fail_status": args.fail_status,
                "metrics_delay_ms": args.metrics_delay_ms,
                "metrics_absent": args.metrics_absent,
                "health_fail": args.health_fail,
                "refuse_connections": args.refuse_connections,
                "background_requests": args.background_requests,
            }
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    overrides: dict[str, object] = {}
    if args.num_gpu_blocks:
        overrides["num_gpu_blocks_override"] = args.num_gpu_blocks
    if args.block_size:
        overrides["block_size"] = args.block_size
    kv_events = None
    if args.kv_events_endpoint:
        kv_events = KVEventsConfig(endpoint=args.kv_events_endpoint, topic=args.kv_events_topic,
                                   replay_endpoint=args.kv_events_replay_endpoint, encoding=args.kv_events_encoding,
                                   publish_at=args.kv_events_at)
    elif args.kv_events_replay_endpoint:
        print("error: --kv-events-replay-endpoint needs --kv-events-endpoint", file=sys.stderr)
        return 2
    try:
        fleet = await start_fleet(
            args.servers,
            host=args.host,
            port=args.port,
            grpc_port=args.grpc_port,
            profile=args.profile,
            flavor=flavors[0] if len(flavors) == 1 else flavors,
            seed=args.seed,
            faults=faults,
            speed=args.speed,
            adapters=args.lora,
            model_name=args.model_name,
            profile_overrides=overrides or None,
            max_model_len=args.max_model_len,
            kv_events=kv_events,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for s in fleet.servers:
        grpc = f" grpc={s.grpc_address}" if s.grpc_address else ""
        pub = s.backend.kv_publisher
        kv = ""
        if pub is not None:
            kv = f" kv_events={pub.endpoint}" + (f" kv_replay={pub.replay_endpoint}" if pub.replay_endpoint else "")
        print(f"{s.name} {s.url}{grpc}{kv} profile={args.profile} flavor={s.flavor}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await fleet.stop()
    print("stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return uvloop.run(_run(args))


if __name__ == "__main__":
    sys.exit(main())
