"""TLS configuration and SSL contexts, both directions: what a listener serves and what a backend is
verified against. Kept apart from the listeners (proxy/listen.py) and the upstream pools so that the config
(proxy/config.py) can use the sections without importing servers.

Contexts are built in each process from the frozen, picklable config sections (an SSLContext does not
pickle), so every --workers worker builds its own.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import ssl
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

from proxy.core.bounds import check_config

log = logging.getLogger("affinity_proxy.tls")

TLS_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
ALPN_PROTOCOLS = ("h2", "http/1.1")
_CLIENT_AUTH = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


@dataclass(frozen=True)
class TlsConfig:
    """YAML `tls:` under `listen`, `grpc_listen` or `admin`: the listener speaks TLS with this pair.

    The files are checked when the config is loaded (and on every reload): a missing, unreadable or expired
    file, or a certificate that does not match its key, is an error naming the file. `watch_interval_s`: how
    often the files' modification times are polled; a changed pair is loaded and served to new handshakes
    while open connections keep theirs.
    """

    cert_file: str = field(metadata={"min_len": 1})  # PEM: the certificate, then its intermediates
    key_file: str = field(metadata={"min_len": 1})  # PEM private key of the first certificate
    client_ca_file: str | None = None  # PEM bundle of CAs that sign client certificates (mTLS)
    client_auth: Literal["none", "optional", "required"] = "none"
    min_version: Literal["1.2", "1.3"] = "1.2"
    watch_interval_s: float = field(default=5.0, metadata={"gt": 0})

    def __post_init__(self) -> None:
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        if self.client_auth != "none" and self.client_ca_file is None:
            yield "client_ca_file", f"is required when client_auth is {self.client_auth!r}"
        if self.client_auth == "none" and self.client_ca_file is not None:
            yield "client_auth", "must be 'optional' or 'required' when client_ca_file is set"
        for name, message in tls_file_errors(self.cert_file, self.key_file, self.client_ca_file):
            yield name, message

    def files(self) -> tuple[str, ...]:
        return tuple(f for f in (self.cert_file, self.key_file, self.client_ca_file) if f is not None)


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def tls_file_errors(cert_file: str | None, key_file: str | None, ca_file: str | None,
                    *, prefix: str = "") -> list[tuple[str, str]]:
    """(field, message) for each of the files that is missing, unreadable, not PEM, expired or (the pair)
    not matching; each message names the file. Used by the server and the backend (client) TLS sections."""
    from cryptography import x509  # imported here: only configs with TLS pay for it

    errors: list[tuple[str, str]] = []
    blobs: dict[str, bytes] = {}
    for name, path in (("cert_file", cert_file), ("key_file", key_file), ("ca_file", ca_file)):
        if path is None:
            continue
        try:
            blobs[name] = _read(path)
        except OSError as exc:
            errors.append((prefix + name, f"cannot read {path}: {exc.strerror or exc}"))
    now = datetime.datetime.now(datetime.timezone.utc)
    for name in ("cert_file", "ca_file"):
        if name not in blobs:
            continue
        path = cert_file if name == "cert_file" else ca_file
        try:
            certs = x509.load_pem_x509_certificates(blobs[name])
        except ValueError:
            errors.append((prefix + name, f"{path} holds no PEM certificate"))
            blobs.pop(name)
            continue
        leaf = certs[0]
        if leaf.not_valid_after_utc < now:
            errors.append((prefix + name, f"the certificate in {path} expired on {leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"))
        elif leaf.not_valid_before_utc > now:
            errors.append((prefix + name, f"the certificate in {path} is not valid before {leaf.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"))
    if "cert_file" in blobs and "key_file" in blobs:
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            probe.load_cert_chain(cert_file, key_file)  # type: ignore[arg-type]  # both are set when both were read
        except ssl.SSLError as exc:
            if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
                msg = f"the private key in {key_file} does not match the certificate in {cert_file}"
            else:
                msg = f"cannot load the key {key_file} for {cert_file}: {exc.reason or exc}"
            errors.append((prefix + "key_file", msg))
    return errors


def server_context(cfg: TlsConfig, alpn: tuple[str, ...] = ALPN_PROTOCOLS) -> ssl.SSLContext:
    """One generation of a listener's TLS: the pair, client verification, minimum version and ALPN (h2 and
    http/1.1 on the main data listener; http/1.1 alone on the admin listener, h2 alone on grpc_listen)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = TLS_VERSIONS[cfg.min_version]
    ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    if cfg.client_ca_file is not None:
        ctx.load_verify_locations(cafile=cfg.client_ca_file)
    ctx.verify_mode = _CLIENT_AUTH[cfg.client_auth]
    ctx.set_alpn_protocols(list(alpn))
    ctx.options |= ssl.OP_NO_COMPRESSION
    return ctx


