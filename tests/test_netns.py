"""The drills' network between nodes: real namespaces, veth pairs and a bridge; real packets cut and dropped.

Two "nodes" get namespaces of their own; a TCP server in one answers a client in the other and one on the
bridge's address in the runner's namespace.  A partition stops every packet (no reset: a connect times out)
and mending brings it back; a drop rule on arrival loses a share of datagrams, counted by iptables; teardown leaves no
namespace and no link, asserted.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient.chaos.netns import Network, unavailable

pytestmark = pytest.mark.timeout(120)

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(8); print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept(); c.sendall(b"hi"); c.close()
"""

CLIENT = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])); print(c.recv(2).decode())
except OSError as e:
    print(type(e).__name__)
"""

ECHO_LOSS = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
got = set()
sent = {}  # datagram -> when it was sent
def take(timeout):
    # Replies as they come: a late one still counts (no per-datagram deadline), only a lost one does not.
    s.settimeout(timeout)
    try:
        while True:
            got.add(int(s.recv(8)))
    except OSError:
        pass
for i in range(300):
    # At most 32 in flight (sent in the last second, unanswered): an echo server that is not scheduled for a while
    # would otherwise overflow its socket buffer (256 datagrams here) and lose what no rule dropped.
    while sum(1 for j, t in sent.items() if j not in got and time.monotonic() - t < 1.0) >= 32:
        take(0.05)
    s.sendto(str(i).encode(), (sys.argv[1], int(sys.argv[2])))
    sent[i] = time.monotonic()
    take(0.0)
take(2.0)  # the last replies, until 2 s pass with none
print(len(got))
"""

UDP_ECHO = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)
while True:
    data, peer = s.recvfrom(8); s.sendto(data, peer)
"""


def _in(net: Network, node: str, code: str, *args: str) -> str:
    done = subprocess.run(net.wrap(node, [sys.executable, "-c", code, *args]), capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _serve(net: Network, node: str, code: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(net.wrap(node, [sys.executable, "-c", code, net.addresses[node]]), stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def test_nodes_reach_each_other_until_cut_lose_packets_when_told_and_leave_nothing_behind():
    assert unavailable(packet_loss=True) is None, unavailable(packet_loss=True)  # root, ip and iptables: set up
    net = Network(["n0", "n1"])
    servers = []
    try:
        assert net.addresses["n0"] != net.addresses["n1"] and net.host_ip.endswith(".1")
        tcp, port = _serve(net, "n1", SERVER)
        servers.append(tcp)
        assert _in(net, "n0", CLIENT, net.addresses["n1"], str(port), "3") == "hi"
        # Loopback is each namespace's own: n1's server is not on n0's 127.0.0.1.
        assert _in(net, "n0", CLIENT, "127.0.0.1", str(port), "3") == "ConnectionRefusedError"
        net.cut("n1")
        started = time.monotonic()
        assert _in(net, "n0", CLIENT, net.addresses["n1"], str(port), "1.5") == "TimeoutError"  # no reset: silence
        assert time.monotonic() - started >= 1.5
        net.mend("n1")
        assert _in(net, "n0", CLIENT, net.addresses["n1"], str(port), "5") == "hi"
        udp, uport = _serve(net, "n1", UDP_ECHO)
        servers.append(udp)
        assert int(_in(net, "n0", ECHO_LOSS, net.addresses["n1"], str(uport))) == 300
        net.drop("n1", 0.3)
        got = int(_in(net, "n0", ECHO_LOSS, net.addresses["n1"], str(uport)))
        # Each datagram crosses n1's rule once, on its way in: about 0.7 of 300 come back.
        assert 170 < got < 250, got
        assert net.dropped_packets("n1") == pytest.approx(300 - got, abs=2)
        net.undrop("n1")
        assert int(_in(net, "n0", ECHO_LOSS, net.addresses["n1"], str(uport))) == 300
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()
        net.close()
    assert net.leftovers() == []


TIMED = """
import socket, sys, time
started = time.monotonic()
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
print(c.recv(2).decode(), time.monotonic() - started)
"""


def test_latency_is_a_proxy_in_the_path_from_the_start_that_delays_only_while_set():
    net = Network(["n0", "n1"])
    servers = []
    try:
        net.add_proxies()
        tcp, port = _serve(net, "n1", SERVER)
        servers.append(tcp)

        def fetch() -> float:
            said, seconds = _in(net, "n0", TIMED, net.addresses["n1"], str(port)).split()
            assert said == "hi"  # carried through both nodes' proxies, to the original destination
            return float(seconds)

        def applied(node: str, delay_s: float) -> None:
            """Until the node's proxy says it applies ``delay_s`` (it reads its control file ten times a second)."""
            while net.applied_delay(node) != delay_s:  # no bound: the test's timeout is the hang guard
                time.sleep(0.02)

        applied("n1", 0.0)
        fetch()
        net.set_delay("n1", 0.3)
        applied("n1", 0.3)
        assert fetch() >= 0.3  # the server's answer waited in n1's proxy
        net.set_delay("n1", 0.0)
        applied("n1", 0.0)  # nothing waits from here on (test_a_chunk_leaves_the_proxy_its_delay_after_it_arrived_...)
        fetch()
        with pytest.raises(RuntimeError, match="no delaying proxy"):
            Network.set_delay(net, "n9", 0.1)
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()
        net.close()
    assert net.leftovers() == []


