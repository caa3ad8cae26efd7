"""Compile the hot path (`proxy.native.loader.MODULES`) with mypyc into `proxy/native/compiled/`.

mypyc is mypy's compiler: it turns type-annotated Python into a C extension (mypy and black ship compiled
with it). The modules stay ordinary Python that runs as it is; compiled, their per-request work costs about
half (loadtest/results/peers.md, "Round 8"). The build needs mypy (with mypyc), setuptools and a C compiler
with the interpreter's headers; the proxy itself needs none of them (`loader` falls back to the source).

The whole package is type-checked (mypyc needs the types of everything a compiled module calls, and
`loader` compares every source's hash with the one recorded here); only `MODULES` are compiled, into one
shared library for the group plus one thin extension per module. The previous build is replaced only once
the new one is complete, so a failed build leaves the last good one (or none) in place.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Sequence

from proxy.native.loader import (
    GROUP, MANIFEST, MANIFEST_VERSION, MODULES, NATIVE_DIR, PACKAGE_DIR, ext_suffix, module_name,
    package_sources, sha256_of,
)


def build(modules: Sequence[str] = MODULES, native_dir: str = NATIVE_DIR, package_dir: str = PACKAGE_DIR,
          jobs: int | None = None, verbose: bool = False) -> dict[str, Any]:
    """Compile `modules` (paths under proxy/) into `native_dir`; return the manifest written there."""
    from mypyc.build import mypycify  # mypy's compiler (`pip install mypy`; the [test] extra has it)
    from setuptools import Distribution  # type: ignore[import-untyped]  # no stubs; two calls
    from setuptools.command.build_ext import build_ext  # type: ignore[import-untyped]  # no stubs, as above

    import mypy.version

    root = os.path.dirname(package_dir)
    package = os.path.basename(package_dir)
    for rel in modules:
        if not os.path.exists(os.path.join(package_dir, rel)):
            raise FileNotFoundError(f"{package}/{rel}: no such module to compile")
    # Hashed before the compiler reads them: a file edited during the build makes the build stale, not wrong.
    sources = {rel: sha256_of(os.path.join(package_dir, rel)) for rel in package_sources(package_dir)}
    cwd = os.getcwd()
    log = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="affinity-native-") as tmp:
        os.chdir(root)
        try:
            quiet = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(log)
            with quiet:
                # The project's own mypy settings (pyproject.toml); its sections for modules this build does
                # not type-check (the simulator, optional libraries) are not an error here.
                exts = mypycify(
                    ["--no-warn-unused-configs", package],
                    only_compile_paths=[os.path.join(package, rel) for rel in modules],
                    opt_level="3", target_dir=os.path.join(tmp, "c"), group_name=GROUP,
                )
                cmd = build_ext(Distribution({"name": GROUP, "ext_modules": exts}))
                cmd.build_lib = os.path.join(tmp, "lib")
                cmd.build_temp = os.path.join(tmp, "obj")
                cmd.parallel = jobs or os.cpu_count() or 1
                cmd.ensure_finalized()
                cmd.run()
        except SystemExit as exc:  # mypycify exits on a type error after printing it
            raise RuntimeError(f"mypyc refused the sources (exit {exc.code}):\n{log.getvalue()[-4000:]}") from None
        finally:
            os.chdir(cwd)
        lib = os.path.join(tmp, "lib")
        suffix = ext_suffix()
        staged = os.path.join(tmp, "compiled")
        os.makedirs(staged)
        entries: dict[str, dict[str, str]] = {}
        support: dict[str, str] = {}
        wanted = {module_name(rel): rel for rel in modules}
        for dirpath, _, files in os.walk(lib):
            for name in files:
                if not name.endswith(suffix):
                    continue
                dotted = os.path.relpath(os.path.join(dirpath, name), lib)[: -len(suffix)].replace(os.sep, ".")
                flat = dotted + suffix  # one flat folder: proxy.http.server.cpython-311-x86_64-linux-gnu.so
                shutil.copy2(os.path.join(dirpath, name), os.path.join(staged, flat))
                if dotted in wanted:
                    entries[dotted] = {"source": wanted[dotted], "file": flat}
                else:
                    support[dotted] = flat  # the group's shared library
        missing = sorted(set(wanted) - set(entries))
        if missing:
            raise RuntimeError(f"mypyc built no extension for {', '.join(missing)}")
        manifest = {
            "version": MANIFEST_VERSION,
            "python": sys.implementation.cache_tag,
            "ext_suffix": suffix,
            "mypy": mypy.version.__version__,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "modules": entries,
            "support": support,
            "sources": sources,
        }
        with open(os.path.join(staged, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
        old = native_dir + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(native_dir):
            os.replace(native_dir, old)
        shutil.copytree(staged, native_dir)
        shutil.rmtree(old, ignore_errors=True)
    return manifest


def clean(native_dir: str = NATIVE_DIR) -> bool:
    """Remove the build; False when there was none."""
    if not os.path.exists(native_dir):
        return False
    shutil.rmtree(native_dir)
    return True
