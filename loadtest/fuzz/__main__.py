"""`python -m loadtest.fuzz TARGET --runs N`: run one target under atheris (see loadtest/fuzz/__init__.py)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

# atheris measures coverage by instrumenting Python bytecode: the proxy's compiled hot path
# (proxy/native) has none, so the fuzzers always run the Python source of those modules.
os.environ["AFFINITY_PROXY_NATIVE"] = "0"


def main(argv: list[str] | None = None) -> int:
    import atheris

    p = argparse.ArgumentParser(prog="python -m loadtest.fuzz")
    p.add_argument("target", nargs="?")
    p.add_argument("--runs", type=int, default=1_000_000, help="inputs to run (libFuzzer -runs)")
    p.add_argument("--seconds", type=int, default=0, help="stop after this long instead (-max_total_time)")
    p.add_argument("--corpus", help="corpus folder (kept and grown); default: a fresh one with the seeds")
    p.add_argument("--list", action="store_true")
    args, extra = p.parse_known_args(argv)  # anything else (-max_len=..., -jobs=...) goes to libFuzzer
    from loadtest.fuzz.targets import TARGETS

    if args.list or not args.target:
        for name, target in TARGETS.items():
            print(f"{name:10} {target.doc}")
        return 0
    if args.target not in TARGETS:
        print(f"unknown target {args.target!r}; known: {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    target = TARGETS[args.target]()
    with atheris.instrument_imports(include=["proxy"]):
        target.setup()  # imports the proxy modules it drives: they are coverage-instrumented
    corpus = Path(args.corpus) if args.corpus else Path(tempfile.mkdtemp(prefix=f"fuzz-{args.target}-"))
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(target.seeds()):
        (corpus / f"seed-{i}").write_bytes(seed)
    flags = [f"-runs={args.runs}", "-print_final_stats=1", f"-artifact_prefix={corpus}/crash-",
             "-max_len=65536", "-rss_limit_mb=4096"]
    if args.seconds:
        flags.append(f"-max_total_time={args.seconds}")
    sys.argv = [sys.argv[0], *flags, *extra, str(corpus)]  # libFuzzer reads its flags from here
    atheris.Setup(sys.argv, target.one)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
