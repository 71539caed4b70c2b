"""A network between a drill's nodes on one machine: a namespace per node, veth pairs and a bridge.

With ``[topology] network = "netns"`` each node's agent (and its workers
and spares) runs inside a network namespace of its own, with one address on
a private /24 (``10.213.X.0/24``, ``X`` chosen free on this machine): a
veth pair joins the namespace to a bridge in the runner's namespace, which
holds ``.1``; the drill's etcd listens there.  Nothing of it reaches beyond
this machine: the bridge has no uplink and no route leads out of it.

The faults it makes possible (:mod:`resilient.chaos.host`):

- ``partition``: the node's veth is set down on the bridge's side for
  ``duration_s``: it reaches neither its peers nor etcd, and they do not
  reach it; packets are lost, connections are not reset (a switch port
  down, a cable pulled);
- ``packet_loss``: iptables in the node's namespace drops a share ``rate``
  of the packets arriving on its link (``-m statistic --mode random``);
  TCP retransmits, so the run slows down rather than fails;
- ``latency``: every TCP connection of the node to or from the bridge's
  subnet goes through a delaying proxy in its namespace
  (:mod:`resilient.chaos.delay`, put in place before the run by
  :meth:`Network.add_proxies`: this kernel has no netem, and a redirect
  applies to new connections only), which holds each byte ``delay_s`` each
  way while the fault lasts.

Needs root, ``ip`` (Debian iproute2), a kernel with veth and bridge
support, and for ``packet_loss`` ``iptables`` (Debian iptables);
:func:`unavailable` says which is missing.  :meth:`Network.close` deletes
the namespaces (and so their veth ends) and the bridge, and
:meth:`Network.leftovers` lists any that survived (a drill that leaves one
fails).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

SUBNET = "10.213"
"""The drills' networks: ``10.213.X.0/24``, a private range."""
PROXY_PORT = 15999
"""The delaying proxy's port in each node's namespace (the namespace's own: no clash with this machine's)."""
MARK = 0x2A
"""``SO_MARK`` of the proxy's onward connections, which the redirect rules let through."""


def unavailable(packet_loss: bool = False) -> str | None:
    """Why this machine cannot give a drill's nodes a network of their own (None: it can)."""
    if os.geteuid() != 0:
        return f"network namespaces need root (this runner runs as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "network namespaces need ip (Debian: apt-get install iproute2)"
    if packet_loss and shutil.which("iptables") is None:
        return "packet_loss needs iptables (Debian: apt-get install iptables)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def _used_subnets() -> set[int]:
    out = _ip("-o", "-4", "addr", "show", check=False).stdout
    used = set()
    for line in out.splitlines():
        for word in line.split():
            if word.startswith(f"{SUBNET}."):
                try:
                    used.add(int(word.split(".")[2]))
                except (IndexError, ValueError):
                    pass
    return used


def sweep_stale() -> list[str]:
    """Remove the namespaces and links of drill networks whose runner is gone (a runner killed by SIGKILL cannot
    tear down); returns what was removed.  A network is a runner's by its pid tag: ``resilient-drill-<tag>-<node>``
    and ``rd<tag>br`` / ``rd<tag>h<i>`` / ``rd<tag>n<i>``, ``tag`` being the runner's pid modulo 100000."""
    alive = {int(d.name) % 100000 for d in Path("/proc").iterdir() if d.name.isdigit()}
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        found = re.match(r"(resilient-drill-(\d+)-\S+)", line)
        if found and int(found.group(2)) not in alive:
            _ip("netns", "delete", found.group(1), check=False)
            removed.append(found.group(1))
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        fields = line.split(":")
        link = fields[1].strip().split("@")[0] if len(fields) > 1 else ""
        found = re.fullmatch(r"rd(\d+)(br|h\d+|n\d+)", link)
        if found and int(found.group(1)) not in alive:
            _ip("link", "delete", link, check=False)
            removed.append(link)
    return removed


