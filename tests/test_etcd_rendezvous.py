"""torch elastic over etcd v3: the RendezvousBackend contract, the c10d Store, and real handlers forming a round."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from resilient.coord.etcd import EtcdClient, EtcdConfig
from resilient.coord.etcd_store import make_etcd_c10d_store
from resilient.coord.rendezvous import create_etcd_rendezvous_handler, make_etcd_rendezvous_backend

from .etcd_server import EtcdServer, _free_port

pytestmark = pytest.mark.timeout(90)


def client_for(server: EtcdServer, **options: Any) -> EtcdClient:
    return EtcdClient(EtcdConfig.from_url(server.url, **options))


def test_importing_coord_does_not_import_torch() -> None:
    code = (
        "import sys, resilient.coord, resilient.coord.rendezvous, resilient.coord.etcd_store, resilient.coord.etcd\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_backend_follows_torch_token_semantics(etcd_server: EtcdServer, etcd_run_id: str) -> None:
    backend = make_etcd_rendezvous_backend(client_for(etcd_server), etcd_run_id)
    assert backend.name == "resilient-etcd-v3"
    assert backend.get_state() is None
    state1, token1, ok = backend.set_state(b"s1")  # type: ignore[misc]
    assert (state1, ok) == (b"s1", True)
    assert backend.set_state(b"other") == (b"s1", token1, False)  # None token: only when absent
    state2, token2, ok = backend.set_state(b"s2", token1)  # type: ignore[misc]
    assert (state2, ok) == (b"s2", True) and token2 != token1
    assert backend.set_state(b"stale", token1) == (b"s2", token2, False)  # stale token: current state back
    assert backend.set_state(b"junk", "not-a-token") == (b"s2", token2, False)
    assert backend.get_state() == (b"s2", token2)


def test_backend_concurrent_writers_lose_no_update(etcd_server: EtcdServer, etcd_run_id: str) -> None:
    """Each writer appends its name to a JSON list through set_state; every append must survive."""
    client = client_for(etcd_server)
    writers, appends = 6, 20

    def writer(name: str) -> None:
        backend = make_etcd_rendezvous_backend(client, etcd_run_id)
        current = backend.get_state()
        for i in range(appends):
            while True:
                items = json.loads(current[0]) if current else []
                answer = backend.set_state(
                    json.dumps([*items, f"{name}-{i}"]).encode(), current[1] if current else None
                )
                assert answer is not None
                current = (answer[0], answer[1])
                if answer[2]:
                    break

    pool = [threading.Thread(target=writer, args=(f"w{n}",)) for n in range(writers)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=60)
    final = make_etcd_rendezvous_backend(client, etcd_run_id).get_state()
    assert final is not None
    items = json.loads(final[0])
    assert len(items) == writers * appends and len(set(items)) == writers * appends


def test_backend_ttl_lets_the_state_expire(etcd_server: EtcdServer, etcd_run_id: str) -> None:
    from resilient.coord.rendezvous import EtcdRendezvousBackend

    backend = EtcdRendezvousBackend(client_for(etcd_server), etcd_run_id, ttl_s=2)
    backend.set_state(b"short-lived")
    assert backend.get_state() is not None
    deadline = time.monotonic() + 60  # a hang guard: etcd expires the lease when it will, this only bounds a hang
    while backend.get_state() is not None:
        assert time.monotonic() < deadline, "the state outlived its 2 s lease by a minute"
        time.sleep(0.2)


def test_backend_unreachable_raises_rendezvous_connection_error() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    client = EtcdClient(EtcdConfig.from_url(f"etcd://127.0.0.1:{_free_port()}", outage_tolerance_s=0.3))
    backend = make_etcd_rendezvous_backend(client, "nowhere")
    with pytest.raises(RendezvousConnectionError, match="unreachable"):
        backend.get_state()
    with pytest.raises(RendezvousConnectionError, match="unreachable"):
        backend.set_state(b"x", None)


class SleepClock:
    """A clock that only the store's own sleeps move, recording them; ``then(at, action)`` runs ``action`` from the
    sleep that carries the clock to ``at`` (another writer, acting while the store waits)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self._due: list[tuple[float, Any]] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        for item in [d for d in self._due if d[0] <= self.now]:
            self._due.remove(item)
            item[1]()

    def then(self, at: float, action: Any) -> None:
        self._due.append((at, action))

    def restart(self) -> None:
        self.now, self.sleeps = 0.0, []


BACKOFF = [0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.1]
"""The store's polls: 5 ms doubling to at most 100 ms."""


