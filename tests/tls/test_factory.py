"""proxy/upstream/factory.py backend_tls: which section (and SSLContext) each backend address gets."""

from __future__ import annotations

from proxy.config import parse_config
from proxy.upstream.factory import backend_tls
from tests.tls.conftest import Pki


def _config(pki: Pki, discovery: bool) -> str:
    return ("backends:\n  - name: pods\n    url: https://model-servers.inference.svc:8443\n"
            "    grpc: grpcs://model-servers.inference.svc:9443\n"
            f"    tls: {{ca_file: '{pki.ca_file}'}}\n"
            "  - name: plain\n    url: http://10.0.0.9:8000\n"
            f"discovery: {{enabled: {'true' if discovery else 'false'}}}\n")


def test_contexts_are_built_once_per_section_and_looked_up_by_origin(pki: Pki) -> None:
    cfg = parse_config(_config(pki, discovery=False))
    tls = backend_tls(lambda: cfg)
    one = tls.for_url("https://model-servers.inference.svc:8443")
    assert one is not None and one[1] is None  # SNI: the URL's host
    again = tls.for_url("https://model-servers.inference.svc:8443/metrics")  # a URL below it: the same section
    assert again is not None and again[0] is one[0]
    assert tls.for_url("http://10.0.0.9:8000") is None  # plain http: no TLS
    grpc = tls.for_grpc("grpcs://model-servers.inference.svc:9443")
    assert grpc is not None and grpc[0] is not one[0]  # ALPN h2, not http/1.1: a context of its own
    assert tls.for_grpc("10.0.0.9:9000") is None
    # Not configured, no discovery: the defaults (system CAs, the URL's host), a context of their own.
    unknown = tls.for_url("https://10.0.0.5:8443")
    assert unknown is not None and unknown[0] is not one[0] and unknown[1] is None


def test_discovered_pods_get_their_services_section_and_name(pki: Pki) -> None:
    cfg = parse_config(_config(pki, discovery=True))
    tls = backend_tls(lambda: cfg)
    service = tls.for_url("https://model-servers.inference.svc:8443")
    pod_a = tls.for_url("https://10.0.0.5:8443")
    pod_b = tls.for_url("https://10.0.0.6:8443/metrics")
    assert pod_a is not None and pod_b is not None and service is not None
    assert pod_a[1] == pod_b[1] == "model-servers.inference.svc"  # the Service's certificate name
    assert pod_a[0] is pod_b[0]  # one context for every pod of the service
    other_port = tls.for_url("https://10.0.0.5:9999")
    assert other_port is not None and other_port[1] is None  # no configured service on that port
