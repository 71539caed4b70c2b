"""The transport under our etcd v3 client: one JSON POST to etcd's gRPC gateway, made to survive.

etcd 3.4+ serves its gRPC API as JSON over HTTP under ``/v3/``.  This module
owns how a request gets there, and nothing about what it asks:

* several endpoints: a connection failure moves on to the next one, and the
  one that answered is tried first next time;
* an unreachable store (every endpoint failed, or etcd answered
  "unavailable", e.g. no leader) is retried with exponential backoff until
  it has been unreachable for ``outage_tolerance_s``; the start and end of
  each outage go to ``on_outage("start"|"end", detail)``; past the
  tolerance calls raise :class:`StoreUnavailableError`;
* user/password auth: a token from ``/v3/auth/authenticate`` goes in the
  ``Authorization`` header and is fetched again when etcd says it expired;
* TLS with a CA file and an optional client certificate (``https://``).

Each request uses a fresh connection, so "connection refused" always means
the request was not sent.  Clock and sleep are injected for tests.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..core.errors import ConfigError
from .store import StoreAuthError, StoreRequestError, StoreUnavailableError

OutageCallback = Callable[[str, str], None]
# gRPC Canceled (the gateway's connection closing while etcd shuts down), DeadlineExceeded and
# Unavailable (no leader, timeout): the server is going or not ready, so try again.
_UNAVAILABLE_CODES = frozenset({1, 4, 14})
NOT_FOUND = 5  # gRPC NotFound (e.g. an unknown lease)
_UNAUTHENTICATED = 16
_PERMISSION_DENIED = 7


@dataclass(frozen=True, kw_only=True)
class EtcdConfig:
    """How to reach etcd."""

    endpoints: tuple[str, ...]
    """Client URLs tried in order, ``http://host:port`` or ``https://host:port`` (TLS)."""
    username: str | None = None
    """User for etcd auth; ``None`` when auth is disabled."""
    password: str | None = None
    """Password of ``username``."""
    ca_file: str | None = None
    """PEM file of the CA that signed etcd's certificate (https only; default: system CAs)."""
    cert_file: str | None = None
    """PEM client certificate for etcd's ``--client-cert-auth`` (https only)."""
    key_file: str | None = None
    """PEM private key of ``cert_file``."""
    timeout_s: float = 5.0
    """Timeout of one HTTP request, connect included."""
    outage_tolerance_s: float = 30.0
    """How long the store may stay unreachable before calls raise StoreUnavailableError."""
    backoff_initial_s: float = 0.05
    """First wait between retries while unreachable; doubles each time."""
    backoff_max_s: float = 1.0
    """Longest wait between retries."""

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("etcd endpoints are empty: give at least one, e.g. etcd://127.0.0.1:2379")
        for url in self.endpoints:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
                raise ConfigError(f"etcd endpoint {url!r} is invalid: use http://host:port or https://host:port")
            try:
                parts.port  # noqa: B018  (raises on a bad port)
            except ValueError:
                raise ConfigError(f"etcd endpoint {url!r} has an invalid port") from None
        if (self.username is None) != (self.password is None):
            raise ConfigError("etcd username and password must be given together (or neither)")
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("etcd cert_file and key_file must be given together (or neither)")
        tls_files = self.ca_file or self.cert_file
        if tls_files and not all(u.startswith("https://") for u in self.endpoints):
            raise ConfigError("etcd TLS files are set but an endpoint is not https://: use etcds://host:port")
        if self.timeout_s <= 0 or self.outage_tolerance_s < 0:
            raise ConfigError("etcd timeout_s must be > 0 and outage_tolerance_s >= 0")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ConfigError("etcd backoff must satisfy 0 < backoff_initial_s <= backoff_max_s")

    @classmethod
    def from_url(cls, url: str, **options: Any) -> EtcdConfig:
        """Parse ``etcd://host:port[,host:port...]`` (plain) or ``etcds://...`` (TLS); ``options`` set the rest."""
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in ("etcd", "etcds") or not rest.strip("/"):
            raise ConfigError(f"store URL {url!r} is invalid: use etcd://host:port[,host:port] or etcds://...")
        http_scheme = "https" if scheme == "etcds" else "http"
        hosts = [h.strip() for h in rest.strip("/").split(",")]
        if any(not h or "/" in h or "@" in h for h in hosts):
            raise ConfigError(f"store URL {url!r} is invalid: list host:port pairs separated by commas")
        endpoints = tuple(f"{http_scheme}://{h if h.rsplit(':', 1)[-1].isdigit() else h + ':2379'}" for h in hosts)
        return cls(endpoints=endpoints, **options)

    def describe(self) -> str:
        """The endpoints, for messages (never the password)."""
        return ", ".join(self.endpoints)


