"""YAML configuration -> frozen dataclasses, with errors that name their YAML path and line.

The parser is driven by the dataclasses' type hints, not by a schema kept beside them, so a section is
added by writing one frozen dataclass WITH DEFAULTS (in the owner's own module) and adding one field of that
type to `Config`. Supported field types: str, int, float, bool, enums (by value), `Literal[...]`,
`X | None`, `tuple[X, ...]`, `list[X]`, `dict[str, X]`, nested dataclasses and `Any` (raw YAML value).

Constraints live next to the field, in its metadata, so the error can point at the offending line:
``field(default=0.25, metadata={"ge": 0})`` (keys: ge, gt, le, lt, min_len, doc). Cross-field rules go in a
``validate(self) -> Iterable[tuple[str, str]]`` method on the dataclass, yielding (field name or "",
message); they run after the section parsed cleanly and are reported at that field's line.

Every problem in a file is collected and reported together (`ConfigError.errors`), because fixing a config
one error per run is miserable.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Union

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from proxy.control.telemetry_config import TelemetryConfig
from proxy.core.health import DiscoveryConfig, HealthCheckConfig, OutlierConfig, OverloadConfig, RetryConfig
from proxy.core.hotspots import HotspotConfig
from proxy.core.routing_config import RoutingConfig
from proxy.core.snapshot import BackendSpec
from proxy.grpc.grpc_config import GrpcOptions
from proxy.observability.config import LoggingConfig, TracingConfig

__all__ = [
    "AdminConfig",
    "BackendConfig",
    "Config",
    "ConfigError",
    "LimitsConfig",
    "ListenConfig",
    "TimeoutsConfig",
    "UpstreamConfig",
    "dump_config",
    "load_config",
    "parse_config",
    "parse_section",
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


@dataclass(frozen=True)
class AdminConfig:
    host: str = "127.0.0.1"
    port: int = field(default=9090, metadata={"ge": 0, "le": 65535})
    # Bearer token for admin write endpoints; `token_env` names an environment variable holding it so the
    # secret need not live in the file.
    token: str | None = None
    token_env: str | None = None

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
    weight: float = field(default=1.0, metadata={"ge": 0})
    grpc: str | None = None  # host:port of the backend's gRPC server
    metrics_url: str | None = None
    models: tuple[str, ...] = ()
    max_inflight: int | None = field(default=None, metadata={"ge": 1})

    def validate(self) -> Iterable[tuple[str, str]]:
        if not self.url.startswith("http://"):
            # The relay pool (proxy/upstream/http1.py) speaks plain HTTP/1.1, as GPU servers do inside a cluster;
            # TLS to a backend belongs in a sidecar or the service mesh.
            yield "url", f"must start with http:// (TLS to backends is not supported), got {self.url!r}"
        if self.grpc is not None and ":" not in self.grpc:
            yield "grpc", f"must be host:port, got {self.grpc!r}"

    def to_spec(self) -> BackendSpec:
        return BackendSpec(
            name=self.name,
            url=self.url.rstrip("/"),
            weight=self.weight,
            grpc_address=self.grpc,
            metrics_url=self.metrics_url,
            models=self.models,
            max_inflight=self.max_inflight,
        )


@dataclass(frozen=True)
class LimitsConfig:
    max_body_bytes: int = field(default=10 * 1024 * 1024, metadata={"ge": 1})
    max_header_bytes: int = field(default=16384, metadata={"ge": 256})
    max_inflight_total: int | None = field(default=None, metadata={"ge": 1})


@dataclass(frozen=True)
class TimeoutsConfig:
    connect_s: float = field(default=5.0, metadata={"gt": 0})
    request_s: float = field(default=600.0, metadata={"gt": 0})  # whole upstream exchange, streams included
    drain_s: float = field(default=30.0, metadata={"ge": 0})  # graceful-shutdown deadline


@dataclass(frozen=True)
class UpstreamConfig:
    connections_per_backend: int = field(default=256, metadata={"ge": 1})
    # Idle upstream connections are reused for at most this long and then closed (the idle TTL: no ghost
    # connections to a backend that went quiet or left). It must stay below the backends' own keep-alive
    # (uvicorn, behind vLLM/SGLang, closes after 5 s): reusing a connection the server is closing fails a
    # POST with ServerDisconnectedError. Hence 4 s by default.
    keepalive_s: float = field(default=4.0, metadata={"gt": 0})


@dataclass(frozen=True)
class Config:
    """The whole configuration. Sections owned by other modules are added here as one field each."""

    listen: ListenConfig = ListenConfig()
    grpc_listen: ListenConfig | None = None
    grpc: GrpcOptions = GrpcOptions()  # gRPC listener behaviour: extractors per method, windows (proxy/grpc)
    admin: AdminConfig = AdminConfig()
    debug_headers: bool = False
    backends: tuple[BackendConfig, ...] = ()
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
    logging: LoggingConfig = LoggingConfig()  # log format and the access log (proxy/observability)
    hotspots: HotspotConfig = HotspotConfig()  # heat-map windows and hot-spot rules (proxy/core/hotspots.py)
    tracing: TracingConfig = TracingConfig()  # OpenTelemetry spans over OTLP/HTTP (proxy/observability/tracing.py)

    def validate(self) -> Iterable[tuple[str, str]]:
        seen: set[str] = set()
        for b in self.backends:
            if b.name in seen:
                yield "backends", f"duplicate backend name {b.name!r}"
            seen.add(b.name)

    def backend_specs(self) -> tuple[BackendSpec, ...]:
        return tuple(b.to_spec() for b in self.backends)


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
            return _constructor.construct_object(node, deep=True)
        if origin in (Union, types.UnionType):
            non_none = [a for a in args if a is not type(None)]
            if _is_null(node) and len(non_none) < len(args):
                return None
            if len(non_none) == 1:
                return self.parse(non_none[0], node, path)
            raise TypeError(f"config field {path}: unions other than Optional are not supported ({tp})")
        if dataclasses.is_dataclass(tp):
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
        return _constructor.construct_object(node, deep=True)

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
            key = _constructor.construct_object(key_node, deep=True)
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
        except (TypeError, ValueError) as exc:
            # A __post_init__ check that names its field first ("epsilon must be > 0") is reported at that
            # field's line, the same as a metadata bound.
            message = str(exc)
            name = message.split(" ", 1)[0].rstrip(":")
            if name in failed:
                return _MISSING
            if name in nodes:
                self.error(f"{path}.{name}" if path else name, nodes[name], message[len(name):].lstrip(": "))
            else:
                self.error(path, node, message)
            return _MISSING
        validate = getattr(obj, "validate", None)
        if callable(validate):
            for name, message in validate() or ():
                if name in failed:
                    continue
                sub = f"{path}.{name}" if name and path else (name or path)
                self.error(sub, nodes.get(name, node), message)
        # Every error is already recorded and parse_section refuses the whole file when there is one, so
        # handing a partly-defaulted object upward can only surface more errors, never accept a bad file.
        return obj

    def check_bounds(self, f: dataclasses.Field[Any], value: Any, node: Node, path: str) -> bool:
        meta = f.metadata
        if not meta or value is None:
            return True
        checks = (
            ("ge", lambda v, b: v >= b, ">="),
            ("gt", lambda v, b: v > b, ">"),
            ("le", lambda v, b: v <= b, "<="),
            ("lt", lambda v, b: v < b, "<"),
        )
        for key, ok, sign in checks:
            if key in meta and isinstance(value, (int, float)) and not ok(value, meta[key]):
                self.error(path, node, f"must be {sign} {meta[key]}, got {value}")
                return False
        if "min_len" in meta and hasattr(value, "__len__") and len(value) < meta["min_len"]:
            self.error(path, node, "must not be empty" if meta["min_len"] == 1 else
                       f"must have at least {meta['min_len']} items")
            return False
        return True


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
    if node is None:
        node = MappingNode("tag:yaml.org,2002:map", [], yaml.Mark(source, 0, 0, 0, None, None), None)
    parser = _Parser()
    result = parser.parse(cls, node, "")
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
    return parse_section(Config, text, path)


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
