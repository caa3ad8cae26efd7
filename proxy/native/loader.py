"""Load the compiled hot path only where it matches the source (`install`, called by `proxy/__init__.py`).

`python -m proxy.native build` (proxy/native/build.py) compiles the modules in `MODULES` with mypyc into
`proxy/native/compiled/`, next to a manifest that records the SHA-256 of every source it compiled.
`install` puts a finder in front of the import system that serves those compiled modules only when

- the manifest was built for this interpreter (the same extension suffix), and
- every source of the package is byte for byte the one the build type-checked: a module edited after the
  build (compiled or not: compiled code relies on the types of what it calls), a file added or removed, or a
  checkout moved to another commit, falls back to the Python source for *all* of them (compiled modules
  call each other directly, so one stale module cannot be swapped back alone), and
- `AFFINITY_PROXY_NATIVE` is not `0`.

Otherwise every module is imported from its `.py` file, exactly as without a build: the build is an
optimisation, never a requirement (no compiler, no build: the same proxy, slower). Nothing here imports
anything heavy: it runs on every `import proxy`.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Mapping, Sequence

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # proxy/
NATIVE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compiled")
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
ENV = "AFFINITY_PROXY_NATIVE"
# The shared library mypyc builds for the whole group (the per-module extensions are thin shims into it).
GROUP = "affinity_proxy_native"

# What is compiled, as paths under proxy/. Everything a proxied request runs through on HTTP/1.1, HTTP/2 and
# gRPC, and nothing that introspects classes at run time (the config loader reads dataclass fields and
# defaults off the classes: those modules stay interpreted).
MODULES: tuple[str, ...] = (
    "http/server.py",
    "wire/http1.py",
    "wire/http1_llhttp.py",
    "dataplane/openai.py",
    "dataplane/router.py",
    "dataplane/retry.py",
    "dataplane/admission.py",
    "dataplane/request_ids.py",
    "upstream/http1.py",
    "upstream/headers.py",
    "observability/lifecycle.py",
    "observability/access_log.py",
    "observability/observer.py",
    "metrics.py",
    "core/request.py",
    "core/policies.py",
    "core/affinity.py",
    "core/fingerprint.py",
    "core/prefix_index.py",
    "core/work_ledger.py",
    "core/host_rings.py",
    "core/placement.py",
    "core/load.py",
    "core/retry_policy.py",
    "core/health.py",
    "grpc/bridge.py",
    "grpc/call.py",
    "grpc/connection.py",
    "grpc/downstream.py",
    "grpc/streams.py",
    "grpc/upstream.py",
    "grpc/context.py",
    "wire/grpc.py",
)


def module_name(rel: str) -> str:
    return "proxy." + rel[: -len(".py")].replace("/", ".")


def sha256_of(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def package_sources(package_dir: str = PACKAGE_DIR) -> list[str]:
    """Every .py file of the package, as sorted paths relative to it (what a build's types depend on)."""
    out: list[str] = []
    for dirpath, dirnames, files in os.walk(package_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and d != "compiled")
        rel_dir = os.path.relpath(dirpath, package_dir)
        out.extend(os.path.normpath(os.path.join(rel_dir, f)).replace(os.sep, "/") for f in files if f.endswith(".py"))
    return sorted(out)


def ext_suffix() -> str:
    """The file suffix of this interpreter's extension modules (.cpython-311-x86_64-linux-gnu.so)."""
    return importlib.machinery.EXTENSION_SUFFIXES[0]


@dataclass
class NativeStatus:
    """What `install` found: whether compiled modules are in use, and if not, why."""

    active: bool = False
    reason: str = "no build (python -m proxy.native build)"
    modules: tuple[str, ...] = ()
    stale: tuple[str, ...] = ()
    built_with: dict[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        """One word for logs and the build-info metric: on, off, stale or none."""
        if self.active:
            return "on"
        if self.stale:
            return "stale"
        return "off" if self.reason.startswith(ENV) else "none"


_STATUS = NativeStatus()


def status() -> NativeStatus:
    """What the last `install` decided (the proxy logs it at start)."""
    return _STATUS


class _NativeFinder(importlib.abc.MetaPathFinder):
    """Serves the compiled extension of each module the manifest lists; nothing else."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, file)
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


def _read_manifest(native_dir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(native_dir, MANIFEST), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check(native_dir: str = NATIVE_DIR, package_dir: str = PACKAGE_DIR,
          env: Mapping[str, str] | None = None) -> tuple[NativeStatus, dict[str, str]]:
    """Decide, without importing anything: the status, and the module -> extension file map to serve."""
    env = os.environ if env is None else env
    manifest = _read_manifest(native_dir)
    if manifest is None:
        return NativeStatus(), {}
    built = {k: manifest.get(k) for k in ("python", "ext_suffix", "mypy", "built_at")}
    modules = manifest.get("modules")
    if manifest.get("version") != MANIFEST_VERSION or not isinstance(modules, dict) or not modules:
        return NativeStatus(reason="unreadable manifest: rebuild (python -m proxy.native build)",
                            built_with=built), {}
    names = tuple(sorted(modules))
    if env.get(ENV, "").strip() == "0":
        return NativeStatus(reason=f"{ENV}=0: the Python source is used", modules=names, built_with=built), {}
    if manifest.get("ext_suffix") != ext_suffix():
        return NativeStatus(reason=f"built for {manifest.get('python')} ({manifest.get('ext_suffix')}), "
                                   f"this is {sys.implementation.cache_tag} ({ext_suffix()}): rebuild",
                            modules=names, built_with=built), {}
    sources = manifest.get("sources")
    if not isinstance(sources, dict):
        return NativeStatus(reason="unreadable manifest: rebuild (python -m proxy.native build)",
                            built_with=built), {}
    stale: list[str] = []
    for rel in sorted(set(sources) | set(package_sources(package_dir))):
        digest = sources.get(rel)
        try:
            fresh = digest is not None and sha256_of(os.path.join(package_dir, rel)) == digest
        except OSError:
            fresh = False
        if not fresh:
            stale.append(rel)
    if stale:
        return NativeStatus(reason=f"{len(stale)} source file(s) changed since the build (proxy/{stale[0]}"
                                   f"{', ...' if len(stale) > 1 else ''}): the Python source is used for every "
                                   "module (python -m proxy.native build)",
                            modules=names, stale=tuple(stale), built_with=built), {}
    files = {name: os.path.join(native_dir, entry["file"]) for name, entry in modules.items()}
    for name, file in manifest.get("support", {}).items():
        files[name] = os.path.join(native_dir, file)
    missing = [f for f in files.values() if not os.path.exists(f)]
    if missing:
        return NativeStatus(reason=f"missing {os.path.basename(missing[0])}: rebuild", modules=names,
                            built_with=built), {}
    return NativeStatus(active=True, reason="compiled modules in use", modules=names, built_with=built), files


def install() -> NativeStatus:
    """Put the finder in front of the import system when the build matches (once; idempotent)."""
    global _STATUS
    if any(isinstance(f, _NativeFinder) for f in sys.meta_path):
        return _STATUS
    found, files = check()
    loaded = [name for name in found.modules if name in sys.modules]
    if files and loaded:
        # Too late to swap: a compiled module must not run beside the interpreted one it replaces.
        found = NativeStatus(reason=f"{loaded[0]} was imported before proxy: the Python source is used",
                             modules=found.modules, built_with=found.built_with)
        files = {}
    _STATUS = found
    if files:
        sys.meta_path.insert(0, _NativeFinder(files))
    return _STATUS
