"""Heartbeats: the datagram format, a real sender process, and the receiver's defences."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from resilient.agent.heartbeat import HeartbeatReceiver
from resilient.core.errors import ConfigError
from resilient.worker.heartbeat import RECONNECT_INTERVAL_S, HeartbeatSender
from resilient.worker.protocol import Heartbeat, HeartbeatError, decode, decode_datagram, encode

REPO = Path(__file__).resolve().parent.parent


def wait_for(condition, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


class Inbox:
    """Collects what a receiver hands over, from its thread."""

    def __init__(self) -> None:
        self.items: list[tuple[Heartbeat, float]] = []
        self._lock = threading.Lock()

    def __call__(self, hb: Heartbeat, received_at: float) -> None:
        with self._lock:
            self.items.append((hb, received_at))

    def messages(self) -> list[Heartbeat]:
        with self._lock:
            return [hb for hb, _ in self.items]


@pytest.fixture
def sock_path(tmp_path_factory):
    # pytest's tmp paths can exceed the 107-byte socket limit; use a short private dir
    d = Path(f"/tmp/rhb-{os.getpid()}-{time.monotonic_ns()}")
    d.mkdir(mode=0o700)
    yield d / "hb.sock"
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def test_encode_decode_round_trip():
    hb = Heartbeat(rank=3, local_rank=1, pid=42, section="data", step=7, seq=9, kind="hello",
                   checkpoint="s3://b/p", committed_step=5, generation=4)
    assert b'"g":4' in encode(hb) and decode(encode(hb)) == hb


def test_version_1_without_a_generation_still_decodes():
    old = b'{"v":1,"rank":0,"local_rank":0,"pid":7,"section":"step","step":3,"seq":1,"kind":"section"}'
    hb = decode(old)
    assert (hb.v, hb.generation, hb.step) == (1, None, 3)
    assert decode(encode(hb)) == hb


def test_sender_fast_path_writes_what_decode_reads(sock_path):
    inbox = Inbox()
    receiver = HeartbeatReceiver(sock_path, inbox)
    try:
        sender = HeartbeatSender(sock_path, rank=2, local_rank=0, generation=3, pid=77)
        assert sender.send("hello", 'we"ird \\ nämé', 0, checkpoint='/ck "x"')
        assert sender.send("section", "step", 12, committed_step=10)
        wait_for(lambda: len(inbox.messages()) == 2, what="two heartbeats")
    finally:
        receiver.close()
    first, second = inbox.messages()
    assert first == Heartbeat(rank=2, local_rank=0, pid=77, section='we"ird \\ nämé', step=0, seq=1, kind="hello",
                              checkpoint='/ck "x"', committed_step=None, generation=3)
    assert second == Heartbeat(rank=2, local_rank=0, pid=77, section="step", step=12, seq=2, kind="section",
                               checkpoint=None, committed_step=10, generation=3)


@pytest.mark.parametrize(
    "data, problem",
    [
        (b"\xff\xfe", "not UTF-8 JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"v": 3}', "protocol version"),
        (b'{"v": 2, "rank": 0}', r"'g' \(generation\) must be an integer"),
        (b'{"v": 1, "rank": "0"}', "'rank' must be an integer"),
        (b'{"v":1,"rank":0,"local_rank":0,"pid":1,"step":true,"seq":1}', "'step' must be an integer"),
        (b'{"v":1,"rank":0,"local_rank":0,"pid":1,"step":1,"seq":1,"kind":"ping","section":"s"}', "'kind'"),
        (b'{"v":1,"rank":0,"local_rank":0,"pid":1,"step":1,"seq":1,"kind":"bye","section":""}', "'section'"),
        (b'{"v":1,"rank":0,"local_rank":0,"pid":1,"step":1,"seq":1,"kind":"bye","section":"s","committed_step":"3"}',
         "'committed_step'"),
    ],
)
def test_decode_names_the_problem(data, problem):
    with pytest.raises(HeartbeatError, match=problem):
        decode(data)


def test_round_trip_from_a_real_sender_process(sock_path):
    """A separate process sends hello, sections and bye; the receiver stamps them with its own clock."""
    ticks = iter(range(1000, 10**6))
    inbox = Inbox()
    receiver = HeartbeatReceiver(sock_path, inbox, clock=lambda: float(next(ticks)))
    code = (
        "import os, sys, time\n"
        "from resilient.worker.heartbeat import HeartbeatSender\n"
        f"s = HeartbeatSender({str(sock_path)!r}, rank=5, local_rank=1)\n"
        "ok = [s.send('hello', 'init', 0, checkpoint='/ckpt')]\n"
        "for step in range(50):\n"
        "    ok.append(s.send('section', 'step', step, committed_step=step // 10 * 10 or None))\n"
        "    time.sleep(0.0005)\n"
        "ok.append(s.send('bye', 'step', 50, committed_step=50))\n"
        "print(os.getpid(), all(ok), s.dropped, 'torch' in sys.modules)\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, check=True).stdout.split()
        wait_for(lambda: len(inbox.messages()) == 52, what="52 heartbeats")
    finally:
        receiver.close()
    pid, all_ok, dropped, torch_loaded = int(out[0]), out[1], int(out[2]), out[3]
    assert (all_ok, dropped, torch_loaded) == ("True", 0, "False")  # the sender stays light
    msgs = inbox.messages()
    assert [m.kind for m in msgs] == ["hello"] + ["section"] * 50 + ["bye"]
    assert [m.seq for m in msgs] == list(range(1, 53))
    assert {m.pid for m in msgs} == {pid} and {m.rank for m in msgs} == {5} and {m.local_rank for m in msgs} == {1}
    assert msgs[0].checkpoint == "/ckpt" and msgs[0].section == "init"
    assert [m.step for m in msgs[1:-1]] == list(range(50))
    assert msgs[25].committed_step == 20 and msgs[-1].committed_step == 50
    stamps = [t for _, t in inbox.items]
    assert stamps == sorted(stamps) and stamps[0] >= 1000  # the injected clock, not time.monotonic
    assert receiver.received == 52 and receiver.malformed == 0


def test_malformed_datagrams_are_counted_and_dropped(sock_path):
    inbox = Inbox()
    receiver = HeartbeatReceiver(sock_path, inbox)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as raw:
            for junk in (b"not json", b'{"v": 99}', b"[]"):
                raw.sendto(junk, str(sock_path))
        HeartbeatSender(sock_path, rank=0, local_rank=0).send("section", "step", 1)
        wait_for(lambda: receiver.malformed == 3 and receiver.received == 1, what="3 malformed + 1 valid")
        assert "JSON" in (receiver.last_error or "") or "list" in (receiver.last_error or "")
    finally:
        receiver.close()
    assert [m.step for m in inbox.messages()] == [1]


def test_a_failing_callback_does_not_stop_intake(sock_path):
    seen = []

    def flaky(hb, _at):
        seen.append(hb.step)
        if hb.step == 1:
            raise RuntimeError("agent bug")

    receiver = HeartbeatReceiver(sock_path, flaky)
    try:
        sender = HeartbeatSender(sock_path, rank=0, local_rank=0)
        for step in range(3):
            sender.send("section", "step", step)
        wait_for(lambda: len(seen) == 3, what="three callbacks")
    finally:
        receiver.close()
    assert receiver.callback_errors == 1


def test_sender_never_raises_and_counts_drops(sock_path, tmp_path):
    now = [0.0]
    sender = HeartbeatSender(sock_path, rank=0, local_rank=0, clock=lambda: now[0])
    assert not sender.send("section", "step", 1)  # nobody bound the path yet
    assert "FileNotFoundError" in (sender.last_error or "")
    assert not sender.send("section", "step", 2)  # within the reconnect interval: dropped without a syscall
    assert sender.dropped == 2

    inbox = Inbox()
    receiver = HeartbeatReceiver(sock_path, inbox)
    now[0] += RECONNECT_INTERVAL_S
    assert sender.send("section", "step", 3)
    wait_for(lambda: len(inbox.messages()) == 1, what="the first heartbeat after the agent came up")
    receiver.close()  # the agent goes away: ECONNREFUSED / ENOENT, never an exception
    assert not sender.send("section", "step", 4)
    now[0] += RECONNECT_INTERVAL_S
    assert not sender.send("section", "step", 5)

    receiver = HeartbeatReceiver(sock_path, inbox)  # it comes back on the same path: found again
    now[0] += RECONNECT_INTERVAL_S
    try:
        assert sender.send("section", "step", 6)
        wait_for(lambda: len(inbox.messages()) == 2, what="a heartbeat to the rebound socket")
    finally:
        receiver.close()
    assert [m.step for m in inbox.messages()] == [3, 6] and sender.dropped == 4 and sender.sent == 2

    not_a_socket = tmp_path / "plain-file"
    not_a_socket.write_text("")
    other = HeartbeatSender(not_a_socket, rank=0, local_rank=0)
    assert not other.send("section", "step", 0) and other.dropped == 1
    sender.close()
    assert not sender.send("section", "step", 7)  # even a closed sender does not raise


def test_receiver_socket_is_private_and_paths_are_checked(sock_path, tmp_path):
    receiver = HeartbeatReceiver(sock_path, Inbox())
    try:
        mode = os.stat(sock_path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert [p.name for p in sock_path.parent.iterdir()] == ["hb.sock"]  # the temporary name is gone
    finally:
        receiver.close()
    assert not sock_path.exists()
    # a stale socket from a dead agent is replaced
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(sock_path))
    stale.close()
    HeartbeatReceiver(sock_path, Inbox()).close()
    regular = tmp_path / "regular"
    regular.write_text("x")
    with pytest.raises(ConfigError, match="not a socket"):
        HeartbeatReceiver(regular, Inbox())
    with pytest.raises(ConfigError, match="107-byte limit"):
        HeartbeatReceiver(tmp_path / ("x" * 120), Inbox())


def test_worker_side_agent_modules_do_not_import_torch():
    code = (
        "import sys, resilient.agent\n"
        "light = [m for m in sys.modules if m.startswith('resilient.agent.')]\n"
        "import resilient.worker.heartbeat, resilient.worker.env, resilient.worker.hooks\n"
        "import resilient.faults.plan, resilient.faults.inject\n"
        "print(light, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True).stdout.strip()
    assert out == "[] False"


def test_batching_sender_delivers_every_heartbeat_in_order_with_its_own_time(sock_path):
    from resilient.worker.heartbeat import BatchingSender

    inbox = Inbox()
    receiver = HeartbeatReceiver(sock_path, inbox)
    try:
        sender = BatchingSender(HeartbeatSender(sock_path, rank=1, local_rank=1, pid=99), interval_s=0.05)
        sender.send("hello", "init", 0, checkpoint="/ck")
        assert len(inbox.messages()) <= 1  # hello goes out at once ...
        wait_for(lambda: len(inbox.messages()) == 1, what="the hello")
        before = time.monotonic()
        for step in range(400):  # ... sections are queued and sent in batches (several datagrams: 150 rows each)
            sender.send("section", "step" if step % 2 else "data", step, committed_step=step // 10 * 10,
                        tokens=step * 8, samples=step, save={"step": step, "ok": True} if step == 7 else None)
        queued_at = time.monotonic()
        sender.send("bye", "step", 400, committed_step=400)  # bye flushes everything queued before it
        wait_for(lambda: len(inbox.messages()) == 402, what="402 heartbeats")
        sender.close()
    finally:
        receiver.close()
    msgs = inbox.messages()
    assert [m.seq for m in msgs] == list(range(1, 403)) and receiver.malformed == 0
    assert [m.kind for m in (msgs[0], msgs[-1])] == ["hello", "bye"]
    body = msgs[1:-1]
    assert [m.step for m in body] == list(range(400)) and body[7].save == {"step": 7, "ok": True}
    assert body[399].tokens == 399 * 8 and body[399].committed_step == 390
    stamps = [t for _, t in inbox.items[1:-1]]
    # The agent gets each event's own time (the worker's monotonic clock), not the batch's arrival.
    assert stamps == sorted(stamps) and before <= stamps[0] <= stamps[-1] <= queued_at


def test_a_section_entry_an_interval_after_the_last_send_sends_the_queue_so_it_never_spans_an_interval():
    """On a made-up clock: what a SIGKILL can lose (the queue) spans less than ``interval_s``; the entry that
    would make it span more goes out at once, with everything before it, each with its own time."""
    from resilient.worker.heartbeat import BatchingSender

    datagrams: list[bytes] = []
    inner = HeartbeatSender("/nonexistent/hb.sock", rank=0, local_rank=0, generation=1, pid=9)
    inner.send_raw = lambda text, count: datagrams.append(text.encode()) is None  # type: ignore[method-assign]
    now = [100.0]
    # Its timer never fires during the test, and no section is slow enough to go out on its own.
    sender = BatchingSender(inner, interval_s=10, clock=lambda: now[0], slow_section_s=60)

    def sent() -> list[tuple[int, float | None]]:
        return [(hb.step, hb.t) for d in datagrams for hb in decode_datagram(d)]

    sender.send("hello", "init", 0)  # at once
    for step, now[0] in ((1, 105.0), (2, 109.75)):
        sender.send("section", "step", step)
    assert sent() == [(0, 100.0)]  # queued: the last datagram left less than an interval ago
    now[0] = 110.0
    sender.send("section", "step", 3)  # an interval after it: the queue goes, in one datagram
    assert len(datagrams) == 2 and sent()[1:] == [(1, 105.0), (2, 109.75), (3, 110.0)]
    now[0] = 119.75
    sender.send("section", "step", 4)
    assert len(datagrams) == 2  # queued again, 9.75 s after the last datagram
    sender.close()
    assert sent()[-1] == (4, 119.75) and len(datagrams) == 3


def test_the_entry_that_ends_a_slow_section_goes_out_at_once_with_the_fast_ones_queued_before_it():
    """On a made-up clock: fast sections are batched, and the entry after one of ``slow_section_s`` or more
    is sent as it happens, so a rank stopped while it waits on a dead peer has reported the step it finished."""
    from resilient.worker.heartbeat import BatchingSender

    datagrams: list[bytes] = []
    inner = HeartbeatSender("/nonexistent/hb.sock", rank=0, local_rank=0, generation=1, pid=9)
    inner.send_raw = lambda text, count: datagrams.append(text.encode()) is None  # type: ignore[method-assign]
    now = [100.0]
    sender = BatchingSender(inner, interval_s=10, clock=lambda: now[0], slow_section_s=0.02)

    def sent() -> list[int]:
        return [hb.step for d in datagrams for hb in decode_datagram(d)]

    sender.send("hello", "init", 0)
    for step, now[0] in ((1, 100.001), (2, 100.011), (3, 100.0299)):  # sections of 1, 10 and 18.8 ms: queued
        sender.send("section", "step", step)
    assert sent() == [0]
    now[0] = 100.0501  # step 3's section took 20.2 ms: its end goes out at once, with the queue
    sender.send("section", "step", 4)
    assert len(datagrams) == 2 and sent() == [0, 1, 2, 3, 4]
    now[0] = 100.06
    sender.send("section", "step", 5)  # 9.9 ms: queued again
    assert len(datagrams) == 2
    sender.close()
    assert sent() == [0, 1, 2, 3, 4, 5]


def test_a_malformed_batch_is_counted_once(sock_path):
    inbox = Inbox()
    receiver = HeartbeatReceiver(sock_path, inbox)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b'{"v":1,"rank":0,"local_rank":0,"pid":1,"rows":[["section","step",1]]}', str(sock_path))
        wait_for(lambda: receiver.malformed == 1, what="the malformed batch")
    finally:
        receiver.close()
    assert "batch row" in (receiver.last_error or "") and inbox.messages() == []


def test_a_heartbeat_of_another_generation_moves_neither_the_tracker_nor_the_ledger(sock_path, tmp_path):
    """Through the real socket and the agent's own intake: only the current generation's worker counts."""
    from resilient.agent.accounting import NodeAccounting
    from resilient.agent.tracker import HeartbeatIntake, RankTracker
    from resilient.metrics.ledger import LedgerConfig

    stale: list[tuple[int, int | None, int | None]] = []
    tracker = RankTracker(on_stale=lambda hb, current: stale.append((hb.pid, hb.generation, current)))
    accounting = NodeAccounting(tmp_path / "ledger.json", LedgerConfig())
    accounting.apply("agent_started")
    accounting.generation_started(2, 1, 1, restart=True, lead_rank=0)
    tracker.start_generation({0: 4242}, time.monotonic(), generation=2)
    ledger_before = accounting.ledger.to_dict()
    receiver = HeartbeatReceiver(sock_path, HeartbeatIntake(tracker, accounting))
    try:
        old = HeartbeatSender(sock_path, rank=0, local_rank=0, generation=1, pid=4242)  # same pid, older generation
        for step in (5, 6, 7):
            assert old.send("section", "step", step, committed_step=5, tokens=100 * step, samples=step)
        v1 = HeartbeatSender(sock_path, rank=0, local_rank=0, pid=4242)
        v1.send_raw('{"v":1,"rank":0,"local_rank":0,"pid":4242,"section":"step","step":8,"seq":1,"kind":"section"}', 1)
        wait_for(lambda: receiver.received == 4, what="four stale heartbeats")
        assert tracker.stale_heartbeats == 4 and receiver.callback_errors == 0
        [rank0] = tracker.ranks().values()
        assert (rank0.section, rank0.step, rank0.heartbeats) == ("init", 0, 0)
        assert tracker.committed_step is None and tracker.max_step == 0
        assert accounting.ledger.to_dict() == ledger_before, "a stale heartbeat changed the ledger"
        assert stale == [(4242, 1, 2), (4242, None, 2)], "one report per stale (pid, generation)"

        current = HeartbeatSender(sock_path, rank=0, local_rank=0, generation=2, pid=4242)
        assert current.send("section", "step", 5, committed_step=5, tokens=500, samples=5)
        wait_for(lambda: receiver.received == 5, what="the current generation's heartbeat")
    finally:
        receiver.close()
    [rank0] = tracker.ranks().values()
    assert (rank0.section, rank0.step, rank0.heartbeats) == ("step", 5, 1)
    assert tracker.committed_step == 5 and tracker.stale_heartbeats == 4
    assert accounting.ledger.to_dict() != ledger_before


def test_a_closed_batching_sender_counts_what_it_is_still_given_as_dropped(sock_path):
    from resilient.worker.heartbeat import BatchingSender

    inbox = Inbox()
    receiver = HeartbeatReceiver(sock_path, inbox)
    try:
        sender = BatchingSender(HeartbeatSender(sock_path, rank=0, local_rank=0, pid=7), interval_s=0.05)
        sender.send("hello", "init", 0)
        sender.close()
        assert sender.send("section", "step", 1) is False  # nothing sends any more: lost, and counted
        assert (sender.sent, sender.dropped) == (1, 1)
        # The receiver takes datagrams in order: a heartbeat sent before this marker would come before it.
        assert HeartbeatSender(sock_path, rank=9, local_rank=0, pid=8).send("section", "marker", 0)
        wait_for(lambda: len(inbox.messages()) == 2, what="the marker")
        assert [(m.kind, m.section) for m in inbox.messages()] == [("hello", "init"), ("section", "marker")]
    finally:
        receiver.close()


def test_a_restore_report_travels_alone_and_reaches_the_tracker_but_not_the_ledger(sock_path, tmp_path):
    """``restored`` goes after what is queued, in a datagram of its own (an older agent drops only that one)."""
    from resilient.agent.accounting import NodeAccounting
    from resilient.agent.tracker import HeartbeatIntake, RankTracker
    from resilient.metrics.ledger import LedgerConfig
    from resilient.worker.heartbeat import BatchingSender

    tracker = RankTracker()
    accounting = NodeAccounting(tmp_path / "ledger.json", LedgerConfig())
    accounting.apply("agent_started")
    accounting.generation_started(3, 1, 1, restart=True, lead_rank=0)
    tracker.start_generation({0: os.getpid()}, time.monotonic(), generation=3)
    datagrams: list[bytes] = []
    intake = HeartbeatIntake(tracker, accounting)
    receiver = HeartbeatReceiver(sock_path, intake)
    real_send_raw = HeartbeatSender.send_raw
    try:
        inner = HeartbeatSender(sock_path, rank=0, local_rank=0, generation=3)
        inner.send_raw = lambda text, count: (datagrams.append(text.encode()), real_send_raw(inner, text, count))[1]
        sender = BatchingSender(inner, interval_s=10)  # nothing leaves on the timer during the test
        sender.send("hello", "init", 0)
        sender.send("section", "restore", 0)  # queued: the hello just left
        assert sender.send_single("restored", "init", 10, restored={"checkpoint": "step_1", "step": 1,
                                                                     "seconds": 0.5})
        wait_for(lambda: receiver.received == 3, what="hello, the queued section and the report")
        ledger_before = accounting.ledger.to_dict()
        assert sender.send_single("restored", "init", 10, restored={"checkpoint": "step_10", "step": 10,
                                                                     "seconds": 0.25})
        wait_for(lambda: receiver.received == 4, what="the second report")
        sender.close()
    finally:
        receiver.close()
    assert [b'"rows"' in d for d in datagrams] == [True, True, False, False], "a report is a datagram of its own"
    report = decode(datagrams[-1])
    assert (report.kind, report.restored, report.generation) == (
        "restored", {"checkpoint": "step_10", "step": 10, "seconds": 0.25}, 3)
    assert tracker.restores() == ((0,), {0: {"checkpoint": "step_10", "step": 10, "seconds": 0.25}})
    [rank0] = tracker.ranks().values()
    assert rank0.section == "restore", "a report is not a section entry"
    assert accounting.ledger.to_dict() == ledger_before, "the ledger never sees a restore report"


@pytest.mark.parametrize("restored, problem", [
    (None, "needs an object 'restored'"),
    ({"checkpoint": 5, "step": 1, "seconds": 0.1}, "restored.checkpoint"),
    ({"checkpoint": "a", "step": "1", "seconds": 0.1}, "restored.step"),
    ({"checkpoint": "a", "step": 1, "seconds": -1}, "restored.seconds"),
])
def test_a_malformed_restore_report_is_refused_saying_what_is_wrong(restored, problem):
    hb = Heartbeat(rank=0, local_rank=0, pid=1, section="init", step=0, seq=1, kind="restored", generation=1,
                   restored=restored)
    with pytest.raises(HeartbeatError, match=problem):
        decode(encode(hb))
    with pytest.raises(HeartbeatError, match="belongs to kind 'restored' only"):
        decode(encode(Heartbeat(rank=0, local_rank=0, pid=1, section="s", step=0, seq=1, kind="section",
                                generation=1, restored={"checkpoint": None, "step": None, "seconds": 0})))


def test_a_recovery_report_travels_alone_and_a_rejoined_sender_speaks_for_its_new_generation_and_rank():
    from resilient.worker.heartbeat import BatchingSender

    datagrams: list[bytes] = []
    inner = HeartbeatSender("/nonexistent/hb.sock", rank=1, local_rank=1, generation=3, pid=9)
    inner.send_raw = lambda text, count: datagrams.append(text.encode()) is None  # type: ignore[method-assign]
    sender = BatchingSender(inner, interval_s=10)  # nothing leaves on the timer during the test
    sender.send("hello", "init", 0)
    sender.send("section", "step", 4)  # queued: the hello just left
    sender.rejoin(4, 0)  # what was queued goes under the old header first
    assert sender.send_single("recovery", "step", 4, recovery={"event": "rejoined", "worker": "w1", "rank": 0})
    sender.send("section", "step", 5)
    sender.close()
    got = [(hb.kind, hb.step, hb.generation, hb.rank, hb.recovery) for d in datagrams for hb in decode_datagram(d)]
    assert got == [("hello", 0, 3, 1, None), ("section", 4, 3, 1, None),
                   ("recovery", 4, 4, 0, {"event": "rejoined", "worker": "w1", "rank": 0}),
                   ("section", 5, 4, 0, None)]
    assert b'"rows"' not in datagrams[2], "a recovery report is a datagram of its own (an older agent drops it alone)"


def test_datagrams_of_older_senders_still_decode_and_a_malformed_recovery_report_is_refused():
    older = b'{"v":2,"g":1,"rank":0,"local_rank":0,"pid":7,"section":"step","step":3,"seq":1,"kind":"restored",' \
            b'"restored":{"checkpoint":null,"step":null,"seconds":0.5}}'
    assert decode(older).recovery is None and decode(older).restored is not None
    batch = b'{"v":2,"g":1,"rank":0,"local_rank":0,"pid":7,"rows":[["section","step",3,1,0.5,null,0,0,null,null]]}'
    assert [hb.recovery for hb in decode_datagram(batch)] == [None]
    hb = Heartbeat(rank=0, local_rank=0, pid=1, section="init", step=0, seq=1, kind="recovery", generation=0,
                   recovery={"event": "ready", "worker": "s0", "role": "spare"})
    assert decode(encode(hb)) == hb
    for bad in (None, {"worker": "s0"}, {"event": 3}, ["ready"]):
        with pytest.raises(HeartbeatError, match="kind 'recovery' needs an object 'recovery' with a string 'event'"):
            decode(encode(Heartbeat(rank=0, local_rank=0, pid=1, section="s", step=0, seq=1, kind="recovery",
                                    generation=0, recovery=bad)))
    with pytest.raises(HeartbeatError, match="belongs to kind 'recovery' only"):
        decode(encode(Heartbeat(rank=0, local_rank=0, pid=1, section="s", step=0, seq=1, kind="section",
                                generation=0, recovery={"event": "ready"})))


def test_timing_and_audit_reports_reach_the_watch_only_from_current_workers_and_never_the_ledger(sock_path, tmp_path):
    """Both travel alone; the intake hands them on (current generation and pid only), never as section entries."""
    from resilient.agent.accounting import NodeAccounting
    from resilient.agent.tracker import HeartbeatIntake, RankTracker
    from resilient.metrics.ledger import LedgerConfig
    from resilient.worker.heartbeat import BatchingSender

    tracker = RankTracker()
    accounting = NodeAccounting(tmp_path / "ledger.json", LedgerConfig())
    accounting.apply("agent_started")
    accounting.generation_started(2, 1, 1, restart=False, lead_rank=0)
    tracker.start_generation({0: os.getpid()}, time.monotonic(), generation=2)
    reports: list[Heartbeat] = []
    receiver = HeartbeatReceiver(sock_path, HeartbeatIntake(tracker, accounting, on_report=reports.append))
    timing = {"w": 3, "n": 5, "step": 0.02, "s": {"compute": 0.015, "data": 0.003}}
    audit = {"ranks": [1], "tensors": [{"tensor": "0.weight", "ranks": [1]}], "step": 100}
    try:
        sender = BatchingSender(HeartbeatSender(sock_path, rank=0, local_rank=0, generation=2), interval_s=10)
        sender.send("section", "step", 15)
        assert sender.send_single("timing", "step", 15, timing=timing)
        assert sender.send_single("audit", "step", 100, audit=audit)
        stale = BatchingSender(HeartbeatSender(sock_path, rank=0, local_rank=0, generation=1), interval_s=10)
        assert stale.send_single("timing", "step", 15, timing=timing)  # an earlier generation's: not handed on
        wait_for(lambda: receiver.received == 4, what="the section, two reports and the stale one")
        ledger_before = accounting.ledger.to_dict()
        sender.close()
        stale.close()
    finally:
        receiver.close()
    assert [(r.kind, r.timing, r.audit) for r in reports] == [("timing", timing, None), ("audit", None, audit)]
    [rank0] = tracker.ranks().values()
    assert (rank0.section, rank0.step) == ("step", 15), "a report is not a section entry"
    assert accounting.ledger.to_dict() == ledger_before


@pytest.mark.parametrize("kind, field, value, problem", [
    ("timing", "timing", {"n": 5, "s": {}}, "kind 'timing' needs an object 'timing' with integers w, n"),
    ("timing", "timing", {"w": 1, "n": 5, "s": []}, "an object s"),
    ("audit", "audit", {"tensors": []}, "kind 'audit' needs an object 'audit' with a list 'ranks'"),
    ("section", "timing", {"w": 1, "n": 5, "s": {}}, "field 'timing' belongs to kind 'timing' only"),
    ("section", "audit", {"ranks": []}, "field 'audit' belongs to kind 'audit' only"),
])
def test_a_malformed_timing_or_audit_report_is_refused_saying_what_is_wrong(kind, field, value, problem):
    hb = Heartbeat(rank=0, local_rank=0, pid=1, section="step", step=0, seq=1, kind=kind, generation=1,
                   **{field: value})
    with pytest.raises(HeartbeatError, match=problem):
        decode(encode(hb))


def test_settling_hands_on_every_heartbeat_queued_before_it(sock_path):
    """A worker's last heartbeats sit in the socket's queue when the agent sees it exit; the receiver's thread
    may not have read them yet.  settle() returns only once everything queued before it was handed on."""
    gate = threading.Event()
    inbox = Inbox()

    def slow(hb: Heartbeat, at: float) -> None:
        gate.wait(5)  # the receiver's thread is held up, as a loaded machine would
        inbox(hb, at)

    receiver = HeartbeatReceiver(sock_path, slow)
    try:
        sender = HeartbeatSender(sock_path, rank=0, local_rank=0)
        for step in range(5):  # fewer than the socket queues (a full queue drops at the sender, by design)
            sender.send("section", "step", step)
        sender.close()
        assert sender.dropped == 0 and len(inbox.messages()) == 0  # the thread waits at the first one
        threading.Timer(0.2, gate.set).start()
        assert receiver.settle(timeout=10)
        assert [hb.step for hb in inbox.messages()] == list(range(5)), "all of it, in order, when settle returns"
    finally:
        gate.set()
        receiver.close()
    assert receiver.malformed == 0, "the marker is never taken for a heartbeat"
    assert not receiver.settle(timeout=0.2), "a closed receiver settles nothing"
