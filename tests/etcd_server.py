"""Pytest fixtures running real etcd servers (Debian's etcd, see tests/servers.py) on free loopback ports.

* ``etcd_server``: one plain server for the session; ``etcd_run_id`` gives
  each test its own run id (and so its own key prefix);
* ``etcd_outage_server``: a server of the test's own, which the test stops
  and starts (same ports, same data) to simulate an outage;
* ``etcd_auth_server``: auth enabled, user ``root`` / ``ROOT_PASSWORD``,
  auth tokens that expire after 2 s (to exercise re-authentication);
  ``etcd_auth_outage_server`` is one of the test's own, to stop and start;
* ``etcd_tls_server``: https with client-certificate auth; the CA and
  certificates are made by the ``openssl`` CLI in the fixture.

A missing etcd binary fails the run (never skips): install Debian's
``etcd-server``.  Data directories live in /dev/shm when it exists, since
etcd fsyncs every write.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .servers import server_binary

STARTUP_TIMEOUT_S = 20.0
ROOT_PASSWORD = "root-pw"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class TlsFiles:
    """PEM files made for a TLS server: the CA and a client certificate it signed."""

    ca_file: str
    cert_file: str
    key_file: str
    server_cert: str
    server_key: str


class EtcdServer:
    """One etcd process; ``stop()`` and ``start()`` keep its ports and data."""

    def __init__(self, root: Path, *, extra_args: tuple[str, ...] = (), tls: TlsFiles | None = None) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.log_path = root / "etcd.log"
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.tls = tls
        scheme = "https" if tls else "http"
        self.endpoint = f"{scheme}://127.0.0.1:{self.client_port}"
        self.url = f"{'etcds' if tls else 'etcd'}://127.0.0.1:{self.client_port}"
        self._extra_args = extra_args
        self._proc: subprocess.Popen[bytes] | None = None

    def _command(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            server_binary("etcd", "etcd-server"),
            "--name=test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.endpoint}",
            f"--advertise-client-urls={self.endpoint}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            "--log-level=warn",
            *self._extra_args,
        ]
        if self.tls:
            cmd += [
                f"--cert-file={self.tls.server_cert}",
                f"--key-file={self.tls.server_key}",
                f"--trusted-ca-file={self.tls.ca_file}",
                "--client-cert-auth",
            ]
        return cmd

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.tls.ca_file)
        ctx.load_cert_chain(self.tls.cert_file, self.tls.key_file)
        return ctx

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1, context=self._ssl_context()) as r:
                return bool(json.load(r).get("health") == "true")
        except (OSError, ValueError):
            return False

    def start(self) -> None:
        """Start (or restart) etcd and wait until /health answers true."""
        server_binary("etcd", "etcd-server")  # fails the test, naming the fix, when etcd is missing
        assert self._proc is None, "already running"
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.healthy():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-3000:]
                pytest.fail(f"etcd on {self.endpoint} did not become healthy:\n{tail}")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM etcd and wait for it to exit (SIGKILL after 10 s)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def gateway(self, path: str, body: dict[str, object], token: str | None = None) -> dict[str, object]:
        """POST to the JSON gateway (fixture setup only; the code under test has its own client)."""
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        request = urllib.request.Request(f"{self.endpoint}{path}", json.dumps(body).encode(), headers)
        with urllib.request.urlopen(request, timeout=5, context=self._ssl_context()) as r:
            answer: dict[str, object] = json.load(r)
            return answer


def _scratch_dir() -> Path:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="etcd-test-", dir=base))


@contextlib.contextmanager
def _running(**kwargs: object) -> Iterator[EtcdServer]:
    root = _scratch_dir()
    server = EtcdServer(root, **kwargs)  # type: ignore[arg-type]
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """A plain etcd for the whole session; tests keep apart by ``etcd_run_id``."""
    with _running() as server:
        yield server


@pytest.fixture
def etcd_run_id() -> str:
    """A run id no other test uses, so keys under ``/resilient/<run_id>/`` start empty."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def etcd_outage_server() -> Iterator[EtcdServer]:
    """An etcd of this test's own, to stop and start."""
    with _running() as server:
        yield server


@pytest.fixture(scope="session")
def etcd_auth_server() -> Iterator[EtcdServer]:
    """etcd with auth enabled: user ``root`` with password ``ROOT_PASSWORD``; tokens live 2 s."""
    with _running(extra_args=AUTH_ARGS) as server:
        _enable_auth(server)
        yield server


@pytest.fixture
def etcd_auth_outage_server() -> Iterator[EtcdServer]:
    """As ``etcd_auth_server``, of this test's own, to stop and start (a restart ends every token it gave)."""
    with _running(extra_args=AUTH_ARGS) as server:
        _enable_auth(server)
        yield server


AUTH_ARGS = ("--auth-token=simple", "--auth-token-ttl=2")


def _enable_auth(server: EtcdServer) -> None:
    server.gateway("/v3/auth/user/add", {"name": "root", "password": ROOT_PASSWORD})
    server.gateway("/v3/auth/user/grant", {"user": "root", "role": "root"})
    server.gateway("/v3/auth/enable", {})


def _make_tls_files(root: Path) -> TlsFiles:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("the openssl CLI is missing: install Debian openssl (needed to make test certificates)")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=root, check=True, capture_output=True, timeout=30)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=resilient-test-ca")
    # etcd 3.4's JSON gateway dials etcd's own gRPC port with the server certificate, so under
    # --client-cert-auth that certificate must also allow clientAuth (else every call is HTTP 503).
    (root / "server.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    (root / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext",
        )  # fmt: skip
    return TlsFiles(
        ca_file=str(root / "ca.crt"),
        cert_file=str(root / "client.crt"),
        key_file=str(root / "client.key"),
        server_cert=str(root / "server.crt"),
        server_key=str(root / "server.key"),
    )


@pytest.fixture(scope="session")
def etcd_tls_server() -> Iterator[EtcdServer]:
    """etcd over https requiring a client certificate; ``.tls`` holds the CA and client files."""
    certs = _scratch_dir()
    try:
        with _running(tls=_make_tls_files(certs)) as server:
            yield server
    finally:
        shutil.rmtree(certs, ignore_errors=True)
