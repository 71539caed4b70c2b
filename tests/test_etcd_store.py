"""The ControlStore protocol, run on both implementations (in-memory and real etcd), and CAS under contention."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from resilient.coord.etcd import EtcdClient, EtcdConfig, EtcdControlStore
from resilient.coord.keyspace import run_root
from resilient.coord.store import (
    ControlStore,
    MemoryControlStore,
    StoreRequestError,
)
from resilient.core.errors import ConfigError

from .etcd_server import EtcdServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["memory", "etcd"])
def control_store(request: pytest.FixtureRequest) -> Iterator[ControlStore]:
    """An empty store of each kind."""
    if request.param == "memory":
        yield MemoryControlStore()
        return
    server: EtcdServer = request.getfixturevalue("etcd_server")
    client = EtcdClient(EtcdConfig.from_url(server.url, outage_tolerance_s=5.0))
    yield EtcdControlStore.for_run(client, request.getfixturevalue("etcd_run_id"))


def increment(store: ControlStore, key: str, times: int) -> int:
    """Add 1 to ``key`` ``times`` times with an explicit get/compare_and_swap loop; returns the conflicts seen."""
    conflicts = 0
    for _ in range(times):
        entry = store.get(key)
        while True:
            value = int(entry.value) if entry else 0
            ok, seen = store.compare_and_swap(key, entry.mod_revision if entry else 0, str(value + 1).encode())
            if ok:
                break
            conflicts += 1
            entry = seen
    return conflicts


def test_put_get_track_revisions(control_store: ControlStore) -> None:
    assert control_store.get("a") is None
    rev1 = control_store.put("a", b"one")
    first = control_store.get("a")
    assert first is not None
    assert (first.key, first.value, first.mod_revision, first.create_revision, first.version) == (
        "a",
        b"one",
        rev1,
        rev1,
        1,
    )
    rev2 = control_store.put("a", b"two")
    second = control_store.get("a")
    assert second is not None and rev2 > rev1
    assert (second.value, second.mod_revision, second.create_revision, second.version) == (b"two", rev2, rev1, 2)


def test_values_are_bytes_exactly(control_store: ControlStore) -> None:
    every_byte = bytes(range(256)) * 3
    control_store.put("bin", every_byte)
    control_store.put("empty", b"")
    control_store.put("unicode key ✓", b"x")
    assert control_store.get("bin").value == every_byte  # type: ignore[union-attr]
    assert control_store.get("empty").value == b""  # type: ignore[union-attr]
    assert control_store.get("unicode key ✓").value == b"x"  # type: ignore[union-attr]


def test_put_if_absent_creates_once(control_store: ControlStore) -> None:
    ok, entry = control_store.put_if_absent("k", b"first")
    assert ok and entry.value == b"first" and entry.create_revision == entry.mod_revision > 0
    ok2, existing = control_store.put_if_absent("k", b"second")
    assert not ok2 and existing == entry
    assert control_store.get("k") == entry


def test_compare_and_swap_fences_on_mod_revision(control_store: ControlStore) -> None:
    assert control_store.compare_and_swap("k", 7, b"x") == (False, None)  # absent key has revision 0
    ok, created = control_store.compare_and_swap("k", 0, b"v1")
    assert ok and created is not None and created.value == b"v1"
    ok, stale = control_store.compare_and_swap("k", 0, b"again")  # 0 means "absent": it is not
    assert not ok and stale == created
    ok, updated = control_store.compare_and_swap("k", created.mod_revision, b"v2")
    assert ok and updated is not None and updated.mod_revision > created.mod_revision
    ok, current = control_store.compare_and_swap("k", created.mod_revision, b"lost")  # stale token
    assert not ok and current == updated
    assert control_store.get("k").value == b"v2"  # type: ignore[union-attr]


def test_delete_then_recreate(control_store: ControlStore) -> None:
    control_store.put("k", b"v")
    old = control_store.get("k")
    assert control_store.delete("k") is True
    assert control_store.delete("k") is False
    assert control_store.get("k") is None
    ok, new = control_store.put_if_absent("k", b"w")
    assert ok and old is not None and new.create_revision > old.create_revision and new.version == 1


def test_get_prefix_is_sorted_and_scoped(control_store: ControlStore) -> None:
    for key in ("nodes/b", "nodes/a", "nodes/c", "nodesX", "other"):
        control_store.put(key, key.encode())
    assert [e.key for e in control_store.get_prefix("nodes/")] == ["nodes/a", "nodes/b", "nodes/c"]
    assert [e.value for e in control_store.get_prefix("nodes/")] == [b"nodes/a", b"nodes/b", b"nodes/c"]
    assert control_store.get_prefix("missing/") == []


def test_add_counts_from_zero(control_store: ControlStore) -> None:
    assert control_store.add("restarts", 1) == 1
    assert control_store.add("restarts", 5) == 6
    assert control_store.add("restarts", -2) == 4
    assert control_store.get("restarts").value == b"4"  # type: ignore[union-attr]
    control_store.put("text", b"not a number")
    with pytest.raises(StoreRequestError, match="not a decimal integer"):
        control_store.add("text", 1)


def test_concurrent_compare_and_swap_loses_no_update(control_store: ControlStore) -> None:
    threads, times = 8, 50
    conflicts: list[int] = []
    start = threading.Barrier(threads)

    def worker() -> None:
        start.wait()
        conflicts.append(increment(control_store, "counter", times))

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=50)
    assert len(conflicts) == threads
    assert control_store.get("counter").value == str(threads * times).encode()  # type: ignore[union-attr]


def test_concurrent_add_loses_no_update(control_store: ControlStore) -> None:
    pool = [threading.Thread(target=lambda: [control_store.add("n", 2) for _ in range(25)]) for _ in range(6)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=50)
    assert control_store.get("n").value == b"300"  # type: ignore[union-attr]


_PROCESS_WRITER = """
import sys
from resilient.coord.etcd import EtcdClient, EtcdConfig
from resilient.coord.etcd import EtcdControlStore
from tests.test_etcd_store import increment
store = EtcdControlStore.for_run(EtcdClient(EtcdConfig.from_url(sys.argv[1])), sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()
print(increment(store, "counter", int(sys.argv[3])), flush=True)
"""


def test_threads_and_processes_share_one_counter_without_lost_updates(
    etcd_server: EtcdServer, etcd_run_id: str
) -> None:
    threads, processes, times = 8, 2, 50
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PROCESS_WRITER, etcd_server.url, etcd_run_id, str(times)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        store = EtcdControlStore.for_run(EtcdClient(EtcdConfig.from_url(etcd_server.url)), etcd_run_id)
        conflicts: list[int] = []
        go = threading.Event()

        def worker() -> None:
            go.wait()
            conflicts.append(increment(store, "counter", times))

        pool = [threading.Thread(target=worker) for _ in range(threads)]
        for t in pool:
            t.start()
        for p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        go.set()
        for t in pool:
            t.join(timeout=50)
        outs = [p.communicate(timeout=50)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * processes
    conflicts += [int(out.strip()) for out in outs]
    assert store.get("counter").value == str((threads + processes) * times).encode()  # type: ignore[union-attr]
    assert sum(conflicts) > 0, "the writers never collided: the test did not exercise compare-and-swap"


def test_run_root_rejects_escaping_ids() -> None:
    assert run_root("exp42") == "/resilient/exp42/"
    for bad in ("", "a/b", ".."):
        with pytest.raises(ConfigError, match="run id"):
            run_root(bad)


def test_runs_do_not_see_each_other(etcd_server: EtcdServer) -> None:
    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    a = EtcdControlStore.for_run(client, "iso-a")
    b = EtcdControlStore.for_run(client, "iso-ab")
    a.put("k", b"a")
    b.put("k", b"b")
    assert [e.value for e in a.get_prefix("")] == [b"a"]
    assert client.get("/resilient/iso-ab/k").value == b"b"  # type: ignore[union-attr]
    client.delete_prefix("/resilient/iso-a")
    assert client.get_prefix("/resilient/iso-a") == []
