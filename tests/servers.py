"""Where the tests find the real servers they start: the checkout's .servers/ first, then the system.

``bash scripts/setup.sh --for tests`` unpacks Debian's etcd-server, prometheus
and prometheus-alertmanager into ``<repo>/.servers`` without installing them
as system services; a machine that has the packages installed works too.  A
missing binary fails the test (never skips) and says how to get it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SEARCH = (REPO / ".servers" / "usr" / "bin", Path("/usr/bin"))


def server_binary(name: str, package: str) -> str:
    """The path of ``name`` from Debian package ``package``; fails the test naming the fix when it is missing."""
    for directory in SEARCH:
        path = directory / name
        if os.access(path, os.X_OK):
            return str(path)
    pytest.fail(f"{name} is missing from {' and '.join(map(str, SEARCH))}: run `bash scripts/setup.sh --for tests` "
                f"(it unpacks Debian's {package} into .servers/) or install Debian {package}")
