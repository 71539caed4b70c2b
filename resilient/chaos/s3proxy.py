"""An S3 endpoint for a drill: a real S3-compatible server behind a proxy that injects storage faults.

:class:`S3Endpoint` starts moto's S3 server (``python -m moto.server``,
PyPI ``moto[server]``) on a free loopback port, creates the drill's bucket
and puts a :class:`FaultProxy` in front of it, on another free loopback
port: the run's checkpoints go through the proxy (``--endpoint-url``), the
runner's own checks (the committed checkpoints verify) go to the server
directly.  The proxy forwards every request as it came and, while a fault
is set, answers as a troubled store does:

- ``errors``: a share ``rate`` of requests gets ``503 SlowDown`` (the
  store's "reduce your request rate", which an S3 client retries);
- ``drop``: a share ``rate`` of requests has its connection closed once
  the request is read, without an answer (a reset, a load balancer
  restart);
- ``slow``: every request is held ``delay_s`` before it is forwarded (a
  store under load, a congested link).

The draws come from a seeded generator, so a drill's faults strike the same
requests' order each time; the proxy counts what it did
(:meth:`FaultProxy.counts`).  Everything binds 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .monitor import free_port, stop_process

MODES = ("errors", "drop", "slow")
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "drill", "AWS_SECRET_ACCESS_KEY": "drill", "AWS_DEFAULT_REGION": "us-east-1"}
"""What the run's processes get: moto accepts any credentials; none of the user's reach a drill."""
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
"""Headers of one hop, not forwarded (``Expect: 100-continue`` is answered here, by the handler)."""


def run_env() -> dict[str, str]:
    """The environment of a storage drill's agents: this one's, with the drill's credentials and no AWS endpoint,
    profile or session of the user's."""
    env = {**os.environ, **CREDENTIALS}
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        env.pop(var, None)
    return env


@contextlib.contextmanager
def credentials() -> Iterator[None]:
    """The drill's credentials in this process's environment for the block (the runner's own checks)."""
    saved = {k: os.environ.get(k) for k in (*CREDENTIALS, "AWS_PROFILE", "AWS_SESSION_TOKEN")}
    os.environ.update(CREDENTIALS)
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(var, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def unavailable() -> str | None:
    """Why a storage drill cannot run here (None: it can)."""
    for module, package in (("moto", "moto[server]"), ("flask", "moto[server]"), ("boto3", "boto3")):
        if importlib.util.find_spec(module) is None:
            return f"storage drills need {module} (pip install '{package}')"
    return None


class FaultProxy:
    """A forwarding HTTP proxy to ``upstream`` (``host:port``) with a fault that can be set and cleared."""

    def __init__(self, upstream: tuple[str, int], seed: int = 0) -> None:
        self.upstream = upstream
        self._lock = threading.Lock()
        self._mode: str | None = None
        self._rate = 1.0
        self._delay = 0.0
        self._rng = random.Random(seed)
        self._counts = {"forwarded": 0, "errors": 0, "drop": 0, "slow": 0}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-fault-proxy", daemon=True)
        self._thread.start()

    def set_fault(self, mode: str, *, rate: float = 1.0, delay_s: float = 0.0) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown storage fault {mode!r}; use one of {', '.join(MODES)}")
        with self._lock:
            self._mode, self._rate, self._delay = mode, rate, delay_s

    def clear(self) -> None:
        with self._lock:
            self._mode = None

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def _draw(self) -> tuple[str | None, float]:
        with self._lock:
            mode, delay = self._mode, self._delay
            if mode in ("errors", "drop") and self._rng.random() >= self._rate:
                mode = None
            self._counts[mode or "forwarded"] += 1
            return mode, delay

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        mode, delay = self._draw()
        if mode == "drop":
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if mode == "errors":
            h.send_response(503, "Slow Down")
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(SLOW_DOWN)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(SLOW_DOWN)
            return
        if mode == "slow":
            time.sleep(delay)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in HOP}
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.request(h.command, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except OSError:
            h.close_connection = True  # the server went away: the client sees a reset and retries
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        finally:
            conn.close()
        try:
            h.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in HOP and k.lower() != "content-length":
                    h.send_header(k, v)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(data)
        except OSError:
            h.close_connection = True  # the client gave up waiting (its read timeout): nobody to answer

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class S3Endpoint:
    """moto's S3 server with the drill's bucket, and the fault proxy in front of it."""

    def __init__(self, root: Path, bucket: str, seed: int = 0) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.bucket = bucket
        port = free_port()
        self.direct = f"http://127.0.0.1:{port}"
        self.log = root / "moto.log"
        env = run_env()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                         stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.proxy: FaultProxy | None = None
        try:
            self._wait_ready()
            self._client().create_bucket(Bucket=bucket)
            self.proxy = FaultProxy(("127.0.0.1", port), seed)
        except BaseException:
            self.close()
            raise
        self.url = self.proxy.url
        """What the run's ``--endpoint-url`` is: the proxy."""

    def _client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.direct, region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def _wait_ready(self) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.direct, timeout=1).close()
                return
            except urllib.error.HTTPError:
                return  # any HTTP answer: the server is up
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start ({self.log}):\n"
                                       f"{self.log.read_text()[-2000:]}") from None
                time.sleep(0.2)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        stop_process(self.proc)

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc.poll() is None else []
