"""Fixtures shared by the suite: real servers and checkpoint locations."""

from __future__ import annotations

import pytest

from .etcd_server import etcd_auth_server, etcd_outage_server, etcd_run_id, etcd_server, etcd_tls_server  # noqa: F401
from .prometheus_server import alertmanager, prometheus, webhook  # noqa: F401  (fixtures)
from .s3_server import moto_server, s3_url  # noqa: F401  (fixtures)
from .stores import LocalStore, S3Store


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """An empty checkpoint location on each backend, with raw access for tampering."""
    if request.param == "local":
        return LocalStore(tmp_path / "ckpt")
    url, endpoint = request.getfixturevalue("s3_url")
    return S3Store(url, endpoint)