class ReloadingContext(ssl.SSLContext):
    """The SSLContext a server is built with; each new connection is wrapped by the CURRENT generation.

    asyncio's and uvloop's TLS transports both call ``wrap_bio`` on the server's context once per accepted
    connection, so delegating it hands new handshakes the newest certificate (and client CA, verify mode,
    minimum version) while every open connection keeps the SSLObject, and so the context, it started with.
    """

    current: ssl.SSLContext

    def __new__(cls, first: ssl.SSLContext) -> "ReloadingContext":
        self = super().__new__(cls, ssl.PROTOCOL_TLS_SERVER)
        self.current = first
        return self

    def __init__(self, first: ssl.SSLContext) -> None:  # SSLContext.__init__ takes the protocol only
        pass

    def wrap_bio(self, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO, server_side: bool = False,
                 server_hostname: str | bytes | None = None,
                 session: ssl.SSLSession | None = None) -> ssl.SSLObject:
        return self.current.wrap_bio(incoming, outgoing, server_side=server_side,
                                     server_hostname=server_hostname, session=session)

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        return self.current.wrap_socket(*args, **kwargs)


class ServerTls:
    """A listener's TLS: the context to build its server with, and the watcher that reloads the files.

    Built in each process from the (picklable) `TlsConfig`: SSL contexts do not pickle, so a --workers
    worker builds its own. `poll()` compares the files' mtimes and sizes; on a change it checks and loads the
    new files into a fresh context and makes it current; a bad new pair is logged (naming the file) and the
    old one stays in force.
    """

    def __init__(self, cfg: TlsConfig, name: str = "listener", alpn: tuple[str, ...] = ALPN_PROTOCOLS) -> None:
        self.cfg = cfg
        self.name = name
        self.alpn = alpn
        self._stamp = self._stamps()
        self.context = ReloadingContext(server_context(cfg, alpn))
        self.generation = 1
        self._task: asyncio.Task[None] | None = None

    def _stamps(self) -> tuple[tuple[int, int] | None, ...]:
        out: list[tuple[int, int] | None] = []
        for path in self.cfg.files():
            try:
                st = os.stat(path)
            except OSError:
                out.append(None)
            else:
                out.append((st.st_mtime_ns, st.st_size))
        return tuple(out)

    def poll(self) -> bool:
        """Load the files again if they changed; True when a new generation is now served."""
        stamp = self._stamps()
        if stamp == self._stamp:
            return False
        errors = tls_file_errors(self.cfg.cert_file, self.cfg.key_file, self.cfg.client_ca_file)
        if errors:
            # Often a half-written pair (the certificate replaced, the key not yet): try again next poll.
            log.warning("%s TLS files changed but are not usable yet: %s", self.name,
                        "; ".join(m for _, m in errors))
            return False
        try:
            fresh = server_context(self.cfg, self.alpn)
        except (OSError, ssl.SSLError) as exc:
            log.warning("%s TLS files changed but cannot be loaded: %s", self.name, exc)
            return False
        self._stamp = stamp
        self.context.current = fresh
        self.generation += 1
        log.info("%s: TLS certificate reloaded from %s (generation %d)", self.name, self.cfg.cert_file,
                 self.generation)
        return True

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name=f"tls-watch-{self.name}")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.watch_interval_s)
            try:
                self.poll()
            except Exception:
                log.exception("%s: TLS reload failed", self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


_LISTENER_ALPN = {"listen": ALPN_PROTOCOLS, "admin": ("http/1.1",), "grpc_listen": ("h2",)}


def server_tls(cfg: TlsConfig | None, name: str) -> ServerTls | None:
    """The TLS of the listener `name` (listen, admin or grpc_listen), with the ALPN that listener speaks."""
    return None if cfg is None else ServerTls(cfg, name, _LISTENER_ALPN.get(name, ALPN_PROTOCOLS))


# ------------------------------------------------------------------------------------------ upstream TLS


@dataclass(frozen=True)
class BackendTlsConfig:
    """YAML `tls:` under a backend: how an https:// (and grpcs) backend is verified and who we are to it.

    Verification is on by default against the system's CA store, or `ca_file` when given. `server_name`
    overrides the name sent as SNI and checked against the certificate (the URL's host otherwise);
    `cert_file`/`key_file` present a client certificate (a backend behind mTLS).
    """

    ca_file: str | None = None
    server_name: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify: bool = True
    min_version: Literal["1.2", "1.3"] = "1.2"

    def __post_init__(self) -> None:
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        if (self.cert_file is None) != (self.key_file is None):
            yield "cert_file", "cert_file and key_file are given together (a client certificate and its key)"
            return
        yield from tls_file_errors(self.cert_file, self.key_file, self.ca_file)


DEFAULT_BACKEND_TLS = BackendTlsConfig()


def client_context(cfg: BackendTlsConfig, alpn: tuple[str, ...] = ("http/1.1",)) -> ssl.SSLContext:
    """A client context for one backend: built once per backend (per config) and reused by every connection."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.ca_file)
    ctx.minimum_version = TLS_VERSIONS[cfg.min_version]
    if not cfg.verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cfg.cert_file is not None and cfg.key_file is not None:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    ctx.set_alpn_protocols(list(alpn))
    return ctx


ClientTlsFor = Callable[[str], "tuple[ssl.SSLContext, str | None] | None"]


class ClientTls:
    """Which SSLContext (and SNI name) a connection to a backend uses: None for plain http:// and h2c.

    `settings(key)` gives a backend's `tls:` section (None: the defaults, system CAs and verification on);
    the key is the origin (scheme://host:port, as written) of an https URL (the backend's, its metrics URL's,
    or any URL below them) or a gRPC address (``grpcs://host:port`` is TLS, ``host:port`` is h2c).
    Contexts are built once per distinct section and ALPN and then shared by every connection to every
    backend with that section, so a handshake is paid per connection, never per request (the pools keep
    their connections), and a reload that keeps a backend's section keeps its context.
    """

    def __init__(self, settings: Callable[[str], BackendTlsConfig | None]) -> None:
        self._settings = settings
        self._contexts: dict[tuple[BackendTlsConfig, tuple[str, ...]], ssl.SSLContext] = {}

    def _context(self, cfg: BackendTlsConfig, alpn: tuple[str, ...]) -> ssl.SSLContext:
        ctx = self._contexts.get((cfg, alpn))
        if ctx is None:
            ctx = self._contexts[(cfg, alpn)] = client_context(cfg, alpn)
        return ctx

    def for_url(self, url: str) -> tuple[ssl.SSLContext, str | None] | None:
        if not url.startswith("https://"):
            return None
        cfg = self._settings(url_origin(url)) or DEFAULT_BACKEND_TLS
        return self._context(cfg, ("http/1.1",)), cfg.server_name

    def for_grpc(self, address: str) -> tuple[ssl.SSLContext, str | None] | None:
        if not address.startswith("grpcs://"):
            return None
        cfg = self._settings(address) or DEFAULT_BACKEND_TLS
        return self._context(cfg, ("h2",)), cfg.server_name


def url_origin(url: str) -> str:
    """scheme://netloc of a URL, as written (the key `ClientTls` looks a backend's section up by)."""
    scheme, sep, rest = url.partition("://")
    return scheme + sep + rest.split("/", 1)[0].split("?", 1)[0]


def grpc_host_port(address: str) -> tuple[str, int]:
    """host and port of a backend's gRPC address (``host:port`` or ``grpcs://host:port``)."""
    host, _, port = address.removeprefix("grpcs://").rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def describe_tls_error(exc: BaseException) -> str | None:
    """A clear sentence for a failed handshake with a backend (None when `exc` is not about TLS)."""
    cur: BaseException | None = exc
    for _ in range(5):
        if cur is None:
            return None
        if isinstance(cur, ssl.SSLCertVerificationError):
            return f"TLS certificate verification failed: {cur.verify_message or cur.reason or cur}"
        if isinstance(cur, ssl.SSLError):
            return f"TLS handshake failed: {cur.reason or cur}"
        cur = cur.__cause__ or cur.__context__
    return None


__all__ = [
    "ALPN_PROTOCOLS", "BackendTlsConfig", "ClientTls", "ClientTlsFor", "grpc_host_port", "url_origin", "DEFAULT_BACKEND_TLS", "ReloadingContext", "ServerTls", "TlsConfig",
    "client_context", "describe_tls_error", "server_context", "server_tls", "tls_file_errors",
]
