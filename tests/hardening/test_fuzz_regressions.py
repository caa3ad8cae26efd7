"""Every crash the fuzzers found (loadtest/fuzz, report in loadtest/results/fuzz.md), kept as a test."""

from __future__ import annotations

import pytest

from proxy.config import ConfigError, parse_config

ONE_BACKEND = "backends:\n  - {name: a, url: 'http://h:1'}\n"


@pytest.mark.parametrize("text, where", [
    # fuzz config #1: an unknown YAML tag on a value escaped as yaml.ConstructorError (a traceback out of
    # check-config, an unhandled exception in a reload).
    ("listen: {port: !808 }\n" + ONE_BACKEND, "listen.port"),
    # fuzz config #2: the same on a mapping key.
    ("listen: {!weight: 3}\n" + ONE_BACKEND, "listen"),
    # Found while fixing #1: tagged values YAML cannot build raise ValueError from inside PyYAML.
    ("listen: {port: !!int 0x}\n" + ONE_BACKEND, "listen.port"),
    ("listen: {host: !!timestamp 2020-99-99}\n" + ONE_BACKEND, "listen.host"),
])
def test_config_values_yaml_cannot_build_are_config_errors(text: str, where: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(text)
    assert where in str(err.value)


def test_parsing_a_config_keeps_nothing_of_its_yaml_tree() -> None:
    # fuzz config #3: RSS grew by ~7 KiB per parse: the shared SafeConstructor memoised every YAML node it
    # ever built, so every reload leaked its whole document.
    import gc
    import weakref

    from proxy import config as config_module

    text = "listen: {port: 8080}\nrouting: {policy: affinity}\n" + ONE_BACKEND
    parse_config(text)
    with pytest.raises(ConfigError):
        parse_config(text + "bogus: 1\n")
    assert not config_module._constructor.constructed_objects  # noqa: SLF001 - the memo that leaked
    node = config_module.yaml.compose(text, Loader=config_module.yaml.SafeLoader)
    ref = weakref.ref(node)
    del node
    parse_config(text)
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("kind", [["text"], {"t": "text"}, 3, None])
def test_a_content_part_whose_type_is_not_a_string_is_a_medium(kind: object) -> None:
    # fuzz summary #1 (a CI smoke, round 17): a part {"type": [...], "text": ...} raised TypeError
    # (unhashable type: 'list') out of summary_from_openai, where a number there was already folded into the
    # media like any part that is not text. Every endpoint with content parts goes through _parts_text.
    from proxy.core.request import summary_from_openai

    odd = {"type": kind, "text": "not the prompt"}
    for endpoint, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, odd]}]}),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}, odd]}]}),
    ):
        s = summary_from_openai(endpoint, body)
        assert "hi" in s.prompt and "not the prompt" not in s.prompt, (endpoint, s.prompt)
        assert len(s.media) == 1  # the odd part counts, as a medium