class Network:
    """One namespace per node on a bridge of their own (see the module's docstring)."""

    def __init__(self, nodes: list[str]) -> None:
        sweep_stale()  # what a runner killed by SIGKILL left: it would hold a subnet, and it is nobody's
        tag = f"{os.getpid() % 100000}"
        self.prefix = f"rd{tag}"  # interface names: at most 15 characters
        self.bridge = f"{self.prefix}br"
        used = _used_subnets()
        third = next((x for x in (*range(20 + os.getpid() % 200, 250), *range(20, 250)) if x not in used), None)
        if third is None:
            raise RuntimeError(f"no free {SUBNET}.X.0/24 subnet on this machine for the drill's network")
        self.host_ip = f"{SUBNET}.{third}.1"
        self.namespaces: dict[str, str] = {}
        self.addresses: dict[str, str] = {}
        self.host_links: dict[str, str] = {}
        self.inner_links: dict[str, str] = {}
        self._drops: set[str] = set()
        self._proxies: dict[str, subprocess.Popen[str]] = {}
        self._control_dir: Path | None = None
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, node in enumerate(nodes):
                ns, host, inner = f"resilient-drill-{tag}-{node}", f"{self.prefix}h{i}", f"{self.prefix}n{i}"
                address = f"{SUBNET}.{third}.{i + 2}"
                _ip("netns", "add", ns)
                self.namespaces[node] = ns
                _ip("link", "add", host, "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", ns)
                _ip("link", "set", host, "master", self.bridge)
                _ip("link", "set", host, "up")
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
                _ip("-n", ns, "link", "set", inner, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                self.addresses[node], self.host_links[node], self.inner_links[node] = address, host, inner
        except BaseException:
            self.close()
            raise

    def wrap(self, node: str, cmd: list[str]) -> list[str]:
        """``cmd`` run inside ``node``'s namespace, gloo bound to its veth."""
        return ["ip", "netns", "exec", self.namespaces[node], "env", f"GLOO_SOCKET_IFNAME={self.inner_links[node]}",
                *cmd]

    def cut(self, node: str) -> None:
        """Partition ``node``: its link to the bridge goes down (no packet passes, no connection is reset)."""
        _ip("link", "set", self.host_links[node], "down")

    def mend(self, node: str) -> None:
        _ip("link", "set", self.host_links[node], "up")

    def drop(self, node: str, rate: float) -> None:
        """Drop a share ``rate`` of the packets ``node`` receives on its link (not on its loopback).

        On arrival, as a lossy link does: a rule on the way out would fail the sender's own call (EPERM), which
        no wire does.  Every TCP flow of the node loses data or acknowledgements, so both directions retransmit."""
        self._iptables(node, "-A", "INPUT", "-i", self.inner_links[node], "-m", "statistic", "--mode", "random",
                       "--probability", f"{rate:.4f}", "-j", "DROP")
        self._drops.add(node)

    def undrop(self, node: str) -> None:
        if node in self._drops:
            self._iptables(node, "-F", "INPUT")
            self._drops.discard(node)

    def dropped_packets(self, node: str) -> int:
        """Packets the drop rules of ``node`` have dropped so far."""
        out = self._iptables(node, "-L", "-n", "-v", "-x").stdout
        total = 0
        for line in out.splitlines():
            words = line.split()
            if "DROP" in words and words[0].isdigit():
                total += int(words[0])
        return total

    def _iptables(self, node: str, *args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["ip", "netns", "exec", self.namespaces[node], "iptables", *args], capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"iptables {' '.join(args)} in {self.namespaces[node]} failed: {done.stderr.strip()}")
        return done

    def add_proxies(self) -> None:
        """A delaying proxy (:mod:`resilient.chaos.delay`) in every node's namespace, with no delay yet, and the
        rules that send each new TCP connection between the node and the bridge's subnet through it."""
        import sys
        import tempfile

        self._control_dir = Path(tempfile.mkdtemp(prefix="resilient-drill-delay-"))
        for node, ns in self.namespaces.items():
            control = self._control_dir / f"{node}.ms"
            control.write_text("0")
            proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "resilient.chaos.delay",
                                     "--port", str(PROXY_PORT), "--control", str(control), "--mark", str(MARK)],
                                    stdout=subprocess.PIPE, text=True, start_new_session=True)
            self._proxies[node] = proc
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the delaying proxy in {ns} did not start")
            own, subnet = self.addresses[node], f"{self.host_ip.rsplit('.', 1)[0]}.0/24"
            self._iptables(node, "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", own, "-j", "RETURN")
            self._iptables(node, "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", subnet, "-m", "mark", "!", "--mark",
                           str(MARK), "-j", "REDIRECT", "--to-ports", str(PROXY_PORT))
            self._iptables(node, "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "-i", self.inner_links[node], "-j",
                           "REDIRECT", "--to-ports", str(PROXY_PORT))

    def set_delay(self, node: str, delay_s: float) -> None:
        """Every byte to and from ``node`` ``delay_s`` later, each way (its proxy must be in place)."""
        if node not in self._proxies or self._control_dir is None:
            raise RuntimeError(f"no delaying proxy at {node}: call add_proxies() before the run starts")
        tmp = self._control_dir / f"{node}.tmp"
        tmp.write_text(f"{delay_s * 1e3:g}")
        tmp.replace(self._control_dir / f"{node}.ms")

    def applied_delay(self, node: str) -> float | None:
        """The delay ``node``'s proxy applies now, in seconds (it takes a :meth:`set_delay` within 0.1 s); None
        before it first read its control file."""
        from .delay import applied_path

        if node not in self._proxies or self._control_dir is None:
            raise RuntimeError(f"no delaying proxy at {node}: call add_proxies() before the run starts")
        try:
            return float(Path(applied_path(str(self._control_dir / f"{node}.ms"))).read_text()) / 1e3
        except (FileNotFoundError, ValueError):
            return None

    def close(self) -> None:
        """Delete every namespace (their veth ends go with them) and the bridge; safe to call twice."""
        for proc in self._proxies.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
        self._proxies.clear()
        if self._control_dir is not None:
            shutil.rmtree(self._control_dir, ignore_errors=True)
        for ns in self.namespaces.values():
            _ip("netns", "delete", ns, check=False)
        for host in self.host_links.values():
            _ip("link", "delete", host, check=False)  # gone with its peer already, unless a namespace outlived us
        _ip("link", "delete", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """This network's namespaces and links still on the machine."""
        left = [ns for ns in self.namespaces.values() if (Path("/run/netns") / ns).exists()]
        ours = {self.bridge, *self.host_links.values(), *self.inner_links.values()}
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
            parts = line.split(":")
            name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
            if name in ours:
                left.append(name)
        return sorted(left)
