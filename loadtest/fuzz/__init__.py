"""Coverage-guided fuzzing of every door bytes come in through (atheris, libFuzzer for Python).

    python -m loadtest.fuzz TARGET --runs N [--seconds S] [--corpus DIR]
    python -m loadtest.fuzz --list

Targets (loadtest/fuzz/targets.py, one table): `http1` (raw bytes into the HTTP/1.1 listener over a
socket, a fake backend behind), `h2` (the HTTP/2 + gRPC frame path: proxy/grpc/downstream.py fed bytes
through a fake transport), `response` (the upstream response parser, proxy/wire/http1.py), `summary` (the
OpenAI body summariser, proxy/core/request.py), `config` (the YAML config loader), `metrics` (the metrics
page reader, proxy/control/scrape.py + adapters). Each states what counts as a crash: an exception other
than the documented rejection, or a broken invariant (round trips, split-feeding equivalence).
"""