async def test_an_http09_request_line_is_refused_in_http11() -> None:
    # fuzz http1 #1: "GET /v1/models\r\n\r\n" (no version) was answered "HTTP/0.9 200 OK" plus headers.
    import asyncio

    from proxy.app import AffinityProxy

    proxy = AffinityProxy(parse_config("listen: {port: 0}\nadmin: {port: 0}\ntelemetry: {enabled: false}\n"
                                       "health_checks: {enabled: false}\n" + ONE_BACKEND))
    await proxy.start()
    try:
        port = int(proxy.http_url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /vH/v1/modlds\r\n\r\n")
        got = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    finally:
        await proxy.stop()
    # A request line without a version is malformed (RFC 9112 3: HTTP-version is required): our HTTP/1.1
    # server answers it as one, in HTTP/1.1 and the OpenAI error shape, never as HTTP/0.9.
    assert got.startswith(b"HTTP/1.1 400 "), got[:100]
    assert b"malformed request line" in got and b'"type": "invalid_request_error"' in got


async def _exchange(raw: bytes) -> tuple[bytes, list[object]]:
    """`raw` sent to a started proxy (a FakeBackend behind), read until the proxy closes: (answer, what reached
    the backend)."""
    import asyncio

    from proxy.app import AffinityProxy
    from tests.support import FakeBackend

    backend = FakeBackend()
    await backend.start()
    proxy = AffinityProxy(parse_config(
        "listen: {port: 0}\nadmin: {port: 0}\ntelemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
        f"backends:\n  - {{name: a, url: '{backend.url}', models: [fake-model]}}\n"))
    await proxy.start()
    try:
        port = int(proxy.http_url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        got = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    finally:
        await proxy.stop()
        await backend.stop()
    return got, list(backend.seen)


_CHAT = b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}'


def _chat(target: bytes = b"/v1/chat/completions", extra: bytes = b"") -> bytes:
    """A chat request the proxy forwards, with `extra` header lines."""
    return (b"POST %s HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (target, len(_CHAT), extra, _CHAT))


@pytest.mark.parametrize("head", [
    # fuzz http1 #2 (the target's oracle now also fails on a head the backend's own parser refuses): a NUL
    # inside a header name was passed on to the backend (RFC 9110 5.1: a field name is a token).
    _chat(extra=b"Coc\x00\x00ngth: 63\r\n"),
    _chat(extra=b"X(y): 1\r\n"),
    # ... and control characters in header values (RFC 9110 5.5: NUL must be refused or replaced).
    _chat(extra=b"X-Encoding: c\x00\x00nk\r\n"),
    _chat(extra=b"X-Type: \x19application/json\r\n"),
    # ... and a request target that is neither a path nor an absolute URL (RFC 9112 3.2).
    _chat(target=b"pletions"),
    _chat(target=b"??????"),
    # ... and the HTTP/2 preface's method in HTTP/1.x ("PRI * HTTP/1.0"), or an asterisk not for OPTIONS:
    # the backend's parser took it for the start of an HTTP/2 connection.
    b"PRI * HTTP/1.0\r\n\r\n\x04\xfb\xff\xff\xff\x03\x05\x00",
    _chat(target=b"*"),
])
async def test_a_malformed_head_is_refused_by_the_proxy_not_passed_on(head: bytes) -> None:
    got, seen = await _exchange(head)
    assert got.startswith(b"HTTP/1.1 400 "), got[:100]
    assert b'"type": "invalid_request_error"' in got
    assert seen == []


async def test_tabs_and_non_ascii_in_header_values_still_pass() -> None:
    # The other side of #2: HTAB and obs-text (bytes >= 0x80) are allowed in a field value, and an absolute
    # URL is a target.
    for head in (_chat(extra=b"X-Note: caf\xc3\xa9\tau lait\r\nConnection: close\r\n"),
                 _chat(target=b"http://p/v1/chat/completions", extra=b"Connection: close\r\n")):
        got, seen = await _exchange(head)
        assert got.startswith(b"HTTP/1.1 200 "), got[:100]
        assert len(seen) == 1


def test_a_response_error_carries_what_the_bytes_before_it_completed() -> None:
    # fuzz response #1: the smoke run's split-feeding oracle disagreed on a 100 Continue followed by a
    # status line that is not HTTP. Fed in one piece, the Informational completed before the bad line rides
    # on the error (ProtocolError.events); fed in two, the first feed returned it. The parser was right, the
    # target read only the returned events; this pins the parser's side of that contract.
    from proxy.wire.http1 import Informational, ProtocolError, ResponseParser

    informational = b"HTTP/1.0 100 OK\r\n\r\n"
    bad = b"untilos\x00\r\nTHTTP.210T0\r\n\r\n"
    with pytest.raises(ProtocolError) as whole:
        ResponseParser().feed(informational + bad)
    assert [(type(e), e.status) for e in whole.value.events] == [(Informational, 100)]

    parser = ResponseParser()
    assert [(type(e), e.status) for e in parser.feed(informational)] == [(Informational, 100)]
    with pytest.raises(ProtocolError) as split:
        parser.feed(bad)
    assert split.value.events == []
