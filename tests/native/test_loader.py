"""The compiled hot path is used only where it matches the source (proxy/native/loader.py).

The decision (`check`) is tested on a small package of its own: a manifest, sources and stand-in extension
files in tmp_path. What this process runs is tested against the real build, when there is one; in CI
(`CI=true`, after .ci/run's `python -m proxy.native build`) there must be one, so that the suite exercises
the compiled modules the image ships.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import proxy.http.server
from proxy.native.loader import (
    ENV, MANIFEST, MANIFEST_VERSION, MODULES, NativeStatus, check, ext_suffix, module_name, package_sources,
    sha256_of, status,
)

REPO = Path(__file__).resolve().parents[2]


def fake_build(tmp_path: Path) -> tuple[Path, Path]:
    """A package (pkg/) with two modules, and a build of it (native/) as build.py writes one."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "fast.py").write_text("X = 1\n")
    (pkg / "sub" / "other.py").write_text("Y = 2\n")
    native = tmp_path / "native"
    native.mkdir()
    suffix = ext_suffix()
    for name in ("pkg.fast", "group__mypyc"):
        (native / (name + suffix)).write_bytes(b"not really an extension")
    manifest = {
        "version": MANIFEST_VERSION, "python": sys.implementation.cache_tag, "ext_suffix": suffix, "mypy": "x",
        "built_at": "2026-12-06T00:00:00Z",
        "modules": {"pkg.fast": {"source": "fast.py", "file": "pkg.fast" + suffix}},
        "support": {"group__mypyc": "group__mypyc" + suffix},
        "sources": {rel: sha256_of(str(pkg / rel)) for rel in package_sources(str(pkg))},
    }
    (native / MANIFEST).write_text(json.dumps(manifest))
    return pkg, native


def test_a_matching_build_is_served_module_by_module(tmp_path: Path) -> None:
    pkg, native = fake_build(tmp_path)
    found, files = check(str(native), str(pkg), env={})
    assert found.active and found.label() == "on" and found.modules == ("pkg.fast",)
    assert files == {"pkg.fast": str(native / ("pkg.fast" + ext_suffix())),
                     "group__mypyc": str(native / ("group__mypyc" + ext_suffix()))}


@pytest.mark.parametrize("change", ["compiled", "interpreted", "added", "removed"])
def test_any_source_changed_since_the_build_means_none_is_served(tmp_path: Path, change: str) -> None:
    pkg, native = fake_build(tmp_path)
    if change == "compiled":
        (pkg / "fast.py").write_text("X = 2\n")
    elif change == "interpreted":  # compiled code relies on the types of what it calls: stale too
        (pkg / "sub" / "other.py").write_text("Y = 'two'\n")
    elif change == "added":
        (pkg / "sub" / "new.py").write_text("")
    else:
        (pkg / "sub" / "other.py").unlink()
    found, files = check(str(native), str(pkg), env={})
    assert not found.active and found.label() == "stale" and files == {}
    assert len(found.stale) == 1 and "python -m proxy.native build" in found.reason


def test_the_environment_can_turn_it_off(tmp_path: Path) -> None:
    pkg, native = fake_build(tmp_path)
    found, files = check(str(native), str(pkg), env={ENV: "0"})
    assert not found.active and found.label() == "off" and files == {}


def test_another_interpreters_build_or_a_missing_file_is_not_served(tmp_path: Path) -> None:
    pkg, native = fake_build(tmp_path)
    manifest = json.loads((native / MANIFEST).read_text())
    manifest["ext_suffix"] = ".cpython-399-x86_64-linux-gnu.so"
    (native / MANIFEST).write_text(json.dumps(manifest))
    found, files = check(str(native), str(pkg), env={})
    assert not found.active and files == {} and "rebuild" in found.reason

    pkg, native = fake_build(tmp_path / "again")
    (native / ("group__mypyc" + ext_suffix())).unlink()
    found, files = check(str(native), str(pkg), env={})
    assert not found.active and files == {} and "missing" in found.reason


def test_no_build_or_an_unreadable_manifest_is_no_build(tmp_path: Path) -> None:
    found, files = check(str(tmp_path / "nothing"), str(tmp_path), env={})
    assert found == NativeStatus() and found.label() == "none" and files == {}
    (tmp_path / MANIFEST).write_text("{not json")
    found, files = check(str(tmp_path), str(tmp_path), env={})
    assert not found.active and files == {}


def test_this_process_runs_what_the_status_says() -> None:
    found = status()
    compiled = proxy.http.server.__file__.endswith(ext_suffix())
    assert compiled == found.active, found
    if os.environ.get("CI") == "true":
        # .ci/run builds before the tests: CI must test the modules that ship compiled.
        assert found.active, f"CI runs without the compiled hot path: {found.reason}"
        assert set(found.modules) == {module_name(rel) for rel in MODULES}


def test_a_process_told_not_to_uses_the_python_source() -> None:
    code = "import proxy.http.server as s, proxy.native.loader as n; print(s.__file__); print(n.status().label())"
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **{ENV: "0"}), cwd=REPO,
                       capture_output=True, text=True, check=True, timeout=60)
    file, label = r.stdout.split()
    assert file.endswith(os.path.join("proxy", "http", "server.py"))
    assert label in ("off", "none", "stale")
