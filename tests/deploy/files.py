"""Reading what docker/ and deploy/ declare, so tests can check it against what the code really does."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
DEPLOY = REPO / "deploy"
DOCKERFILE = DOCKER / "Dockerfile"


@dataclass
class Dockerfile:
    """The instructions of a Dockerfile, continuation lines joined, comments dropped."""

    instructions: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def parse(cls, path: Path = DOCKERFILE) -> Dockerfile:
        out = cls()
        pending = ""
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not pending and (not line or line.startswith("#")):
                continue
            if line.startswith("#"):
                continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            line = pending + line
            pending = ""
            keyword, _, rest = line.partition(" ")
            out.instructions.append((keyword.upper(), rest.strip()))
        return out

    def all(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]

    def final_stage(self) -> list[tuple[str, str]]:
        last_from = max(i for i, (kw, _) in enumerate(self.instructions) if kw == "FROM")
        return self.instructions[last_from:]

    @staticmethod
    def exec_form(rest: str) -> list[str]:
        """JSON (exec) form, or the shell form split as /bin/sh would see words."""
        rest = rest.strip()
        if rest.startswith("["):
            return list(json.loads(rest))
        return shlex.split(rest)

    def command(self) -> list[str]:
        """ENTRYPOINT + CMD of the final image: the process the container runs."""
        stage = self.final_stage()
        entry = [self.exec_form(r) for kw, r in stage if kw == "ENTRYPOINT"]
        cmd = [self.exec_form(r) for kw, r in stage if kw == "CMD"]
        return (entry[-1] if entry else []) + (cmd[-1] if cmd else [])

    def healthcheck(self) -> list[str]:
        rest = [r for kw, r in self.final_stage() if kw == "HEALTHCHECK"][-1]
        _, _, cmd = rest.partition("CMD ")
        return self.exec_form(cmd)

    def copies(self) -> dict[str, str]:
        """Destination in the final image -> source in the build context (plain COPY, no --from)."""
        out: dict[str, str] = {}
        for kw, rest in self.final_stage():
            if kw == "COPY" and not rest.startswith("--from"):
                *sources, dest = rest.split()
                if len(sources) == 1:
                    out[dest] = sources[0]
        return out

    def user(self) -> str:
        return [r for kw, r in self.final_stage() if kw == "USER"][-1]


def image_config_path() -> tuple[str, Path]:
    """(path inside the image, file in the repository) of the proxy config the image runs with."""
    command = Dockerfile.parse().command()
    in_image = command[command.index("--config") + 1]
    return in_image, REPO / Dockerfile.parse().copies()[in_image]


def localised_image_config(fleet: Any, *, http_port: int = 0, admin_port: int = 0, grpc: bool = True) -> str:
    """The image's shipped config, changed only where running outside its container requires: listeners on
    127.0.0.1 (free or given ports instead of 0.0.0.0 on fixed ones), and the backends' compose host names
    replaced by the addresses of the simulators of the same names (`fleet.servers`). With `grpc` false the
    h2c listener and the backends' gRPC addresses are dropped (for a simulator fleet without gRPC)."""
    config = yaml.safe_load(image_config_path()[1].read_text())
    ports = {"listen": http_port, "grpc_listen": 0, "admin": admin_port}
    for key, port in ports.items():
        if config.get(key) is not None:
            config[key] = {**config[key], "host": "127.0.0.1", "port": port}
    if not grpc:
        config["grpc_listen"] = None
    servers = {s.name: s for s in fleet.servers}
    for backend in config["backends"]:
        server = servers[backend["name"]]  # the image's backends are named like the simulators
        backend["url"] = server.url
        backend["grpc"] = server.grpc_address if grpc and backend.get("grpc") else None
    return yaml.safe_dump(config, sort_keys=False)


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path, doc))
    return out


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in manifests() if doc.get("kind") == kind]


def configmap_configs() -> list[tuple[str, str]]:
    """(ConfigMap/key, YAML text) for every ConfigMap entry that is an affinity-proxy configuration."""
    out = []
    for cm in of_kind("ConfigMap"):
        for key, text in (cm.get("data") or {}).items():
            if key.endswith((".yaml", ".yml")) and isinstance(yaml.safe_load(text), dict):
                out.append((f"{cm['metadata']['name']}/{key}", text))
    return out


def proxy_config_files() -> list[Path]:
    """Every YAML file under docker/ that is an affinity-proxy configuration (has listen/backends)."""
    out = []
    for path in sorted(DOCKER.rglob("*.yaml")) + sorted(DOCKER.rglob("*.yml")):
        doc = yaml.safe_load(path.read_text())
        if isinstance(doc, dict) and ("backends" in doc or "listen" in doc):
            out.append(path)
    return out


_METRIC = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_PROMQL_WORDS = {
    "sum", "by", "rate", "increase", "histogram_quantile", "max", "min", "avg", "le", "without", "irate",
    "count", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (good enough for our dashboards: no functions beyond the usual)."""
    no_strings = re.sub(r'"[^"]*"', '""', expr)
    no_labels = re.sub(r"\{[^}]*\}", "", no_strings)
    no_ranges = re.sub(r"\[[^\]]*\]", "", no_labels)
    no_groupings = re.sub(r"\b(by|without)\s*\([^)]*\)", "", no_ranges)
    names = set()
    for m in _METRIC.finditer(no_groupings):
        word = m.group(0)
        following = no_groupings[m.end():].lstrip()[:1]
        if word in _PROMQL_WORDS or following == "(" or re.fullmatch(r"[0-9.]+", word):
            continue
        names.add(word)
    return names
