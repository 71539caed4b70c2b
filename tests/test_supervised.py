"""The agent's background threads (``resilient.core.supervised``): an unexpected error is reported with its
traceback and the loop starts again; a loop that keeps raising is given up on, once, with a report that stops the
agent.  Then a real one: the presence thread of a node, against a real etcd, meeting a bug in one pass."""

from __future__ import annotations

import threading
import time

from resilient.coord.etcd import EtcdClient, EtcdConfig
from resilient.coord.keyspace import LaunchKeys
from resilient.coord.presence import Presence
from resilient.coord.proof import Seal
from resilient.coord.watch import PrefixWatch
from resilient.core import supervised
from resilient.core.supervised import Supervised


def test_a_loop_that_raises_is_reported_and_started_again_until_it_returns() -> None:
    runs: list[int] = []
    crashes: list[tuple[str, str, str]] = []
    fatal: list[tuple[str, str]] = []

    def loop() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise KeyError(f"bug {len(runs)}")

    t = Supervised("worker-x", loop, on_crash=lambda *a: crashes.append(a), on_fatal=lambda *a: fatal.append(a))
    t.start().join(10)
    assert not t.is_alive() and len(runs) == 3 and t.crashes == 2 and not t.gave_up
    assert [(name, error) for name, error, _ in crashes] == [("worker-x", "KeyError: 'bug 1'"),
                                                               ("worker-x", "KeyError: 'bug 2'")]
    assert "in loop" in crashes[0][2] and "raise KeyError" in crashes[0][2]
    assert fatal == []


def test_a_loop_that_keeps_raising_is_given_up_once_and_a_stop_ends_the_pause(monkeypatch) -> None:
    monkeypatch.setattr(supervised, "FIRST_PAUSE_S", 0.01)
    crashes: list[str] = []
    fatal: list[tuple[str, str]] = []

    def loop() -> None:
        raise RuntimeError("always")

    t = Supervised("broken", loop, on_crash=lambda n, e, tb: crashes.append(e), on_fatal=lambda *a: fatal.append(a))
    t.start().join(10)
    assert not t.is_alive() and t.gave_up
    assert len(crashes) == supervised.GIVE_UP_AFTER - 1
    said = f"{supervised.GIVE_UP_AFTER} errors in {supervised.GIVE_UP_WINDOW_S:g} s, the last: RuntimeError: always"
    assert fatal == [("broken", said)]
    # A stop set while the loop pauses before its restart ends the thread at once, without a restart.
    monkeypatch.setattr(supervised, "FIRST_PAUSE_S", 60.0)
    stop, started = threading.Event(), []

    def once() -> None:
        started.append(1)
        raise RuntimeError("once")

    t = Supervised("paused", once, stop=stop).start()
    time.sleep(0.2)
    stop.set()
    t.join(5)
    assert not t.is_alive() and started == [1]


def test_a_bug_in_a_presence_pass_is_reported_and_the_lease_is_still_renewed(etcd_server, etcd_run_id) -> None:
    """The presence thread of a node meets an error it does not expect in one pass (here: a judgement that
    raises once): a thread_restarted report with the traceback, and the node's key is kept alive past its
    lease's time to live (the thread went on)."""
    url = etcd_server.url
    watch = PrefixWatch(EtcdClient(EtcdConfig.from_url(url)), f"/resilient/{etcd_run_id}/launch").start()
    crashes: list[tuple[str, str, str]] = []
    presence = Presence(watch._client, LaunchKeys("l1", f"/resilient/{etcd_run_id}/"), "a", lambda n, w: None,
                        lambda e: None, watch=watch, ttl_s=2, interval_s=0.5,
                        seal=Seal("t" * 16, f"/resilient/{etcd_run_id}/"),
                        on_crash=lambda *a: crashes.append(a))
    judge, raised = presence._judge, []

    def judge_once_broken() -> None:
        if not raised and threading.current_thread().name == "presence":
            raised.append(1)
            raise ZeroDivisionError("a bug in a pass")
        judge()

    presence._judge = judge_once_broken  # type: ignore[method-assign]
    try:
        presence.start()
        deadline = time.monotonic() + 10
        while not crashes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert crashes and crashes[0][:2] == ("presence", "ZeroDivisionError: a bug in a pass"), crashes
        assert "judge_once_broken" in crashes[0][2]
        time.sleep(3.0)  # past the 2 s lease: renewed by the restarted thread, or gone
        client = EtcdClient(EtcdConfig.from_url(url))
        assert client.get(f"/resilient/{etcd_run_id}/launch/l1/nodes/a") is not None, "the lease lapsed"
        assert len(crashes) == 1
    finally:
        presence.leave()
        watch.close()