def test_c10d_store_semantics(etcd_server: EtcdServer, etcd_run_id: str) -> None:
    import torch.distributed as dist

    prefix, clock = f"/resilient/{etcd_run_id}/c10d/", SleepClock()
    store: Any = make_etcd_c10d_store(client_for(etcd_server), prefix, timedelta(seconds=5), clock=clock,
                                      sleep=clock.sleep)
    store.set("a", "text")
    store.set("b", b"\x00\xffbytes")
    assert store.get("a") == b"text" and store.get("b") == b"\x00\xffbytes"
    assert store.add("n", 3) == 3 and store.add("n", 4) == 7 and store.get("n") == b"7"
    assert store.compare_set("c", "", "first") == b"first"  # missing + empty expected: set
    assert store.compare_set("d", "x", "y") == b"x" and not store.check(["d"])  # missing + expected: untouched
    assert store.compare_set("c", "first", "second") == b"second"
    assert store.compare_set("c", "wrong", "third") == b"second"
    assert store.check(["a", "b"]) and not store.check(["a", "missing"])
    assert store.num_keys() == 4
    assert store.delete_key("a") is True and store.delete_key("a") is False
    store.multi_set(["m1", "m2"], ["1", "2"])
    assert store.multi_get(["m1", "m2"]) == [b"1", b"2"]

    assert clock.sleeps == [], "keys that exist are never waited for"

    other = make_etcd_c10d_store(client_for(etcd_server), prefix)
    clock.then(0.3, lambda: other.set("late", "here"))
    assert store.get("late") == b"here"  # blocks until another writer sets it ...
    assert clock.sleeps == BACKOFF and clock.now == pytest.approx(0.355)  # ... and sees it at the next poll

    store.set_timeout(timedelta(seconds=0.5))
    clock.restart()
    with pytest.raises(dist.DistStoreError, match="wait timeout after 500ms.*never"):
        store.get("never")
    assert clock.now == pytest.approx(0.5) and clock.sleeps[:7] == BACKOFF  # the store's timeout, exactly
    clock.restart()
    with pytest.raises(dist.DistStoreError, match="wait timeout after 300ms.*never"):
        store.wait(["m1", "never"], timedelta(seconds=0.3))
    assert clock.now == pytest.approx(0.3)  # the call's own timeout, not the store's
    clock.restart()
    store.wait(["m1", "m2"])
    assert clock.sleeps == []


def test_c10d_store_through_prefix_store(etcd_server: EtcdServer, etcd_run_id: str) -> None:
    """The handler wraps our store in a PrefixStore: calls must reach our methods through C++."""
    import torch.distributed as dist

    base = make_etcd_c10d_store(client_for(etcd_server), f"/resilient/{etcd_run_id}/c10d/", timedelta(seconds=2))
    store = dist.PrefixStore("torch.rendezvous.r.0", base)
    store.set("MASTER_ADDR", "127.0.0.1")
    assert store.get("MASTER_ADDR") == b"127.0.0.1"
    assert store.add("count", 2) == 2
    assert base.get("torch.rendezvous.r.0/MASTER_ADDR") == b"127.0.0.1"
    store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError):
        store.get("absent")


def test_three_handlers_form_one_round(etcd_server: EtcdServer, etcd_run_id: str) -> None:
    config = EtcdConfig.from_url(etcd_server.url)
    nodes = 3
    results: dict[int, tuple[int, int, str, int]] = {}
    errors: list[BaseException] = []
    handlers = [
        create_etcd_rendezvous_handler(
            config,
            etcd_run_id,
            min_nodes=nodes,
            max_nodes=nodes,
            local_addr="127.0.0.1",
            join_timeout_s=30,
            last_call_s=1,
            close_s=5,
            keep_alive_interval_s=1,
            keep_alive_max_attempt=3,
            store_timeout_s=20,
        )
        for _ in range(nodes)
    ]

    def join(i: int) -> None:
        try:
            info = handlers[i].next_rendezvous()
            store_info = info.bootstrap_store_info
            assert store_info is not None
            results[i] = (info.rank, info.world_size, store_info.master_addr, store_info.master_port)
        except Exception as e:  # noqa: BLE001  surfaced by the assertions below
            errors.append(e)

    pool = [threading.Thread(target=join, args=(i,)) for i in range(nodes)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=45)
    try:
        assert errors == []
        assert sorted(r[0] for r in results.values()) == [0, 1, 2]
        assert {r[1] for r in results.values()} == {3}
        assert len({(r[2], r[3]) for r in results.values()}) == 1  # everyone got rank 0's master address
        state = make_etcd_rendezvous_backend(client_for(etcd_server), etcd_run_id).get_state()
        assert state is not None  # the round lives in etcd, under our key
    finally:
        for h in handlers:
            h.shutdown()
