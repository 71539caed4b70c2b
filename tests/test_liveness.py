"""Which nodes are alive, from evidence (``resilient.coord.liveness``, ``presence``, ``agent.severance``).

- the rule by table: accusations by a quorum of live probers make a node
  lost; one prober's accusation (a link cut between two nodes) does not; a
  node whose presence key is gone stays alive while a live node vouches
  for it (cut off from etcd, not from its peers), and is lost otherwise;
- the probes over real sockets: a peer whose agent is gone is down at once
  (its port refuses), a silent one (it accepts nothing) after the silence,
  an impostor on the port is down, and a peer that answers again is up;
- presences on a real etcd: an agent that stops answering is judged lost by
  its peers' accusations, long before its lease lapses; one whose lease is
  revoked while it still answers is vouched for and never lost;
- the severance: a process blocked reading a connection to a lost address
  gets its end of file at once; connections to this node's own address are
  never touched.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from resilient.agent import severance
from resilient.coord.etcd import EtcdClient, EtcdConfig
from resilient.coord.keyspace import LaunchKeys
from resilient.coord.liveness import (
    INTERVAL_S,
    SILENCE_S,
    Evidence,
    Prober,
    ProbeServer,
    judge,
    probers_of,
    ring_after,
)
from resilient.coord.presence import Presence
from resilient.coord.proof import Seal
from resilient.coord.watch import PrefixWatch


def _ev(running: str, suspects: dict[str, str] | None = None, vouches: dict[str, str] | None = None) -> Evidence:
    return Evidence(frozenset(running.split()), {n: frozenset(b.split()) for n, b in (suspects or {}).items()},
                    {n: frozenset(b.split()) for n, b in (vouches or {}).items()})


def test_the_ring_gives_each_node_its_probers_and_targets() -> None:
    nodes = ["a", "b", "c", "d", "e"]
    assert ring_after(nodes, "d", 3) == ["e", "a", "b"]
    assert probers_of(nodes, "a", 3) == ["e", "d", "c"]
    assert ring_after(["a", "b"], "a", 3) == ["b"]
    for node in nodes:  # every target's probers include the node probing it
        for target in ring_after(nodes, node, 3):
            assert node in probers_of(nodes, target, 3)


@pytest.mark.parametrize("evidence, lost, live", [
    # Everyone answers: nothing lost.
    (_ev("a b c"), {}, "a b c"),
    # b accused by both of its live probers (a and c, in a ring of three): lost while its key still stands.
    (_ev("a b c", {"b": "a c"}), {"b": "probes"}, "a c"),
    # One accusation among two live probers: a link cut between two nodes, not a lost node.
    (_ev("a b c", {"b": "a"}), {}, "a b c"),
    # Accused by nodes that are themselves not running: no evidence.
    (_ev("a b c", {"b": "x y"}), {}, "a b c"),
    # Two nodes: the one live prober's accusation is enough.
    (_ev("a b", {"b": "a"}), {"b": "probes"}, "a"),
    # b's key is gone and nobody vouches: lost with its lease.
    (_ev("a c", {}), {}, "a c"),
    (_ev("a c", {"b": "a"}), {"b": "lease"}, "a c"),
    # b's key is gone but c reaches it: alive (cut off from etcd only).
    (_ev("a c", {}, {"b": "c"}), {}, "a b c"),
    # Vouched for by a node that is not running itself: not enough.
    (_ev("a c", {}, {"b": "x"}), {}, "a c"),
    # Vouched for by one, accused by the other two of its probers (a ring of four): the accusers win.
    (_ev("a c d", {"b": "a d"}, {"b": "c"}), {"b": "probes"}, "a c d"),
    # Never me, whatever the others say.
    (_ev("a b c", {"a": "b c"}), {}, "a b c"),
])
def test_the_rule_by_table(evidence: Evidence, lost: dict[str, str], live: str) -> None:
    verdict = judge(evidence, "a")
    assert set(verdict.lost) == set(lost)
    for node, why in lost.items():
        assert ("probes" in verdict.lost[node]) is (why == "probes"), verdict.lost[node]
    assert verdict.live == frozenset(live.split())


def test_a_large_ring_needs_a_quorum_of_its_probers() -> None:
    running = " ".join(f"n{i:02d}" for i in range(20))
    probers = probers_of(running.split(), "n10")
    assert len(probers) == 3
    assert "n10" not in judge(_ev(running, {"n10": probers[0]}), "n00").lost
    assert "n10" in judge(_ev(running, {"n10": " ".join(probers[:2])}), "n00").lost


class Changes:
    def __init__(self) -> None:
        self.seen: list[tuple[str, bool, str]] = []
        self.cond = threading.Condition()

    def __call__(self, node: str, up: bool, why: str) -> None:
        with self.cond:
            self.seen.append((node, up, why))
            self.cond.notify_all()

    def wait_for(self, ok: Callable[[list[tuple[str, bool, str]]], bool], timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not ok(self.seen):
                left = deadline - time.monotonic()
                assert left > 0, f"never happened; seen: {self.seen}"
                self.cond.wait(left)


def _served_elsewhere(node: str) -> tuple[subprocess.Popen[str], str]:
    """A probe server in a process of its own (to be killed: a death, with no goodbye), and its address."""
    code = ("import sys, time\nfrom resilient.coord.liveness import ProbeServer\n"
            f"s = ProbeServer('127.0.0.1', {node!r}); s.start(); print(s.address, flush=True); time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _until_up(prober: Prober, node: str) -> None:
    deadline = time.monotonic() + 20
    while prober.state().get(node) is not True:
        assert time.monotonic() < deadline, prober.state()
        time.sleep(0.02)


def test_probes_see_a_peer_go_refuse_stay_silent_or_lie_and_come_back() -> None:
    changes = Changes()
    prober = Prober("me", changes, interval_s=0.05, silence_s=0.4)
    prober.start()
    proc, address = _served_elsewhere("peer")
    silent = socket.create_server(("127.0.0.1", 0))  # listens, accepts nothing: connections sit in its backlog
    impostor = ProbeServer("127.0.0.1", "someone-else")
    impostor.start()
    leaver = ProbeServer("127.0.0.1", "leaver")
    leaver.start()
    try:
        prober.follow({"peer": address, "leaver": leaver.address})
        _until_up(prober, "peer")
        _until_up(prober, "leaver")
        assert changes.seen == []  # the first answer is no news
        proc.kill()  # its agent dies: the connection ends and the port refuses
        changes.wait_for(lambda s: ("peer", False) in [(n, u) for n, u, _ in s])
        assert changes.seen[-1][2].startswith(("connecting failed", "the connection failed", "its agent closed")), \
            changes.seen  # the kernel answered for the dead process: no waiting for silence
        leaver.close()  # a server closed on purpose says goodbye: nobody accuses it, nobody vouches for it
        deadline = time.monotonic() + 20
        while prober.state().get("leaver") is not None:
            assert time.monotonic() < deadline, prober.state()
            time.sleep(0.02)
        time.sleep(0.5)  # ten pings' worth: a refused reconnect would have been seen by now
        assert "leaver" not in [n for n, _, _ in changes.seen], changes.seen
        assert "leaver" not in prober.down() and prober.state().get("leaver") is None

        prober.follow({"silent": f"127.0.0.1:{silent.getsockname()[1]}",
                       "liar": impostor.address})
        changes.wait_for(lambda s: {n for n, u, _ in s if not u} >= {"silent", "liar"})
        why = {n: w for n, u, w in changes.seen if not u}
        assert "no answer" in why["silent"], why
        assert "someone-else" in why["liar"], why
        assert prober.down() == {"silent": why["silent"], "liar": why["liar"]}, prober.down()

        back = ProbeServer("127.0.0.1", "silent")
        back.start()
        try:
            prober.follow({"silent": back.address})
            changes.wait_for(lambda s: ("silent", True) in [(n, u) for n, u, _ in s])
        finally:
            back.close()
    finally:
        prober.close()
        impostor.close()
        leaver.close()
        silent.close()
        proc.kill()
        proc.wait()


def test_the_server_drops_probers_gone_without_a_word_and_makes_room_for_new_ones(monkeypatch) -> None:
    """A prober that lost power leaves a half-open connection: the server drops it once idle, and when full it
    drops the connection heard from least recently instead of turning a live prober away."""
    from resilient.coord import liveness

    monkeypatch.setattr(liveness, "IDLE_S", 0.4)
    monkeypatch.setattr(liveness, "MAX_CONNECTIONS", 2)
    server = ProbeServer("127.0.0.1", "peer")
    server.start()
    host, port = server.address.rsplit(":", 1)
    conns = []
    try:
        for _ in range(2):
            conn = socket.create_connection((host, int(port)), timeout=10)
            assert conn.recv(16) == b"peer\n"
            conns.append(conn)
        conns[1].sendall(b".")
        assert conns[1].recv(16) == b"."
        third = socket.create_connection((host, int(port)), timeout=10)  # full: the silent first one goes
        conns.append(third)
        assert third.recv(16) == b"peer\n"
        assert conns[0].recv(16) == b"", "the least recently heard connection was kept"
        third.sendall(b".")
        assert third.recv(16) == b"."
        # Nothing more from any of them: each is dropped once idle.
        assert conns[1].recv(16) == b"" and third.recv(16) == b""
    finally:
        for conn in conns:
            conn.close()
        server.close()


# --------------------------------------------------------------- on real etcd


class Lost:
    def __init__(self) -> None:
        self.nodes: dict[str, str] = {}
        self.at: dict[str, float] = {}
        """When each node was reported lost (monotonic)."""
        self.cond = threading.Condition()

    def __call__(self, node: str, why: str) -> None:
        with self.cond:
            self.nodes[node] = why
            self.at[node] = time.monotonic()
            self.cond.notify_all()


TOKEN = "liveness-test-token"


@contextlib.contextmanager
def _presences(etcd_server, run_id: str, names: list[str], *, probes: bool = True, silence_s: float = 0.4,
               probe_interval_s: float = 0.05,
               forged: list[tuple[str, str]] | None = None,
               ) -> Iterator[tuple[dict[str, Presence], dict[str, Lost], EtcdClient]]:
    """Presences of ``names`` in this process, each with its own watch (probing its peers unless ``probes`` is
    False); they leave and stop at the end.  ``forged`` collects (node, key) of each value a node rejected."""
    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    presences, losts, watches = {}, {}, []
    try:
        for name in names:
            watch = PrefixWatch(EtcdClient(EtcdConfig.from_url(etcd_server.url)), f"/resilient/{run_id}/launch")
            watch.start()
            watches.append(watch)
            losts[name] = Lost()
            presences[name] = Presence(watch._client, LaunchKeys("l1", f"/resilient/{run_id}/"), name, losts[name],
                                       lambda e: None, watch=watch, ttl_s=30,
                                       probe_host="127.0.0.1" if probes else None,
                                       probe_interval_s=probe_interval_s, silence_s=silence_s,
                                       seal=Seal(TOKEN, f"/resilient/{run_id}/", on_rejected=(
                                           lambda key, _why, name=name: (forged if forged is not None else []
                                                                         ).append((name, key)))))
        for presence in presences.values():
            presence.start()
        yield presences, losts, client
    finally:
        for presence in presences.values():
            presence.leave()
        for watch in watches:
            watch.close()


@contextlib.contextmanager
def _agent_elsewhere(etcd_server, run_id: str, name: str, *, silence_s: float = 0.4,
                     probe_interval_s: float = 0.05) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """Node ``name``'s presence in a process of its own (killed: a death), renewing its 30 s lease only every
    29 s; yields the process and its lease, and kills it at the end."""
    code = ("import sys, time\n"
            "from resilient.coord.etcd import EtcdClient, EtcdConfig\n"
            "from resilient.coord.keyspace import LaunchKeys\n"
            "from resilient.coord.presence import Presence\n"
            "from resilient.coord.proof import Seal\n"
            "from resilient.coord.watch import PrefixWatch\n"
            f"w = PrefixWatch(EtcdClient(EtcdConfig.from_url({etcd_server.url!r})), '/resilient/{run_id}/launch')\n"
            "w.start()\n"
            f"p = Presence(w._client, LaunchKeys('l1', '/resilient/{run_id}/'), {name!r}, lambda n, y: None, print,\n"
            "             watch=w, ttl_s=30, interval_s=29, probe_host='127.0.0.1',\n"
            f"             probe_interval_s={probe_interval_s!r}, silence_s={silence_s!r},\n"
            f"             seal=Seal({TOKEN!r}, '/resilient/{run_id}/'))\n"
            "p.start(); print(p.lease, flush=True); time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc, int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


def _wait(ok: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _wait_lost(lost: Lost, node: str) -> str:
    with lost.cond:
        assert lost.cond.wait_for(lambda: node in lost.nodes, 20), f"{node} never judged lost"
        return lost.nodes[node]


def test_an_agent_that_stops_answering_is_lost_by_its_peers_accusations(etcd_server, etcd_run_id) -> None:
    with _presences(etcd_server, etcd_run_id, ["a", "c"]) as (presences, losts, client), \
            _agent_elsewhere(etcd_server, etcd_run_id, "b") as (b, _):
        _wait(lambda: all(p.live() == {"a", "b", "c"} for p in presences.values()), "all three alive")
        b.kill()  # b's agent dies: its probe port closes; its key would stand for 30 s more
        for name in ("a", "c"):
            assert "does not answer probes from a, c" in _wait_lost(losts[name], "b"), losts[name].nodes
            assert presences[name].live() == {"a", "c"}
        entry = client.get(f"/resilient/{etcd_run_id}/launch/l1/nodes/b")
        assert entry is not None, "b's key still stands: the accusations, not the lease, found it lost"
        assert presences["a"].address_of("b") == "127.0.0.1"


def test_an_agent_stalled_for_2_s_is_not_lost_and_one_silent_for_good_is_lost_after_the_default_silence(
        etcd_server, etcd_run_id) -> None:
    """With the defaults of ``resilient run`` (``--node-silence-timeout``): a 2 s stall of a node's agent (SIGSTOP:
    a long pause, a loaded machine) is no loss; the same agent silent for good (its traffic gone, as in a
    partition: the process is stopped, its kernel still holds the connections) is judged lost within 3 s."""
    import signal

    with _presences(etcd_server, etcd_run_id, ["a", "c"], silence_s=SILENCE_S, probe_interval_s=INTERVAL_S) as (
            presences, losts, _), \
            _agent_elsewhere(etcd_server, etcd_run_id, "b", silence_s=SILENCE_S, probe_interval_s=INTERVAL_S) as (b, _):
        _wait(lambda: all(p.live() == {"a", "b", "c"} for p in presences.values()), "all three alive")
        time.sleep(3 * INTERVAL_S)  # every prober has heard b answer
        b.send_signal(signal.SIGSTOP)
        time.sleep(2.0)
        b.send_signal(signal.SIGCONT)
        time.sleep(SILENCE_S)  # an accusation made late would be in by now
        assert not losts["a"].nodes and not losts["c"].nodes, (losts["a"].nodes, losts["c"].nodes)
        assert all(p.live() == {"a", "b", "c"} for p in presences.values())
        b.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        for name in ("a", "c"):
            assert "does not answer probes from a, c" in _wait_lost(losts[name], "b"), losts[name].nodes
        judged = time.monotonic() - stopped
        assert judged <= 3.0, judged
        # Neither accuser spoke before the silence had passed since it last heard b (on a loaded machine b may
        # have answered its last ping a while before it was stopped: the silence counts from that answer).
        heard = max(presences[name]._prober._peers["b"].answered for name in ("a", "c"))  # type: ignore[union-attr]
        first = min(losts[name].at["b"] for name in ("a", "c"))
        assert first - heard >= SILENCE_S, (first - heard, judged)


def test_an_agent_cut_off_from_etcd_but_answering_is_vouched_for_and_never_lost(etcd_server, etcd_run_id) -> None:
    base = f"/resilient/{etcd_run_id}/launch/l1/"
    with _presences(etcd_server, etcd_run_id, ["a", "c"]) as (presences, losts, client), \
            _agent_elsewhere(etcd_server, etcd_run_id, "b") as (b, lease):
        _wait(lambda: all(p.live() == {"a", "b", "c"} and p._prober.state().get("b") is True  # type: ignore[union-attr]
                          for p in presences.values()), "all three alive, a and c reaching b")
        client.lease_revoke(lease)  # b's lease lapses (as in an etcd outage of its own) while it answers probes
        _wait(lambda: client.get(base + "nodes/b") is None, "b's key gone")
        _wait(lambda: client.get(base + "vouch/b/a") is not None and client.get(base + "vouch/b/c") is not None,
              "a and c vouch for b")
        time.sleep(1.0)  # twenty rounds of probes and judgements
        assert losts["a"].nodes == {} and losts["c"].nodes == {}
        assert presences["a"].live() == {"a", "b", "c"}
        # Once b stops answering too, it is lost (by its accusers), and the vouches are withdrawn.
        b.kill()
        assert "does not answer probes" in _wait_lost(losts["a"], "b")
        _wait(lambda: client.get(base + "vouch/b/a") is None, "a's vouch withdrawn")


def test_without_probes_a_node_whose_lease_lapsed_is_lost_by_the_lease(etcd_server, etcd_run_id) -> None:
    """Nobody probes b (its peers' probes are off): the lease is the evidence left, as before the probes.  It is
    judged as the grace after its key went ends, not at the judges' next renewal of their own leases (every 10 s
    here)."""
    from resilient.coord.presence import LEASE_GRACE_S

    with _presences(etcd_server, etcd_run_id, ["a", "c"], probes=False) as (presences, losts, client), \
            _agent_elsewhere(etcd_server, etcd_run_id, "b") as (_, lease):
        _wait(lambda: all(p.live() == {"a", "b", "c"} for p in presences.values()), "all three alive")
        client.lease_revoke(lease)
        revoked = time.monotonic()
        for name in ("a", "c"):
            assert _wait_lost(losts[name], "b") == "its presence lease expired and no live node vouches for it"
            assert presences[name].live() == {"a", "c"}
            assert losts[name].at["b"] - revoked <= LEASE_GRACE_S + 1.0, losts[name].at["b"] - revoked


def test_forged_presence_accusations_and_vouches_judge_nobody_and_are_reported(etcd_server, etcd_run_id) -> None:
    """A writer without the run token puts, with plain etcd puts: two accusations of a live node (a quorum of
    its probers), a presence key of a node that does not exist pointing the probes elsewhere, and a vouch.  No
    node is judged lost, the invented node is nobody, and every forged key is reported by the nodes that read
    it.  The same accusations signed with the token do get b judged lost (the forgery is what fails)."""
    base = f"/resilient/{etcd_run_id}/launch/l1/"
    forged: list[tuple[str, str]] = []
    with _presences(etcd_server, etcd_run_id, ["a", "b", "c"], forged=forged) as (presences, losts, client):
        _wait(lambda: all(p.live() == {"a", "b", "c"} for p in presences.values()), "all three alive")
        planted = {base + "suspect/b/a": b'{"why": "forged", "at": 1}',
                   base + "suspect/b/c": b'{"body": {"why": "forged", "at": 1}, "proof": "00"}',
                   base + "nodes/ghost": b'{"state": "running", "probe": "127.0.0.1:9"}',
                   base + "vouch/ghost/a": b'{"at": 1}'}
        for key, value in planted.items():
            client.put(key, value)
        _wait(lambda: {k for _, k in forged} == set(planted), f"every forged key reported: {forged}")
        time.sleep(1.0)  # twenty rounds of probes and judgements
        assert losts["a"].nodes == {} and losts["b"].nodes == {} and losts["c"].nodes == {}
        assert all(p.live() == {"a", "b", "c"} for p in presences.values())
        assert presences["a"].address_of("ghost") is None
        # Reported once per key and node, not once per judgement.
        assert len(forged) == len(set(forged)), forged
        # The control: the same two accusations with the token's proof make b lost at once.
        seal = Seal(TOKEN, f"/resilient/{etcd_run_id}/")
        for key in (base + "suspect/b/a", base + "suspect/b/c"):
            client.put(key, seal.seal(key, {"why": "signed", "at": 1}))
        assert "does not answer probes from a, c" in _wait_lost(losts["a"], "b")


def test_an_agent_that_leaves_is_never_lost(etcd_server, etcd_run_id) -> None:
    with _presences(etcd_server, etcd_run_id, ["a", "b", "c"]) as (presences, losts, client):
        _wait(lambda: all(p.live() == {"a", "b", "c"} for p in presences.values()), "all three alive")
        presences["b"].leave()
        _wait(lambda: all(p.live() == {"a", "c"} for n, p in presences.items() if n != "b"), "b gone")
        time.sleep(0.5)
        assert losts["a"].nodes == {} and losts["c"].nodes == {}
        assert client.get_prefix(f"/resilient/{etcd_run_id}/launch/l1/suspect/") == []


# --------------------------------------------------------------- severance


def test_a_connection_to_a_lost_address_is_shut_and_the_blocked_reader_wakes() -> None:
    lost = socket.create_server(("127.0.0.2", 0))  # the lost node (another loopback address)
    mine = socket.create_server(("127.0.0.1", 0))  # a peer at this node's own address
    code = ("import socket, sys\n"
            f"a = socket.create_connection(('127.0.0.2', {lost.getsockname()[1]}))\n"
            f"b = socket.create_connection(('127.0.0.1', {mine.getsockname()[1]}))\n"
            "print('ready', flush=True)\n"
            "print('read', a.recv(10), flush=True)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        held = [lost.accept()[0], mine.accept()[0]]
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert severance.sever([child.pid], "127.0.0.1", "127.0.0.1") == []  # this node's own address: untouched
        assert sorted(severance.connections(child.pid).values()) == ["127.0.0.1", "127.0.0.2"]
        cut = severance.sever([child.pid], "127.0.0.2", "127.0.0.1")
        assert [(c.pid, c.sockets, c.problem) for c in cut] == [(child.pid, 1, None)]
        assert child.stdout.readline().strip() == "read b''"
        assert child.wait(timeout=10) == 0
        for conn in held:
            conn.close()
    finally:
        if child.poll() is None:
            child.kill()
        lost.close()
        mine.close()


def test_children_are_this_process_s_children() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in severance.children()
        assert child.pid not in severance.children(child.pid)
    finally:
        child.kill()
        child.wait()
