"""The request target -> (forwarded path, routed path) step of the HTTP/1.1 server, and its memo."""

from __future__ import annotations

from proxy.http import server


def test_paths_forwarded_and_routed_the_same_from_the_memo() -> None:
    cases = {
        b"/v1/chat/completions": ("/v1/chat/completions", "/v1/chat/completions"),
        b"/v1/completions?stream=1": ("/v1/completions?stream=1", "/v1/completions"),
        b"/v1/chat%2Fcompletions?a=%20": ("/v1/chat%2Fcompletions?a=%20", "/v1/chat/completions"),
        b"http://example.com:8080/v1/models?x": ("/v1/models?x", "/v1/models"),
        b"http://example.com": ("/", "/"),
        "/v1/caf\u00e9".encode(): ("/v1/caf\u00e9", "/v1/caf\u00e9"),
        b"/v1/\xff": ("/v1/\udcff", "/v1/\udcff"),  # not UTF-8: surrogate-escaped, as forwarded before
    }
    for target, want in cases.items():
        server._TARGETS.pop(target, None)
        assert server._paths(target) == want  # computed
        assert server._TARGETS[target] == want  # remembered
        assert server._paths(target) == want


def test_long_targets_are_not_remembered() -> None:
    target = b"/v1/completions?" + b"q" * server._TARGET_MEMO_BYTES
    assert server._paths(target) == (target.decode(), "/v1/completions")
    assert target not in server._TARGETS
