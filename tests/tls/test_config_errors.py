"""TLS config errors name the file: missing, unreadable, not PEM, expired, or not matching its key."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from proxy.config import ConfigError, parse_config
from tests.tls.conftest import Pki, backend_line, tls_listen

BACKEND = backend_line("http://127.0.0.1:9")


def _errors(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    return info.value.errors


def test_a_valid_pair_loads(pki: Pki) -> None:
    cfg = parse_config(tls_listen(pki) + BACKEND)
    assert cfg.listen.tls is not None and cfg.listen.tls.cert_file == str(pki.cert_file)


def test_missing_file_is_named(pki: Pki, tmp_path: Path) -> None:
    pki.cert_file.unlink()
    errs = _errors(tls_listen(pki) + BACKEND)
    assert any(e.startswith("listen.tls.cert_file (line 4): cannot read") and str(pki.cert_file) in e
               and "No such file" in e for e in errs), errs


def test_key_that_does_not_match_its_certificate_is_named(pki: Pki) -> None:
    _, other_key = pki.issue("other")
    other_key.replace(pki.key_file)
    errs = _errors(tls_listen(pki) + BACKEND)
    assert any(e.startswith("listen.tls.key_file") and f"the private key in {pki.key_file} does not match "
               f"the certificate in {pki.cert_file}" in e for e in errs), errs


def test_expired_certificate_is_named(pki: Pki) -> None:
    past = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
    cert = pki.ca.issue_cert("localhost", not_before=past, not_after=past + datetime.timedelta(days=1))
    cert.private_key_and_cert_chain_pem.write_to_path(str(pki.cert_file))
    cert.private_key_pem.write_to_path(str(pki.key_file))
    errs = _errors(tls_listen(pki) + BACKEND)
    assert any(e.startswith("listen.tls.cert_file") and f"the certificate in {pki.cert_file} expired on 2020-01-02"
               in e for e in errs), errs


def test_not_a_certificate_and_client_auth_without_a_ca(pki: Pki) -> None:
    pki.cert_file.write_text("hello\n")
    errs = _errors(tls_listen(pki, "client_auth: required\n") + BACKEND)
    assert any(f"{pki.cert_file} holds no PEM certificate" in e for e in errs), errs
    assert any(e.startswith("listen.tls.client_ca_file") and "is required when client_auth is 'required'" in e
               for e in errs), errs


def test_backend_tls_files_are_checked_and_https_is_accepted(pki: Pki) -> None:
    ok = parse_config(f"backends:\n  - name: a\n    url: https://localhost:9\n    tls: {{ca_file: '{pki.ca_file}'}}\n")
    assert ok.backends[0].url.startswith("https://")
    errs = _errors("backends:\n  - name: a\n    url: https://localhost:9\n    tls: {ca_file: /nonexistent/ca.pem}\n")
    assert any(e.startswith("backends[0].tls.ca_file") and "/nonexistent/ca.pem" in e for e in errs), errs
