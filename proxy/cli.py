"""`affinity-proxy` command line: run, check-config, demo (and gpu-agent, added by the telemetry module).

Each subcommand is a small function taking the parsed arguments and returning an exit code, registered in
`build_parser`; a new subcommand is one `add_parser` block plus one function.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence

import uvloop

from proxy.agent import gpu_agent
from proxy.config import Config, ConfigError, dump_config, load_config, parse_config

EXIT_CONFIG_ERROR = 2


def _setup_logging(level: str, config: Config | None = None) -> None:
    """Application logs in the configured format (`logging.format`, JSON by default; proxy/observability)."""
    from proxy.observability.config import LoggingConfig
    from proxy.observability.logs import configure_logging

    configure_logging(config.logging if config is not None else LoggingConfig(), level)


def cmd_check_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        print(f"{exc.source}: invalid configuration", file=sys.stderr)
        for err in exc.errors:
            print(f"  {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(f"# {args.file}: valid; effective configuration:")
    print(dump_config(config), end="")
    return 0


def _log_native() -> None:
    """One line at start: is the compiled hot path (proxy/native) what serves, and if not, why."""
    from proxy.native.loader import status

    found = status()
    if found.active:
        logging.getLogger("proxy.native").info("native hot path: on (%d modules compiled with mypyc)",
                                               len(found.modules))
    else:
        logging.getLogger("proxy.native").info("native hot path: %s: %s", found.label(), found.reason)


def cmd_run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_CONFIG_ERROR
    _setup_logging(args.log_level, config)
    from proxy.app import AffinityProxy
    from proxy.gcsettings import tune_gc
    from proxy.multiproc.cpus import default_worker_count
    from proxy.multiproc.serve import serve

    workers = args.workers if args.workers is not None else default_worker_count()
    if workers < 1:
        print("--workers must be >= 1", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    _log_native()

    async def main() -> None:
        if workers == 1:
            # One process does everything: no supervisor, no channel, nothing to restart.
            proxy = AffinityProxy(config, config_path=args.config)
            tune_gc()  # the process is built: freeze what start-up made (proxy/gcsettings.py)
            await proxy.serve_until_signal()
        else:
            await serve(config, workers, config_path=args.config)

    try:
        uvloop.run(main())
    except OSError as exc:  # a listener that cannot bind: one line, not a traceback
        ports = {config.listen.port: "listen.port", config.admin.port: "admin.port"}
        if config.grpc_listen is not None:
            ports[config.grpc_listen.port] = "grpc_listen.port"
        print(bind_error_line(exc, ports, f" in {args.config}"), file=sys.stderr)
        return 1
    return 0


def bind_error_line(exc: OSError, ports: dict[int, str], where: str) -> str:
    """One line for a listener that cannot bind, naming the setting that chose its port."""
    text = exc.strerror or str(exc)
    for port, setting in ports.items():
        if port and f":{port}:" in text:
            return f"affinity-proxy: {text}; choose another port with {setting}{where}"
    return f"affinity-proxy: {text}"


def demo_config(
    backend_urls: Sequence[tuple[str, str] | tuple[str, str, str | None]], policy: str, port: int, admin_port: int,
    grpc_port: int | None = None,
) -> Config:
    """The built-in demo configuration: loopback listeners, debug headers on, the given backends
    (name, url[, gRPC address]); with `grpc_port`, the h2c/gRPC listener too."""
    lines = []
    for name, url, *rest in backend_urls:
        grpc_address = rest[0] if rest else None
        extra = f", grpc: '{grpc_address}'" if grpc_address else ""
        lines.append(f"  - {{name: {name}, url: '{url}'{extra}}}")
    backends = "\n".join(lines)
    grpc_listen = f"grpc_listen: {{host: 127.0.0.1, port: {grpc_port}}}\n" if grpc_port is not None else ""
    return parse_config(
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f"{grpc_listen}"
        f"admin: {{host: 127.0.0.1, port: {admin_port}}}\n"
        "debug_headers: true\n"
        f"routing: {{policy: {policy}}}\n"
        f"backends:\n{backends}\n",
        "<demo>",
    )


def demo_banner(proxy_url: str, admin_url: str, backends: Sequence[tuple[str, str, str | None]], policy: str, model: str,
                grpc_address: str | None = None) -> str:
    lines = [
        f"affinity-proxy demo: {len(backends)} simulated backends, policy {policy}",
        *(f"  backend {b[0]:<8} {b[1]}" + (f"   gRPC {b[2]}" if len(b) > 2 and b[2] else "") for b in backends),
        "",
        f"proxy  {proxy_url}   (OpenAI-compatible: /v1/chat/completions, /v1/completions, /v1/models)",
        *([f"gRPC   {grpc_address}   (h2c: affinity.v1.Generation, KServe v2 ModelInfer, grpc.health.v1)"]
          if grpc_address else []),
        f"admin  {admin_url}/admin/backends   {admin_url}/metrics",
        "",
        "try it (the x-affinity-backend response header names the backend that answered):",
        f"  curl -si {proxy_url}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 16}}'",
        "",
        f"{sys.executable} - <<'PY'",
        "from openai import OpenAI",
        f"client = OpenAI(base_url=\"{proxy_url}/v1\", api_key=\"unused\")",
        f"stream = client.chat.completions.create(model=\"{model}\", stream=True, max_tokens=32,",
        "    messages=[{\"role\": \"user\", \"content\": \"Tell me about KV caches.\"}])",
        "for chunk in stream:",
        "    print(chunk.choices[0].delta.content or \"\", end=\"\", flush=True)",
        "print()",
        "PY",
        "",
        *(demo_grpc_example(grpc_address, model) if grpc_address else []),
        "Ctrl-C stops the proxy and the backends.",
    ]
    return "\n".join(lines)


def demo_grpc_example(grpc_address: str, model: str) -> list[str]:
    """The banner's gRPC lines: a grpcio call on the committed message classes (no codegen step), and
    grpcurl for those who have it (the proxy serves no reflection, so it reads the .proto)."""
    proto = Path(__file__).resolve().parent / "protos" / "generate.proto"
    return [
        "gRPC (grpcio; each call is routed on its own, reply.backend names the backend):",
        f"{sys.executable} - <<'PY'",
        "import grpc",
        "from proxy.protos import generate_pb2 as pb",
        f"channel = grpc.insecure_channel(\"{grpc_address}\")",
        "generate = channel.unary_unary(\"/affinity.v1.Generation/Generate\",",
        "    request_serializer=pb.GenerateRequest.SerializeToString,",
        "    response_deserializer=pb.GenerateResponse.FromString)",
        f"reply = generate(pb.GenerateRequest(model=\"{model}\", prompt=\"Tell me about KV caches.\",",
        "    max_tokens=16), timeout=30)",
        "print(reply.backend, reply.text)",
        "PY",
        "",
        "  or: grpcurl -plaintext -import-path " + str(proto.parent) + " -proto generate.proto \\",
        f"        -d '{{\"model\": \"{model}\", \"prompt\": \"Hello!\", \"max_tokens\": 16}}' \\",
        f"        {grpc_address} affinity.v1.Generation/Generate",
        "",
    ]


def cmd_demo(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    from sim.fleet import start_fleet
    from proxy.app import AffinityProxy

    async def main() -> None:
        grpc_on = args.grpc_port >= 0
        fleet = await start_fleet(args.backends, host="127.0.0.1", port=0, grpc_port=0 if grpc_on else None)
        try:
            backends = [(s.name, s.url, s.grpc_address) for s in fleet.servers]
            config = demo_config(backends, args.policy, args.port, args.admin_port,
                                 args.grpc_port if grpc_on else None)
            proxy = AffinityProxy(config)
            async def announce() -> None:
                model = fleet.servers[0].backend.engine.model_name
                own_port = config.grpc_listen is not None  # (HTTP/2 and gRPC are on the main port too)
                grpc_address = proxy.grpc.address if proxy.grpc is not None and own_port else None
                print(demo_banner(proxy.http_url, proxy.admin_url, backends, args.policy, model, grpc_address),
                      flush=True)

            proxy.add_task("demo-banner", announce)
            await proxy.serve_until_signal()
        finally:
            await fleet.stop()

    try:
        uvloop.run(main())
    except OSError as exc:  # a busy port: one line naming the flag, not a traceback
        ports = {args.port: "--port", args.admin_port: "--admin-port", args.grpc_port: "--grpc-port"}
        print(bind_error_line(exc, ports, " (0 = any free port)"), file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="affinity-proxy",
        description="L7 reverse proxy for LLM inference servers: routes by prompt affinity and live GPU load.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run the proxy from a YAML configuration")
    p.add_argument("--config", "-c", required=True, metavar="FILE")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--workers", "-w", type=int, default=None, metavar="N",
        help="data-plane processes sharing the listeners (SO_REUSEPORT) under one control plane; "
        "default: the CPUs this process may use (affinity mask and cgroup quota); 1 = a single process",
    )
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check-config", help="validate a configuration; print it with defaults, or every error")
    p.add_argument("file", metavar="FILE")
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser("demo", help="start simulated backends and the proxy in front of them (no GPU needed)")
    p.add_argument("--backends", type=int, default=4, metavar="N", help="simulated backends (default 4)")
    p.add_argument("--policy", default="affinity", help="routing policy (default affinity)")
    p.add_argument("--port", type=int, default=8080, help="proxy port (default 8080; 0 = any free port)")
    p.add_argument("--admin-port", type=int, default=9090, help="admin port (default 9090; 0 = any free port)")
    p.add_argument("--grpc-port", type=int, default=8081,
                   help="h2c/gRPC listener port (default 8081; 0 = any free port; -1 = no gRPC)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "gpu-agent",
        help="export this node's GPU memory/utilisation (NVML) and the local engine's queue and KV growth",
    )
    gpu_agent.add_arguments(p)
    p.set_defaults(func=gpu_agent.cmd_gpu_agent)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_CONFIG_ERROR


if __name__ == "__main__":
    sys.exit(main())
