"""Pytest fixtures that run a real moto S3 server on loopback for the S3 backend tests.

``moto_server`` starts one server per session on a free port and fails the
run (never skips) if it cannot; ``s3_url`` gives each test its own bucket
and fake credentials, so tests never see each other's objects or touch AWS.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

STARTUP_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer means the server is up
    except OSError:
        return False


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """Endpoint URL of a moto S3 server running for the whole session."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    # Output goes to a file, not a pipe: nobody drains a pipe, and a full one would stall the server.
    with tempfile.TemporaryFile() as log:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        except OSError as e:
            pytest.fail(f"could not start moto server: {e} (pip install 'moto[server]')")
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _answers(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                log.seek(0)
                output = log.read().decode(errors="replace")[-4000:]
                why = f"exit {proc.returncode}; pip install 'moto[server]'"
                pytest.fail(f"moto server on {url} did not come up ({why}):\n{output}")
            time.sleep(0.2)
        try:
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def s3_url(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """(``s3://BUCKET/ckpts``, endpoint URL) for a fresh, empty bucket."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    import boto3

    bucket = f"ckpt-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    yield f"s3://{bucket}/ckpts", moto_server