def test_a_network_left_by_a_runner_that_is_gone_is_swept_before_a_new_one():
    """A runner killed by SIGKILL cannot tear down: its namespaces and links carry its pid tag, and go."""
    import os
    import subprocess as sp

    from resilient.chaos.netns import sweep_stale

    dead = sp.Popen(["true"])
    dead.wait()
    tag = dead.pid % 100000
    ns, link = f"resilient-drill-{tag}-n0", f"rd{tag}br"
    assert sp.run(["ip", "netns", "add", ns], check=False).returncode == 0
    assert sp.run(["ip", "link", "add", link, "type", "bridge"], check=False).returncode == 0
    mine = f"resilient-drill-{os.getpid() % 100000}-keep"
    sp.run(["ip", "netns", "add", mine], check=True)
    try:
        removed = sweep_stale()
        assert ns in removed and link in removed and mine not in removed, removed
        listed = sp.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert ns not in listed and mine in listed
    finally:
        for name in (ns, mine):
            sp.run(["ip", "netns", "delete", name], capture_output=True, check=False)
        sp.run(["ip", "link", "delete", link], capture_output=True, check=False)


def test_a_chunk_leaves_the_proxy_its_delay_after_it_arrived_and_at_once_with_none(tmp_path):
    """The proxy's queue on a made-up clock: released at arrival + delay, and at arrival when the delay is 0."""
    import socket
    import threading

    from resilient.chaos.delay import Delay, applied_path, pump

    control = tmp_path / "n0.ms"
    delay = Delay(str(control))
    delay.read()  # no file yet: no delay, and it says so
    assert delay.s == 0.0 and (tmp_path / "n0.ms.applied").read_text() == "0.0"
    control.write_text("250")
    delay.read()
    assert delay.s == 0.25 and Path(applied_path(str(control))).read_text() == "250.0"
    now, slept = [10.0], []

    def sleep(s: float) -> None:
        slept.append((now[0], s))
        now[0] += s

    into, src = socket.socketpair()
    dst, out = socket.socketpair()
    carrier = threading.Thread(target=pump, args=(src, dst, delay), kwargs={"clock": lambda: now[0], "sleep": sleep},
                               daemon=True)
    carrier.start()
    try:
        into.sendall(b"one")
        assert out.recv(16) == b"one"
        assert slept == [(10.0, 0.25)] and now[0] == 10.25  # arrived at 10.0, sent at 10.25
        control.write_text("0")
        delay.read()
        into.sendall(b"two")
        assert out.recv(16) == b"two"
        assert slept == [(10.0, 0.25)] and now[0] == 10.25  # sent as it arrived: no wait
        into.shutdown(socket.SHUT_WR)
        assert out.recv(16) == b""  # the end is carried too
        carrier.join(30)
        assert not carrier.is_alive()
    finally:
        for s in (into, src, dst, out):
            s.close()
