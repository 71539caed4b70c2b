"""The set-up script's plan: the demo touches nothing system-wide, the tests' servers never become services.

Each case runs the real ``scripts/setup.sh`` from a copy in a scratch
checkout, with a PATH that holds only the tools the plan consults, so the
machine looks like a fresh one without etcd, Prometheus or Alertmanager.
``--dry-run`` prints the plan and must change nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVER_WORDS = ("etcd", "prometheus", "alertmanager")


def _checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    return root


def _bare_path(tmp_path: Path, uid: int | None = None) -> str:
    """A PATH with python3 and the few coreutils the plan uses; ``uid`` fakes `id -u` (and offers no sudo)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    for tool in ("sed", "dirname", "mktemp", "cat"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    if uid is None:
        (bin_dir / "id").symlink_to(shutil.which("id"))
    else:
        (bin_dir / "id").write_text(f"#!/bin/sh\necho {uid}\n")
        (bin_dir / "id").chmod(0o755)
    return str(bin_dir)


def _setup(root: Path, path: str, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": path, "HOME": str(root), "PYTHON": "python3"}
    return subprocess.run(["/bin/bash", str(root / "scripts" / "setup.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def test_the_demo_installs_no_server_and_nothing_system_wide(tmp_path):
    root = _checkout(tmp_path)
    proc = _setup(root, _bare_path(tmp_path), "--for", "demo", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    plan = proc.stdout.lower()
    assert "no debian package to install system-wide" in plan
    assert not [w for w in SERVER_WORDS if w in plan], plan
    assert "extras [report]" in plan and "dry run: nothing changed" in plan
    assert sorted(p.name for p in root.iterdir()) == ["scripts"]  # no .venv, no .servers: nothing changed


def test_the_tests_unpack_their_servers_and_never_enable_one(tmp_path):
    root = _checkout(tmp_path)
    proc = _setup(root, _bare_path(tmp_path), "--for", "tests", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    [unpack] = [line for line in lines if "unpack" in line]
    assert "etcd-server" in unpack and "prometheus" in unpack and "into .servers/" in unpack
    assert "nothing installed system-wide, no service enabled or started" in unpack
    [system] = [line for line in lines if "system-wide without recommends" in line]
    assert "prometheus-alertmanager" in system and "neither started" in system and "nor enabled" in system
    assert "extras [dev]" in proc.stdout
    assert sorted(p.name for p in root.iterdir()) == ["scripts"]


def test_without_root_or_sudo_it_stops_and_says_what_to_install(tmp_path):
    root = _checkout(tmp_path)
    proc = _setup(root, _bare_path(tmp_path, uid=1000), "--for", "tests")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "need root or sudo" in proc.stderr and "prometheus-alertmanager" in proc.stderr
    assert "apt-get install --no-install-recommends" in proc.stderr
    assert sorted(p.name for p in root.iterdir()) == ["scripts"]


def test_it_asks_what_to_set_up(tmp_path):
    root = _checkout(tmp_path)
    proc = _setup(root, os.environ["PATH"])
    assert proc.returncode == 2
    assert "--for demo (the main job) or --for tests (the test suite)" in proc.stderr
