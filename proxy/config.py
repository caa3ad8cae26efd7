"""YAML configuration -> frozen dataclasses, with errors that name their YAML path and line.

The parser is driven by the dataclasses' type hints, not by a schema kept beside them, so a section is
added by writing one frozen dataclass WITH DEFAULTS (in the owner's own module) and adding one field of that
type to `Config`. Supported field types: str, int, float, bool, enums (by value), `Literal[...]`,
`X | None`, `tuple[X, ...]`, `list[X]`, `dict[str, X]`, nested dataclasses and `Any` (raw YAML value).

Constraints live next to the field, in its metadata, so the error can point at the offending line:
``field(default=0.25, metadata={"ge": 0})`` (keys: ge, gt, le, lt, min_len, doc). Cross-field rules go in a
``validate(self) -> Iterable[tuple[str, str]]`` method on the dataclass, yielding (field name, a dotted
path below it such as ``routing.policy`` or ``backends[2].url``, or "", and a message); they are reported
at that field's line. Both are checked by the one bounds checker, proxy/core/bounds.py: every section calls
`check_config(self)` in its ``__post_init__``, so a config built in code meets the same rules, and this
parser calls the same functions field by field to name the YAML line. Numbers must be finite everywhere.

A configuration with no backend is invalid unless discovery is on, and so is an empty file: a file caught
half-written by a reload must never empty the fleet (proxy/control/reload.py keeps the old one).

Every problem in a file is collected and reported together (`ConfigError.errors`), because fixing a config
one error per run is miserable.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import ipaddress
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Union
from urllib.parse import urlsplit

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from proxy.control.lora_pool import LoraPoolConfig
from proxy.control.telemetry_config import TelemetryConfig
from proxy.core.bounds import ConfigValueError, above, check_config, config_errors, value_errors
from proxy.core.experiments import ExperimentsConfig, backend_group_errors
from proxy.core.health import HealthCheckConfig, OutlierConfig
from proxy.core.overload import OverloadConfig
from proxy.core.registry import policy_name_error
from proxy.core.retry_policy import RetryConfig
from proxy.core.hotspots import HotspotConfig
from proxy.core.routing_config import RoutingConfig
from proxy.core.snapshot import WEIGHT_BOUNDS, BackendSpec, duplicate_urls
from proxy.grpc.grpc_config import GrpcOptions
from proxy.observability.config import LoggingConfig, TracingConfig
from proxy.tls import BackendTlsConfig, TlsConfig

__all__ = [
    "AdminConfig",
    "BackendConfig",
    "Config",
    "ConfigError",
    "DiscoveryConfig",
    "LimitsConfig",
    "ListenConfig",
    "TimeoutsConfig",
    "UpstreamConfig",
    "dump_config",
    "is_dns_name",
    "load_config",
    "parse_config",
    "parse_section",
    "url_host_port",
]


class ConfigError(ValueError):
    """Every problem found in one configuration, each as ``path (line N): message``."""

    def __init__(self, errors: list[str], source: str = "<config>") -> None:
        self.errors = errors
        self.source = source
        super().__init__(f"{source}: {len(errors)} error(s)\n" + "\n".join(f"  {e}" for e in errors))


# ---------------------------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ListenConfig:
    host: str = "127.0.0.1"
    port: int = field(default=8080, metadata={"ge": 0, "le": 65535})
    tls: TlsConfig | None = None  # serve TLS with this certificate (proxy/tls.py)

    def __post_init__(self) -> None:
        check_config(self)


@dataclass(frozen=True)
class AdminConfig:
    host: str = "127.0.0.1"
    port: int = field(default=9090, metadata={"ge": 0, "le": 65535})
    # Bearer token for admin write endpoints; `token_env` names an environment variable holding it so the
    # secret need not live in the file.
    token: str | None = None
    token_env: str | None = None
    tls: TlsConfig | None = None  # serve the admin listener over TLS (proxy/tls.py)

    def __post_init__(self) -> None:
        check_config(self)

    def resolved_token(self) -> str | None:
        if self.token is not None:
            return self.token
        if self.token_env is not None:
            return os.environ.get(self.token_env) or None
        return None


@dataclass(frozen=True)
class BackendConfig:
    name: str = field(metadata={"min_len": 1})
    url: str = field(metadata={"min_len": 1})
    weight: float = field(default=1.0, metadata=WEIGHT_BOUNDS)  # the same bound as the admin API's
    grpc: str | None = None  # host:port of the backend's gRPC server
    metrics_url: str | None = None
    models: tuple[str, ...] = ()
    max_inflight: int | None = field(default=None, metadata={"ge": 1})
    # How https:// and grpcs:// are verified (CA bundle, SNI name, client certificate); system CAs if unset.
    tls: BackendTlsConfig | None = None
    adapters: tuple[str, ...] = ()  # LoRA adapters loaded there (served as models of their own)

    def __post_init__(self) -> None:
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        if not self.url.startswith(("http://", "https://")):
            yield "url", f"must start with http:// or https://, got {self.url!r}"
        if self.grpc is not None and ":" not in self.grpc.removeprefix("grpcs://"):
            yield "grpc", f"must be host:port or grpcs://host:port (TLS), got {self.grpc!r}"

    def to_spec(self) -> BackendSpec:
        return BackendSpec(
            name=self.name,
            url=self.url.rstrip("/"),
            weight=self.weight,
            grpc_address=self.grpc,
            metrics_url=self.metrics_url,
            # A backend restricted to some models also serves its declared adapters.
            models=self.models + tuple(a for a in self.adapters if a not in self.models) if self.models else (),
            max_inflight=self.max_inflight,
            adapters=self.adapters,
        )


@dataclass(frozen=True)
class ModelAliasConfig:
    """`models.<public name>`: the model the backends serve under that name, and one to use instead when
    no backend of it is routable (down, drained or ejected)."""

    served: str = field(metadata={"min_len": 1})
    fallback: str | None = None

    def __post_init__(self) -> None:
        check_config(self)


@dataclass(frozen=True)
class LimitsConfig:
    max_body_bytes: int = field(default=10 * 1024 * 1024, metadata={"ge": 1})
    max_header_bytes: int = field(default=16384, metadata={"ge": 256})
    max_inflight_total: int | None = field(default=None, metadata={"ge": 1})
    # Open HTTP/1.1 connections one client address may hold (429 and close beyond); None: no cap.
    max_connections_per_client: int | None = field(default=None, metadata={"ge": 1})

    def __post_init__(self) -> None:
        check_config(self)


@dataclass(frozen=True)
class TimeoutsConfig:
    connect_s: float = field(default=5.0, metadata={"gt": 0})
    request_s: float = field(default=600.0, metadata={"gt": 0})  # whole upstream exchange, streams included
    drain_s: float = field(default=30.0, metadata={"ge": 0})  # graceful-shutdown deadline
    # HTTP/1.1 clients (proxy/http/server.py): a request head must be complete this long after its first
    # byte; a body may pause this long between bytes and take this long in all; an idle keep-alive
    # connection is closed after this long. Defaults as nginx's client_header/body timeouts, keepalive 75 s.
    client_header_s: float = field(default=10.0, metadata={"gt": 0})
    client_body_idle_s: float = field(default=30.0, metadata={"gt": 0})
    client_body_s: float = field(default=300.0, metadata={"gt": 0})
    client_keepalive_s: float = field(default=75.0, metadata={"gt": 0})

    def __post_init__(self) -> None:
        check_config(self)


@dataclass(frozen=True)
class UpstreamConfig:
    connections_per_backend: int = field(default=256, metadata={"ge": 1})
    # Idle upstream connections are reused for at most this long and then closed (the idle TTL: no ghost
    # connections to a backend that went quiet or left). It must stay below the backends' own keep-alive
    # (uvicorn, behind vLLM/SGLang, closes after 5 s): reusing a connection the server is closing fails a
    # POST with ServerDisconnectedError. Hence 4 s by default.
    keepalive_s: float = field(default=4.0, metadata={"gt": 0})

    def __post_init__(self) -> None:
        check_config(self)


def is_dns_name(host: str | None) -> bool:
    """A host that DNS discovery re-resolves: a name, not an IPv4/IPv6 literal (proxy/control/discovery.py)."""
    if not host:
        return False
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return True
    return False


def url_host_port(url: str) -> tuple[str | None, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


@dataclass(frozen=True)
class DiscoveryConfig:
    """YAML `discovery`: backends whose URL host is a DNS name are re-resolved (Kubernetes headless Service)."""

    enabled: bool = False
    interval_ms: int = above(5000, 0)
    timeout_ms: int = above(2000, 0)

    def __post_init__(self) -> None:
        check_config(self)


@dataclass(frozen=True)
class Config:
    """The whole configuration. Sections owned by other modules are added here as one field each."""

    listen: ListenConfig = ListenConfig()
    grpc_listen: ListenConfig | None = None
    grpc: GrpcOptions = GrpcOptions()  # gRPC listener behaviour: extractors per method, windows (proxy/grpc)
    admin: AdminConfig = AdminConfig()
    debug_headers: bool = False
    backends: tuple[BackendConfig, ...] = ()
    # Public model names -> served names (+ fallback): the request body's `model` is rewritten on the way
    # (HTTP/1.1, the HTTP/2 bridge and gRPC Generate/KServe; proxy/dataplane/router.py `Router.resolve_model`).
    models: dict[str, ModelAliasConfig] = field(default_factory=dict)
    routing: RoutingConfig = RoutingConfig()
    limits: LimitsConfig = LimitsConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    health_checks: HealthCheckConfig = HealthCheckConfig()
    outlier_detection: OutlierConfig = OutlierConfig()
    retries: RetryConfig = RetryConfig()
    overload: OverloadConfig = OverloadConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    lora_pool: LoraPoolConfig = LoraPoolConfig()  # LoRA adapter loads/unloads by demand (proxy/control/lora_pool.py)
    logging: LoggingConfig = LoggingConfig()  # log format and the access log (proxy/observability)
    hotspots: HotspotConfig = HotspotConfig()  # heat-map windows and hot-spot rules (proxy/core/hotspots.py)
    tracing: TracingConfig = TracingConfig()  # OpenTelemetry spans over OTLP/HTTP (proxy/observability/tracing.py)
    experiments: ExperimentsConfig = ExperimentsConfig()  # live A/B arms and canary groups (proxy/core/experiments.py)

    def __post_init__(self) -> None:
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        if not self.backends and not self.discovery.enabled:
            yield "backends", "at least one backend is required (unless discovery is enabled)"
        names: dict[str, int] = {}
        for i, b in enumerate(self.backends):
            if b.name in names:
                yield f"backends[{i}].name", f"duplicate backend name {b.name!r} (also backends[{names[b.name]}])"
            names.setdefault(b.name, i)
        specs = self.backend_specs()
        for i, j in duplicate_urls(specs):
            yield f"backends[{i}].url", f"duplicate backend URL {specs[i].url!r} (also backends[{j}])"
        for name, alias in self.models.items():
            if alias.fallback is not None and alias.fallback in (name, alias.served):
                yield f"models.{name}.fallback", "must name another model than the alias and its served model"
        policy = policy_name_error(self.routing.policy)
        if policy is not None:
            yield "routing.policy", policy
        yield from self._port_clashes()
        yield from self._kv_event_errors()
        if not self.discovery.enabled:  # discovered backends are not known yet: their names cannot be checked
            yield from backend_group_errors(self.experiments, [b.name for b in self.backends])

    def _kv_event_errors(self) -> Iterable[tuple[str, str]]:
        """`telemetry.kv_events.backends` entries that name a backend discovered by DNS (one backend per
        address) are templates for each address: their endpoints must say where the address goes
        (``{host}``); a ``{host}`` needs a backend whose URL host can stand for it."""
        urls = {b.name: b.url for b in self.backends}
        for name, ep in self.telemetry.kv_events.backends.items():
            url = urls.get(name)
            templated = "{host}" in ep.endpoint or "{host}" in (ep.replay_endpoint or "")
            if url is None:
                if templated:
                    yield (f"telemetry.kv_events.backends.{name}", "uses {host} but names no backend "
                           "(it stands for the backend's URL host)")
                continue
            if self.discovery.enabled and is_dns_name(url_host_port(url)[0]) and "{host}" not in ep.endpoint:
                yield (f"telemetry.kv_events.backends.{name}.endpoint",
                       f"{name} is discovered by DNS (one backend per address): name the address as {{host}}, "
                       f"e.g. 'tcp://{{host}}:5557', so that each one subscribes to its own engine")

    def _port_clashes(self) -> Iterable[tuple[str, str]]:
        """Two listeners on one port: the second bind would fail at start (or, with SO_REUSEPORT, the two
        would share connections). A port of 0 picks a free one and never clashes."""
        listeners: list[tuple[str, ListenConfig | AdminConfig]] = [("listen", self.listen), ("admin", self.admin)]
        if self.grpc_listen is not None:
            listeners.append(("grpc_listen", self.grpc_listen))
        for i, (name, cfg) in enumerate(listeners):
            for other_name, other in listeners[:i]:
                if cfg.port != 0 and cfg.port == other.port and _hosts_overlap(cfg.host, other.host):
                    yield f"{name}.port", f"port {cfg.port} is already used by {other_name}.port"
                    break

    def backend_specs(self) -> tuple[BackendSpec, ...]:
        return tuple(b.to_spec() for b in self.backends)

    def model_aliases(self) -> dict[str, tuple[str, str | None]]:
        """`models` as the router takes it: public name -> (served name, fallback or None)."""
        return {name: (a.served, a.fallback) for name, a in self.models.items()}


_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "*"})


def _hosts_overlap(a: str, b: str) -> bool:
    return a == b or a in _WILDCARD_HOSTS or b in _WILDCARD_HOSTS


# ---------------------------------------------------------------------------------------------- parser


class _Missing:
    pass


_MISSING = _Missing()
_constructor = SafeConstructor()


class _Parser:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def error(self, path: str, node: Node | None, message: str) -> None:
        where = path or "<top>"
        if node is not None:
            where += f" (line {node.start_mark.line + 1})"
        self.errors.append(f"{where}: {message}")

    def parse(self, tp: Any, node: Node, path: str) -> Any:
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if tp is Any:
            return self.construct(node, path)
        if origin in (Union, types.UnionType):
            non_none = [a for a in args if a is not type(None)]
            if _is_null(node) and len(non_none) < len(args):
                return None
            if len(non_none) == 1:
                return self.parse(non_none[0], node, path)
            raise TypeError(f"config field {path}: unions other than Optional are not supported ({tp})")
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self.parse_dataclass(tp, node, path)
        if origin is Literal:
            value = self.scalar(node, path)
            if value is _MISSING:
                return _MISSING
            if value not in args:
                self.error(path, node, f"must be one of {', '.join(map(repr, args))}, got {value!r}"
                           + _suggest(str(value), [str(a) for a in args]))
                return _MISSING
            return value
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            value = self.scalar(node, path)
            if value is _MISSING:
                return _MISSING
            choices = [m.value for m in tp]
            try:
                return tp(value)
            except ValueError:
                self.error(path, node, f"must be one of {', '.join(map(repr, choices))}, got {value!r}"
                           + _suggest(str(value), [str(c) for c in choices]))
                return _MISSING
        if origin in (tuple, list, dict) and _is_null(node):
            return origin()  # `backends:` with nothing under it is an empty list, not an error
        if origin in (tuple, list):
            if not isinstance(node, SequenceNode):
                self.error(path, node, "must be a list")
                return _MISSING
            if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
                raise TypeError(f"config field {path}: only tuple[X, ...] is supported ({tp})")
            item_tp = args[0] if args else Any
            items = [self.parse(item_tp, child, f"{path}[{i}]") for i, child in enumerate(node.value)]
            if any(item is _MISSING for item in items):
                return _MISSING
            return tuple(items) if origin is tuple else items
        if origin is dict:
            if not isinstance(node, MappingNode):
                self.error(path, node, "must be a mapping")
                return _MISSING
            key_tp, value_tp = args if args else (str, Any)
            out: dict[Any, Any] = {}
            ok = True
            for key_node, value_node in node.value:
                key = self.parse(key_tp, key_node, path)
                sub = f"{path}.{key}" if path else str(key)
                value = self.parse(value_tp, value_node, sub)
                if key is _MISSING or value is _MISSING:
                    ok = False
                    continue
                out[key] = value
            return out if ok else _MISSING
        if tp in (str, int, float, bool):
            return self.parse_plain(tp, node, path)
        raise TypeError(f"config field {path}: unsupported type {tp!r}")

    def scalar(self, node: Node, path: str) -> Any:
        if not isinstance(node, ScalarNode):
            self.error(path, node, "must be a single value")
            return _MISSING
        return self.construct(node, path)

    def construct(self, node: Node, path: str) -> Any:
        try:
            return _constructor.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, TypeError, OverflowError) as exc:
            # An unknown tag (`!808`), or a tagged value YAML cannot build (`!!int 0x`, `!!binary %`): the
            # field's error like any other, not a traceback out of check-config or a reload.
            self.error(path, node, f"cannot read this value: {getattr(exc, 'problem', None) or exc}")
            return _MISSING

    def parse_plain(self, tp: type, node: Node, path: str) -> Any:
        value = self.scalar(node, path)
        if value is _MISSING:
            return _MISSING
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if type(value) is not tp:
            names = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
            self.error(path, node, f"must be {names[tp]}, got {_describe(value)}")
            return _MISSING
        return value

    def parse_dataclass(self, cls: type, node: Node, path: str) -> Any:
        if _is_null(node):
            node = MappingNode("tag:yaml.org,2002:map", [], node.start_mark, node.end_mark)
        if not isinstance(node, MappingNode):
            self.error(path, node, "must be a mapping")
            return _MISSING
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        kwargs: dict[str, Any] = {}
        nodes: dict[str, Node] = {}
        failed: set[str] = set()  # fields whose own value was wrong (already reported)
        for key_node, value_node in node.value:
            key = self.construct(key_node, path)
            if key is _MISSING:
                continue
            sub = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str) or key not in fields:
                self.error(sub, key_node, "unknown key" + _suggest(str(key), list(fields)))
                continue
            if key in nodes:
                self.error(sub, key_node, "duplicate key")
                continue
            nodes[key] = value_node
            value = self.parse(hints[key], value_node, sub)
            if value is _MISSING or not self.check_bounds(fields[key], value, value_node, sub):
                failed.add(key)
                continue
            kwargs[key] = value
        required = {n for n, f in fields.items()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        for name in required - nodes.keys():
            self.error(f"{path}.{name}" if path else name, node, "is required")
        if required & (failed | (required - nodes.keys())):
            return _MISSING  # nothing to build the rest of the checks on
        # Build the object even when some fields were wrong, with their defaults standing in, so that
        # its own checks (__post_init__, validate) and the enclosing sections' checks still run: the user
        # sees every error in one pass, not one layer per run. Messages about the failed fields
        # themselves are dropped, since they would describe the stand-in default, not what was written.
        try:
            obj = cls(**kwargs)
        except ConfigValueError as exc:
            # The section's own check (proxy/core/bounds.py, run by __post_init__): every error it found,
            # each at its field's line.
            self.report(exc.errors, failed, nodes, node, path)
            return _MISSING
        except (TypeError, ValueError) as exc:
            # A hand-written __post_init__ check that names its field first ("epsilon must be > 0") is
            # reported at that field's line, the same as a metadata bound.
            message = str(exc)
            name = message.split(" ", 1)[0].rstrip(":")
            if name in failed:
                return _MISSING
            if name in nodes:
                self.error(f"{path}.{name}" if path else name, nodes[name], message[len(name):].lstrip(": "))
            else:
                self.error(path, node, message)
            return _MISSING
        # Sections that do not check themselves in __post_init__ get the same checks here (for those that
        # do, this finds nothing: they would not have been built).
        self.report(config_errors(obj), failed, nodes, node, path)
        # Every error is already recorded and parse_section refuses the whole file when there is one, so
        # handing a partly-defaulted object upward can only surface more errors, never accept a bad file.
        return obj

    def report(self, errors: Iterable[tuple[str, str]], failed: set[str], nodes: dict[str, Node], node: Node,
               path: str) -> None:
        """Record (field or dotted path below it, message) pairs at the line of what they name; an error
        about a field whose own value was already rejected is left out (it describes the stand-in)."""
        for name, message in errors:
            head = name.split(".", 1)[0].split("[", 1)[0]
            if head in failed:
                continue
            sub = f"{path}.{name}" if name and path else (name or path)
            self.error(sub, _node_at(nodes, name) or node, message)

    def check_bounds(self, f: dataclasses.Field[Any], value: Any, node: Node, path: str) -> bool:
        errors = value_errors(value, f.metadata)
        for message in errors:
            self.error(path, node, message)
        return not errors


def _node_at(nodes: dict[str, Node], name: str) -> Node | None:
    """The YAML node a (possibly dotted, indexed) field path names, e.g. ``backends[2].url``, or None."""
    if not name:
        return None
    parts = name.replace("[", ".[").split(".")
    found: Node | None = nodes.get(parts[0])
    for part in parts[1:]:
        if found is None:
            return None
        if part.startswith("["):
            index = int(part[1:-1])
            found = found.value[index] if isinstance(found, SequenceNode) and index < len(found.value) else None
        elif isinstance(found, MappingNode):
            found = next((v for k, v in found.value if isinstance(k, ScalarNode) and k.value == part), None)
        else:
            return None
    return found


def _is_null(node: Node) -> bool:
    return isinstance(node, ScalarNode) and node.tag == "tag:yaml.org,2002:null"


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    return f"{type(value).__name__} {value!r}"


def _suggest(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_section(cls: type, text: str, source: str = "<config>") -> Any:
    """Parse YAML text into any config dataclass `cls` (used for `Config` and handy in tests)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError([f"<yaml>{line}: {getattr(exc, 'problem', None) or exc}"], source) from None
    if node is None and cls is Config:
        # An empty file (or one of only comments) is not "all defaults": it is what a reload reads from a
        # file caught between truncate and rewrite, and serving it would empty the fleet.
        raise ConfigError(["<top>: the file is empty (a configuration needs at least `backends`)"], source)
    if node is None:
        # PyYAML's stubs type the buffer as str; None is what yaml itself passes for a node without one.
        mark = yaml.Mark(source, 0, 0, 0, None, None)  # type: ignore[arg-type]  # see the line above
        node = MappingNode("tag:yaml.org,2002:map", [], mark, None)
    parser = _Parser()
    try:
        result = parser.parse(cls, node, "")
    finally:
        # The shared SafeConstructor memoises every node it builds (`constructed_objects`, keyed by node) and
        # never forgets them: without this each parse (every reload, every check-config) kept its whole
        # YAML tree alive (found by loadtest/fuzz config: RSS grew ~7 KiB per parse).
        _constructor.constructed_objects.clear()
        _constructor.recursive_objects.clear()
    if parser.errors or result is _MISSING:
        raise ConfigError(parser.errors or ["invalid configuration"], source)
    return result


def parse_config(text: str, source: str = "<config>") -> Config:
    return parse_section(Config, text, source)


def load_config(path: str) -> Config:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError([f"cannot read: {exc.strerror or exc}"], path) from None
    return parse_config(text, path)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list, frozenset, set)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def dump_config(config: Any) -> str:
    """The effective configuration (defaults filled in) as YAML that parses back to the same value."""
    return yaml.safe_dump(_plain(config), sort_keys=False, default_flow_style=False)
