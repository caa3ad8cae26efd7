"""python -m proxy.native build | status | clean: the compiled hot path (see proxy/native/build.py, loader.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from proxy.native.loader import NATIVE_DIR, check


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m proxy.native",
        description="The proxy's hot path compiled with mypyc: build it, see whether it is in use, remove it.")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the hot path into proxy/native/compiled (mypy, a C compiler)")
    b.add_argument("--jobs", type=int, default=None, help="parallel C compiles (default: the CPU count)")
    b.add_argument("--verbose", action="store_true", help="show the compiler's output")
    b.add_argument("--if-possible", action="store_true",
                   help="a failed build is reported and exits 0: the proxy then runs its Python source")
    sub.add_parser("status", help="is the compiled hot path in use, and if not, why (JSON)")
    sub.add_parser("clean", help="remove the build")
    args = parser.parse_args(argv)
    if args.command == "build":
        from proxy.native.build import build

        print("proxy.native: compiling the hot path with mypyc (a minute or two) ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            manifest = build(jobs=args.jobs, verbose=args.verbose)
        except Exception as exc:  # noqa: BLE001  # reported; with --if-possible not fatal
            print(f"proxy.native: build failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            if args.if_possible:
                print("proxy.native: the proxy runs its Python source (the same behaviour, more CPU per request)",
                      file=sys.stderr)
                return 0
            return 1
        print(f"proxy.native: compiled {len(manifest['modules'])} modules into {NATIVE_DIR} "
              f"in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        return 0
    if args.command == "clean":
        from proxy.native.build import clean

        print("removed" if clean() else "nothing to remove")
        return 0
    found, _ = check()
    print(json.dumps({"native": found.label(), "active": found.active, "reason": found.reason,
                      "modules": list(found.modules), "stale": list(found.stale),
                      "built_with": found.built_with}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
