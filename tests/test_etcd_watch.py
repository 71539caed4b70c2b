"""A prefix followed by an etcd watch (``resilient.coord.watch``) against a real etcd.

What the agents rely on once they stop polling: the copy matches the store
after every change, a transaction's writes appear together, no change is
lost when the stream is reopened or broken, a compacted revision is read
again, an outage leaves the copy stale and says so, and closing ends the
watch at once.
"""

from __future__ import annotations

import threading
import time

import pytest

from resilient.coord.etcd import EtcdClient, EtcdConfig
from resilient.coord.txn import Put, Txn
from resilient.coord.watch import PrefixWatch


class Changes:
    """Every view the watch published, and a way to wait for one that satisfies a condition."""

    def __init__(self) -> None:
        self.views: list[dict[str, bytes]] = []
        self.cond = threading.Condition()
        self.watch: PrefixWatch | None = None

    def __call__(self) -> None:
        assert self.watch is not None
        with self.cond:
            self.views.append({k: e.value for k, e in self.watch.view().entries.items()})
            self.cond.notify_all()

    def wait_for(self, ok, timeout_s: float = 30.0) -> dict[str, bytes]:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                assert self.watch is not None
                now = {k: e.value for k, e in self.watch.view().entries.items()}
                if ok(now):
                    return now
                left = deadline - time.monotonic()
                assert left > 0, f"the watch never showed it; last view: {now}"
                self.cond.wait(left)


def _watch(client: EtcdClient, prefix: str, **options) -> tuple[PrefixWatch, Changes]:
    changes = Changes()
    watch = PrefixWatch(client, prefix, on_change=changes, **options)
    changes.watch = watch
    return watch.start(), changes


def test_the_copy_follows_every_put_and_delete_and_a_transaction_shows_whole(etcd_server, etcd_run_id) -> None:
    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    base = f"/resilient/{etcd_run_id}/"
    client.put(base + "a", b"1")
    client.put(base + "other-prefix-not-watched", b"x")
    watch, changes = _watch(client, base + "w/")
    try:
        assert watch.view().entries == {}
        client.put(base + "w/a", b"1")
        client.put(base + "w/b", b"2")
        client.delete(base + "w/a")
        client.txn(Txn((), (Put(base + "w/c", b"3"), Put(base + "w/d", b"4"))))
        final = changes.wait_for(lambda v: set(v) == {base + "w/b", base + "w/c", base + "w/d"})
        assert final[base + "w/b"] == b"2"
        assert all((base + "w/c" in v) == (base + "w/d" in v) for v in changes.views), \
            "a view showed half of a transaction"
        assert watch.view().revision == client.snapshot_prefix(base)[1], "the copy is not at the store's revision"
    finally:
        watch.close()


def test_no_change_is_lost_across_reopened_streams(etcd_server, etcd_run_id) -> None:
    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    base = f"/resilient/{etcd_run_id}/w/"
    watch, changes = _watch(client, base, idle_s=0.2)  # reopened after every 0.2 s of silence
    try:
        for i in range(30):
            client.put(f"{base}k{i % 7}", str(i).encode())
            if i % 5 == 0:
                time.sleep(0.3)  # a silence: the stream is closed and opened again from its revision
        expected = {f"{base}k{j}": str(max(i for i in range(30) if i % 7 == j)).encode() for j in range(7)}
        assert changes.wait_for(lambda v: v == expected) == expected
        assert watch.streams > 1, "the stream was never reopened"
    finally:
        watch.close()