class _Unreachable(Exception):
    """Every endpoint failed to answer this attempt."""


class _TokenRejected(Exception):
    """etcd rejected our auth token (expired or revoked)."""


class EtcdTransport:
    """POSTs to etcd's gateway with failover, retries through outages, auth and TLS; thread-safe.

    :meth:`call` raises :class:`StoreUnavailableError` once etcd has been
    unreachable for ``outage_tolerance_s``, :class:`StoreAuthError` on
    rejected credentials or certificates, :class:`StoreRequestError` when
    etcd rejects the request itself.
    """

    def __init__(
        self,
        config: EtcdConfig,
        *,
        on_outage: OutageCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config = config
        self._on_outage = on_outage
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._token: str | None = None
        self._preferred = 0
        self._outage_since: float | None = None
        self._ssl: ssl.SSLContext | None = None
        if any(u.startswith("https://") for u in config.endpoints):
            self._ssl = ssl.create_default_context(cafile=config.ca_file)
            if config.cert_file and config.key_file:
                self._ssl.load_cert_chain(config.cert_file, config.key_file)

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path`` with retries, auth and failover; returns the decoded answer."""
        delay = self.config.backoff_initial_s
        token_refreshed = False
        while True:
            try:
                if self.config.username is not None and self._token is None:
                    self._authenticate()
                result = self._attempt(path, body, self._token)
            except _Unreachable as e:
                now = self._clock()
                with self._lock:
                    started = self._outage_since is None
                    if started:
                        self._outage_since = now
                    since = self._outage_since
                    assert since is not None
                if started and self._on_outage is not None:
                    self._on_outage("start", f"etcd unreachable: {e}")
                remaining = since + self.config.outage_tolerance_s - now
                if remaining <= 0:
                    raise StoreUnavailableError(
                        f"etcd at {self.config.describe()} has been unreachable for {now - since:.1f} s "
                        f"(last error: {e}); check that etcd runs and these endpoints are right, or raise "
                        f"outage_tolerance_s (now {self.config.outage_tolerance_s:g} s)"
                    ) from None
                self._sleep(min(delay, remaining))
                delay = min(delay * 2, self.config.backoff_max_s)
                continue
            except _TokenRejected:
                if token_refreshed:
                    raise StoreAuthError(
                        f"etcd at {self.config.describe()} rejected a fresh auth token for user "
                        f"{self.config.username!r}; check the user's roles"
                    ) from None
                token_refreshed = True
                self._token = None
                continue
            self._outage_over()
            return result

    def _outage_over(self) -> None:
        with self._lock:
            since, self._outage_since = self._outage_since, None
        if since is not None and self._on_outage is not None:
            endpoint = self.config.endpoints[self._preferred]
            self._on_outage("end", f"etcd reachable again at {endpoint} after {self._clock() - since:.1f} s")

    def _authenticate(self) -> None:
        body = {"name": self.config.username, "password": self.config.password}
        try:
            self._token = str(self._attempt("/v3/auth/authenticate", body, None)["token"])
        except StoreRequestError as e:
            raise StoreAuthError(
                f"etcd at {self.config.describe()} refused user {self.config.username!r}: {e}; "
                "check the username and password"
            ) from None

    def _attempt(self, path: str, body: dict[str, Any], token: str | None) -> dict[str, Any]:
        """One try on every endpoint, preferred first; raises _Unreachable when none answers."""
        errors = []
        payload = json.dumps(body).encode()
        n = len(self.config.endpoints)
        start = self._preferred
        for i in ((start + j) % n for j in range(n)):
            url = self.config.endpoints[i]
            try:
                status, answer = self._post(url, path, payload, token)
            except ssl.SSLCertVerificationError as e:
                raise StoreAuthError(
                    f"TLS verification of etcd at {url} failed: {e.verify_message}; "
                    "give the CA that signed etcd's certificate as ca_file"
                ) from None
            except ssl.SSLError as e:
                reason = str(e.reason)
                if not ("CERTIFICATE" in reason or "UNKNOWN_CA" in reason) and isinstance(e, ssl.SSLEOFError):
                    reason = self._why_closed(url) or reason
                if "CERTIFICATE" in reason or "UNKNOWN_CA" in reason:
                    raise StoreAuthError(
                        f"etcd at {url} rejected our TLS client certificate ({reason}); give cert_file and "
                        "key_file signed by a CA that etcd trusts (--trusted-ca-file)"
                    ) from None
                errors.append(f"{url}: {type(e).__name__}: {e}")
                continue
            except (OSError, http.client.HTTPException) as e:
                errors.append(f"{url}: {type(e).__name__}: {e}")
                continue
            code = answer.get("code") if status != 200 else None
            if status == 200:
                self._preferred = i
                return answer
            if status in (408, 502, 503, 504) or code in _UNAVAILABLE_CODES:
                hint = ""
                if status == 503 and url.startswith("https://"):
                    hint = " (with --client-cert-auth, etcd's gateway needs a server certificate allowing clientAuth)"
                errors.append(f"{url}: HTTP {status}: {answer.get('message', answer)}{hint}")
                continue
            self._preferred = i
            self._raise_for(url, path, status, answer, token)
        raise _Unreachable("; ".join(errors))

    def _raise_for(self, url: str, path: str, status: int, answer: dict[str, Any], token: str | None) -> None:
        message = str(answer.get("message") or answer.get("error") or answer)
        code = answer.get("code")
        if code == _UNAUTHENTICATED and token is not None:
            raise _TokenRejected()
        if code == _UNAUTHENTICATED or "user name is empty" in message:
            raise StoreAuthError(f"etcd at {url} requires authentication ({message}); give a username and password")
        if code == _PERMISSION_DENIED:
            raise StoreAuthError(
                f"etcd at {url} denied {path} to user {self.config.username!r} ({message}); grant the user a role"
                " with read-write access to the run's keys"
            )
        raise StoreRequestError(f"etcd at {url} rejected {path} (HTTP {status}): {message}", code)

    def _why_closed(self, url: str) -> str | None:
        """Why an https endpoint closed the connection in the TLS exchange: the reason of a certificate alert, or
        None.  Under TLS 1.3 a server that wants a client certificate judges it after the handshake, and may
        close the connection before the client reads its alert, which then looks like an outage.  Under TLS 1.2
        the certificate is judged inside the handshake, so one handshake capped at 1.2 hears the alert."""
        if self._ssl is None or not url.startswith("https://"):
            return None
        parts = urlsplit(url)
        probe = ssl.create_default_context(cafile=self.config.ca_file)
        if self.config.cert_file and self.config.key_file:
            probe.load_cert_chain(self.config.cert_file, self.config.key_file)
        probe.maximum_version = ssl.TLSVersion.TLSv1_2
        try:
            with socket.create_connection((parts.hostname or "", parts.port or 443),
                                          timeout=self.config.timeout_s) as raw, \
                    probe.wrap_socket(raw, server_hostname=parts.hostname):
                pass  # the handshake went through: the closed connection was not about a certificate
        except ssl.SSLError as e:
            reason = str(e.reason)
            without_one = not (self.config.cert_file and self.config.key_file)
            return reason if "CERTIFICATE" in reason or ("HANDSHAKE_FAILURE" in reason and without_one) else None
        except (OSError, ValueError):
            return None
        return None

    def _post(self, url: str, path: str, payload: bytes, token: str | None) -> tuple[int, dict[str, Any]]:
        conn = self._connection(url)
        headers = {"Content-Type": "application/json", "Connection": "close"}
        if token is not None:
            headers["Authorization"] = token
        try:
            conn.request("POST", path, body=payload, headers=headers)
            response = conn.getresponse()
            raw = response.read()
            status = response.status
        finally:
            conn.close()
        try:
            # a streaming call (lease keepalive) answers one JSON object per line: we sent one request
            answer = json.loads(raw.split(b"\n", 1)[0]) if raw.strip() else {}
        except ValueError:
            answer = {"message": raw[:200].decode(errors="replace")}
        if not isinstance(answer, dict):
            answer = {"message": str(answer)[:200]}
        return status, answer

    def stream(self, path: str, body: dict[str, Any], idle_s: float, stop: threading.Event | None = None,
               on_open: Callable[[socket.socket], None] | None = None) -> Iterator[dict[str, Any]]:
        """POST ``body`` to a streaming call and yield each message it answers, as they come.

        Tried once on each endpoint, preferred first, without the outage
        retries of :meth:`call` (a watch resumes from its revision, and its
        owner paces the tries): raises :class:`StoreUnavailableError` when
        no endpoint answered.  The stream ends, without error, when the
        server closes it, when no message came for ``idle_s`` (a silent
        peer: the caller opens a new one), or once ``stop`` is set.
        ``on_open`` receives the stream's socket, so that another thread can
        shut it down to end the stream at once.
        """
        if self.config.username is not None and self._token is None:
            try:
                self._authenticate()
            except _Unreachable as e:  # the login of a stream is tried once, as the stream: an outage like any other
                raise StoreUnavailableError(f"no etcd endpoint answered the login of a stream: {e}") from None
        payload = json.dumps(body).encode()
        errors = []
        n = len(self.config.endpoints)
        for i in ((self._preferred + j) % n for j in range(n)):
            url = self.config.endpoints[i]
            conn = self._connection(url)
            try:
                headers = {"Content-Type": "application/json"}
                if self._token is not None:
                    headers["Authorization"] = self._token
                conn.request("POST", path, body=payload, headers=headers)
                response = conn.getresponse()
                if response.status != 200:
                    raw = response.read()
                    try:
                        answer = json.loads(raw.split(b"\n", 1)[0]) if raw.strip() else {}
                    except ValueError:
                        answer = {"message": raw[:200].decode(errors="replace")}
                    if response.status in (408, 502, 503, 504) or answer.get("code") in _UNAVAILABLE_CODES:
                        errors.append(f"{url}: HTTP {response.status}: {answer.get('message', answer)}")
                        conn.close()
                        continue
                    conn.close()
                    try:
                        self._raise_for(url, path, response.status, answer, self._token)
                    except _TokenRejected:
                        self._token = None  # fetched again on the next stream
                        raise StoreAuthError(f"etcd at {url} rejected the auth token of a stream") from None
                assert conn.sock is not None
                conn.sock.settimeout(idle_s)
                keep_alive(conn.sock)
                if on_open is not None:
                    on_open(conn.sock)
            except (OSError, http.client.HTTPException) as e:
                errors.append(f"{url}: {type(e).__name__}: {e}")
                conn.close()
                continue
            self._preferred = i
            try:
                while stop is None or not stop.is_set():
                    try:
                        line = response.readline()
                    except (OSError, http.client.HTTPException):
                        return  # idle for idle_s, or the connection broke: the caller resumes
                    if not line:
                        return
                    if line.strip():
                        message = json.loads(line)
                        if isinstance(message, dict):
                            yield message
            finally:
                conn.close()
            return
        raise StoreUnavailableError(f"no etcd endpoint answered a stream: {'; '.join(errors)}")

    def _connection(self, url: str) -> http.client.HTTPConnection:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
        if parts.scheme == "https":
            return http.client.HTTPSConnection(host, port, timeout=self.config.timeout_s, context=self._ssl)
        return http.client.HTTPConnection(host, port, timeout=self.config.timeout_s)

    def close(self) -> None:
        """Nothing to release (connections are per request); present for symmetry with other clients."""


STREAM_KEEPALIVE = (3, 1, 3)
"""A stream's TCP keepalive: first probe after 3 s of silence, then every 1 s, 3 unanswered end it.  A stream to
an etcd that vanished without a reset (powered off, its traffic dropped) ends within about 6 s, at no request to
etcd (the kernel's probes are not requests), so an idle watch need not be reopened to find out."""


def keep_alive(sock: socket.socket) -> None:
    """Turn on TCP keepalive for ``sock`` at :data:`STREAM_KEEPALIVE` (where the platform has the options)."""
    idle, interval, count = STREAM_KEEPALIVE
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
