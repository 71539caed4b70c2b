"""Fixtures shared by the suite: real servers and checkpoint locations."""

from __future__ import annotations

import pytest

from .etcd_server import etcd_auth_outage_server, etcd_auth_server, etcd_outage_server, etcd_run_id, etcd_server, etcd_tls_server  # noqa: F401
from .invariants import check_event_logs
from .prometheus_server import alertmanager, prometheus, webhook  # noqa: F401  (fixtures)
from .s3_server import moto_server, s3_url  # noqa: F401  (fixtures)
from .stores import LocalStore, S3Store


@pytest.fixture(autouse=True)
def recovery_invariants(request):
    """After each test: every event log its runs left in its temporary directory keeps the recovery invariants
    (``tests/invariants.py``): one decision per generation, each rank one worker, each worker one place."""
    # Taken before the test, so that the directory is still there at this fixture's teardown.
    tmp = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if tmp is not None:
        problems = check_event_logs(tmp)
        assert not problems, "the runs of this test broke a recovery invariant:\n" + "\n".join(problems)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """An empty checkpoint location on each backend, with raw access for tampering."""
    if request.param == "local":
        return LocalStore(tmp_path / "ckpt")
    url, endpoint = request.getfixturevalue("s3_url")
    return S3Store(url, endpoint)


# The longest files, started first when tests run two at a time (scripts/test.sh): a long file taken last would
# leave one process working alone at the end.  Order only; every test runs either way.
LONGEST_FIRST = ("test_sharded.py", "test_deploy_compose.py", "test_torch_next.py", "test_agent_inproc.py",
                 "test_deploy_slurm.py", "test_crash_consistency.py", "test_agent.py", "test_step_atomicity.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_sessionfinish(session, exitstatus):
    """Remove the memory tiers of this session's agents that a test killed (an agent removes its own only when
    its run ends): they live in /dev/shm, outside the test's temporary directory."""
    import json
    import shutil
    from pathlib import Path

    from resilient.agent.memory_tier import OWNER, PREFIX

    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None:
        return
    base = str(factory.getbasetemp().resolve())
    for tier in Path("/dev/shm").glob(PREFIX + "*") if Path("/dev/shm").is_dir() else ():
        try:
            run_dir = json.loads((tier / OWNER).read_text())["run_dir"]
        except (OSError, ValueError, KeyError):
            continue
        if run_dir.startswith(base + "/"):
            shutil.rmtree(tier, ignore_errors=True)