class HeldClient:
    """A real client whose first watch waits until the test lets it open (so the test can compact first)."""

    def __init__(self, client: EtcdClient) -> None:
        self.client = client
        self.go = threading.Event()

    def watch_prefix(self, *args, **kwargs):
        assert self.go.wait(30)
        return self.client.watch_prefix(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_a_compacted_revision_is_read_again(etcd_server, etcd_run_id) -> None:
    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    base = f"/resilient/{etcd_run_id}/w/"
    client.put(base + "gone", b"0")
    held = HeldClient(client)
    watch, changes = _watch(held, base)  # type: ignore[arg-type]
    try:
        client.delete(base + "gone")
        revision = client.put(base + "new", b"1")
        client.call("/v3/kv/compaction", {"revision": str(revision)})
        held.go.set()
        assert changes.wait_for(lambda v: v == {base + "new": b"1"}) == {base + "new": b"1"}
        client.put(base + "after", b"2")
        changes.wait_for(lambda v: base + "after" in v)
    finally:
        watch.close()


@pytest.mark.timeout(120)
def test_an_outage_leaves_the_copy_stale_and_says_so_then_it_catches_up(etcd_outage_server) -> None:
    client = EtcdClient(EtcdConfig.from_url(etcd_outage_server.url, outage_tolerance_s=0.5))
    errors: list[str] = []
    watch, changes = _watch(client, "/w/", on_error=errors.append, idle_s=1.0)
    try:
        client.put("/w/a", b"1")
        changes.wait_for(lambda v: v == {"/w/a": b"1"})
        etcd_outage_server.stop()
        deadline = time.monotonic() + 30
        while watch.stale_since is None:
            assert time.monotonic() < deadline, "the outage was never noticed"
            time.sleep(0.05)
        assert watch.view().entries.keys() == {"/w/a"}, "the copy changed while the store was away"
        assert len(errors) == 1 and "/w/" in errors[0], errors
        etcd_outage_server.start()
        client.put("/w/b", b"2")
        changes.wait_for(lambda v: v == {"/w/a": b"1", "/w/b": b"2"})
        deadline = time.monotonic() + 30
        while watch.stale_since is not None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        watch.close()


def test_a_watch_with_auth_logs_in_again_after_an_outage_that_outlived_its_token(etcd_auth_outage_server) -> None:
    """Auth on, etcd down longer than the token lives (and a restart ends every token anyway): the stream's new
    login fails while etcd is away, which is an outage like any other, and the watch catches up once it is back."""
    from .etcd_server import ROOT_PASSWORD

    client = EtcdClient(EtcdConfig.from_url(etcd_auth_outage_server.url, username="root", password=ROOT_PASSWORD,
                                            outage_tolerance_s=0.5))
    errors: list[str] = []
    watch, changes = _watch(client, "/w/", on_error=errors.append, idle_s=1.0)
    try:
        client.put("/w/a", b"1")
        changes.wait_for(lambda v: v == {"/w/a": b"1"})
        etcd_auth_outage_server.stop()
        # The token is gone as when etcd rejects it (its 2 s are over, a restart ends every token): the stream's
        # next try logs in first, while etcd is away.
        client._token = None
        time.sleep(2.0)
        assert watch.running, "the watch's thread ended during the outage"
        assert watch.stale_since is not None and len(errors) == 1, errors
        assert watch.crashes == 0, "a login that finds etcd away is an outage, not an unexpected error"
        etcd_auth_outage_server.start()
        client.put("/w/b", b"2")
        changes.wait_for(lambda v: v == {"/w/a": b"1", "/w/b": b"2"})
        assert watch.running and watch.crashes == 0
    finally:
        watch.close()


def test_an_unexpected_error_on_the_watch_thread_is_reported_and_the_watch_reads_again_and_goes_on(
        etcd_server, etcd_run_id) -> None:
    """An error the watch did not expect in its own work (here applying a batch, once) does not end it:
    ``on_crash`` gets the error and its traceback, the prefix is read again and every listener told, and later
    changes still arrive."""
    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    base = f"/resilient/{etcd_run_id}/"
    crashes: list[tuple[str, str]] = []
    calls = []
    watch, changes = _watch(client, base, on_crash=lambda e, t: crashes.append((e, t)))
    watch.subscribe(lambda: calls.append(dict(watch.view().entries)))
    apply = watch._apply

    def broken_once(events):
        watch._apply = apply
        raise KeyError("a bug applying a batch")

    watch._apply = broken_once
    try:
        client.put(base + "a", b"1")
        deadline = time.monotonic() + 30
        while not calls:  # the crash, then the read again that tells every listener
            assert time.monotonic() < deadline, (calls, crashes)
            time.sleep(0.02)
        assert base + "a" in calls[0]
        client.put(base + "b", b"2")
        changes.wait_for(lambda v: v == {base + "a": b"1", base + "b": b"2"})
        assert watch.running and watch.crashes == 1
        [(error, trace)] = crashes
        assert "KeyError: 'a bug applying a batch'" in error and base in error
        assert "in broken_once" in trace, trace
    finally:
        watch.close()


def test_a_listener_that_raises_is_reported_once_and_the_others_are_still_told(etcd_server, etcd_run_id) -> None:
    """A listener's bug is the listener's: reported once (with its traceback), counted each time, while the
    other listeners hear every change and the watch follows on without reading its keys again (before, each
    raise read the whole prefix again and told every listener, which raised again: a loop without end)."""
    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    base = f"/resilient/{etcd_run_id}/"
    crashes: list[tuple[str, str]] = []

    def buggy() -> None:
        raise KeyError("a bug in a listener")

    watch, changes = _watch(client, base, on_crash=lambda e, t: crashes.append((e, t)))
    watch.subscribe(buggy)
    try:
        for i in range(5):  # one at a time: a batch each
            client.put(base + f"k{i}", b"v")
            changes.wait_for(lambda v, n=i + 1: len(v) == n)
        deadline = time.monotonic() + 10
        while watch.listener_errors < 5:
            assert time.monotonic() < deadline, watch.listener_errors
            time.sleep(0.02)
        assert watch.running and watch.crashes == 0 and watch.streams == 1, "no read again, no stream again"
        [(error, trace)] = crashes
        assert "listener" in error and "buggy" in error and "KeyError: 'a bug in a listener'" in error
        assert "in buggy" in trace, trace
    finally:
        watch.close()


@pytest.mark.timeout(60)
def test_closing_ends_a_silent_stream_at_once(etcd_server, etcd_run_id) -> None:
    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    watch, _ = _watch(client, f"/resilient/{etcd_run_id}/w/", idle_s=3600.0)
    time.sleep(0.2)  # the stream is open and silent
    watch.close()  # waits for its thread up to idle_s: an hour, unless closing shuts the stream
    assert not watch.running


def test_a_reader_of_some_keys_is_woken_by_their_changes_only(etcd_server, etcd_run_id) -> None:
    """A subscriber ``under`` some prefixes hears a change of a key there, never one elsewhere in the watch
    (what keeps a large launch's agents from judging presence on every write of every node); the view read after
    either change shows it."""
    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    base = f"/resilient/{etcd_run_id}/launch/"
    watch, changes = _watch(client, base)
    woken: list[int] = []
    watch.subscribe(lambda: woken.append(watch.view().revision), under=(base + "nodes/", base + "suspect/"))
    try:
        client.put(base + "rec/g1/node/n0", b"r")
        changes.wait_for(lambda v: base + "rec/g1/node/n0" in v)
        assert woken == [], "woken by a key it does not read"
        client.put(base + "suspect/n1/n0", b"s")
        changes.wait_for(lambda v: base + "suspect/n1/n0" in v)
        client.put(base + "timing-like-other", b"t")
        client.put(base + "nodes/n2", b"n")
        changes.wait_for(lambda v: base + "nodes/n2" in v)
        deadline = time.monotonic() + 10
        while len(woken) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(woken) == 2, woken
        assert woken[0] < woken[1] == watch.view().revision
    finally:
        watch.close()


def test_an_idle_watch_keeps_one_stream_with_tcp_keepalive_and_sends_no_request(etcd_server, etcd_run_id) -> None:
    """At rest a watch costs etcd nothing: its one stream stays open past 6 s of silence (it used to be opened
    again every 5 s), its socket probing the peer with TCP keepalive instead, and a change still arrives."""
    import socket

    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    base = f"/resilient/{etcd_run_id}/idle/"
    watch, changes = _watch(client, base)
    try:
        time.sleep(6.5)
        assert watch.streams == 1, f"the idle watch opened {watch.streams} streams in 6.5 s"
        sock = watch._socket
        assert sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 3
        client.put(base + "k", b"1")
        changes.wait_for(lambda v: v == {base + "k": b"1"})
        assert watch.streams == 1
    finally:
        watch.close()
