"""``resilient local-cluster``: a topology's whole stack on this machine, from installed binaries, on loopback.

For a machine without a container engine, and for trying a topology before
a cluster: ``up`` starts a supervisor process of its own (it outlives the
command) that runs

- one etcd member (Debian's ``etcd-server``) when the topology gives no
  endpoints and has more than one agent; one node without spares uses the
  agent's embedded store, as on every target;
- Prometheus scraping every agent each second and evaluating the shipped
  alert rules, and Alertmanager with the shipped routes, its webhooks
  pointed at a receiver that appends each notification to
  ``notifications.jsonl`` (the drills' :class:`~resilient.chaos.monitor.Monitoring`;
  the rules' ``for:`` as shipped unless ``alert_for_s``);
- one agent per node (``n0`` ...) and per spare node (``spare0`` ...,
  ``--role spare``): the command every other target starts
  (:func:`resilient.deploy.render.agent_args`), in the workdir, each on a
  free loopback metrics port.

It supervises the agents as the rendered systemd units do: an agent that
crashed or was killed (a node lost) is started again after
:data:`RESTART_S`, at most ``restart_limit`` times; one that succeeded,
was stopped (75) or ended with a verdict (78, 79, 80, 81) is not.  The run
is over once every worker agent has ended for good; the servers stay up
(for a look at Prometheus) until ``down``, which stops the agents first
(SIGTERM: they checkpoint within their preemption grace), then the servers,
and reports any process it had to kill.

Everything it started is in ``<dir>/cluster.json`` (:func:`read_state`),
rewritten whenever something changes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError
from ..core.exitcodes import EXIT_CONFIG, EXIT_PREEMPTED_AGENT, EXIT_STOPPED, EXIT_UNHEALTHY, EXIT_UNRECOVERABLE
from ..watchdog.procfs import read_stat
from .topology import Topology, load_topology

STATE = "cluster.json"
SPEC = "spec.json"
RESTART_S = 2.0
"""Seconds before a crashed agent is started again (the systemd units' RestartSec, shortened for one machine)."""
FINAL_CODES = frozenset({0, EXIT_PREEMPTED_AGENT, EXIT_CONFIG, EXIT_UNRECOVERABLE, EXIT_STOPPED, EXIT_UNHEALTHY})
"""Exit codes after which an agent is not started again (the units' SuccessExitStatus and
RestartPreventExitStatus)."""
VERDICTS = (EXIT_STOPPED, EXIT_CONFIG, EXIT_UNRECOVERABLE)
STOP_GRACE_S = 90.0
"""How long ``down`` waits for the agents after SIGTERM before SIGKILL (the units' TimeoutStopSec)."""
UP_TIMEOUT_S = 90.0


def run_exit_code(codes: list[int]) -> int:
    """The run's exit code from its worker agents' last ones, in the order the Slurm script decides: a verdict
    anywhere, then a node stepped out (81), then stopped (75), then a 0 (the run finished), then the highest."""
    for verdict in VERDICTS:
        if verdict in codes:
            return verdict
    for code in (EXIT_UNHEALTHY, EXIT_PREEMPTED_AGENT, 0):
        if code in codes:
            return code
    return max(codes)


def read_state(root: Path) -> dict[str, Any] | None:
    """The supervisor's ``cluster.json`` (None: no cluster was brought up in ``root``)."""
    try:
        return dict(json.loads((root / STATE).read_text()))
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ConfigError(f"{root / STATE}: not a local cluster's state file ({e}); remove {root} if nothing "
                          "runs there") from e


def alive(pid: int | None) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    st = read_stat(pid) if pid else None
    return st is not None and st.state not in ("Z", "X")


def resolve_workdir(topology: Topology, topology_path: Path, workdir: Path | None) -> Path:
    """Where the agents run: ``workdir`` if given, else the topology's (relative to the topology file)."""
    path = workdir if workdir is not None else (topology_path.parent / topology.workdir)
    if not path.is_dir():
        where = "--workdir" if workdir is not None else f"[run] workdir = {topology.workdir!r}"
        raise ConfigError(f"{where}: {path} is not a directory here; give --workdir DIR (where the script and "
                          "runs/ are)")
    return path.resolve()


class Agent:
    """One node's agent under the supervisor: its command, its process, and what became of each start."""

    def __init__(self, node: str, spare: bool, cmd: list[str], log: Path, port: int) -> None:
        self.node, self.spare, self.cmd, self.log, self.port = node, spare, cmd, log, port
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.exits: list[int] = []
        """Each start's exit status (negative: killed by that signal)."""
        self.restart_at: float | None = None

    def start(self, cwd: Path, env: dict[str, str]) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            out.write(f"--- start {self.starts + 1} at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(self.cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.starts += 1
        self.restart_at = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def done(self) -> bool:
        """Ended, reaped (its exit recorded) and not to be started again."""
        return self.restart_at is None and bool(self.exits) and len(self.exits) == self.starts

    def state(self) -> dict[str, Any]:
        return {"pid": self.proc.pid if self.running and self.proc is not None else None, "spare": self.spare,
                "port": self.port, "starts": self.starts, "exits": list(self.exits), "running": self.running,
                "restart_pending": self.restart_at is not None, "log": str(self.log), "command": self.cmd}


class Supervisor:
    """The process ``up`` leaves behind (see the module's docstring); :meth:`serve` runs until SIGTERM."""

    def __init__(self, root: Path) -> None:
        spec = json.loads((root / SPEC).read_text())
        self.root = root
        self.topology = load_topology(spec["topology"])
        self.workdir = Path(spec["workdir"])
        self.alert_for_s: float | None = spec.get("alert_for_s")
        self.restart_limit = int(spec.get("restart_limit", 5))
        self.run_dir = self.workdir / "runs" / self.topology.run_id
        self.status = "starting"
        self.error: str | None = None
        self.exit_code: int | None = None
        self.etcd: Any = None
        self.monitoring: Any = None
        self.store: str | None = None
        self.agents: dict[str, Agent] = {}
        self._env: dict[str, str] = dict(os.environ)
        self._stop = False
        self._seen_notifications = 0

    def _request_stop(self, *_: Any) -> None:
        self._stop = True

    def serve(self) -> int:
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        try:
            self._bring_up()
            self.status = "running"
            self._save()
            while not self._stop:
                changed = self._tick()
                self._notifications()
                if changed:
                    self._save()
                time.sleep(0.2)
        except Exception as e:  # noqa: BLE001 - reported in the state file, which `up` reads
            self.error = f"{type(e).__name__}: {e}"
            self.status = "failed"
            self._save()
        finally:
            killed = self._bring_down()
            self.status = "stopped" if self.status != "failed" else "failed"
            self._save(killed=killed)
        return 0 if self.status == "stopped" and not killed else 1

    # -- up -------------------------------------------------------------------------------------------------

    def _bring_up(self) -> None:
        from ..chaos import cluster, monitor
        from .common import agent_args, environment

        t = self.topology
        if t.etcd:
            self.store = "etcd://" + ",".join(t.etcd)
        elif not t.embedded:
            self.etcd = cluster.Etcd(self.root / "etcd")
            self.store = self.etcd.url
        self._save()
        self.monitoring = monitor.Monitoring(self.root / "monitoring", for_s=self.alert_for_s)
        self._save()
        env = {**os.environ, **environment(t)}
        for node, spare in cluster.node_names(t.nodes, t.spare_nodes):
            port = monitor.free_port()
            local = dataclasses.replace(t, metrics_port=port, metrics_addr="127.0.0.1")
            cmd = [sys.executable, "-m", "resilient",
                   *agent_args(local, node_id=node, store=self.store, spare=spare, local_addr="127.0.0.1")]
            self.agents[node] = Agent(node, spare, cmd, self.root / "agents" / f"{node}.log", port)
            self.monitoring.scrape(node, f"127.0.0.1:{port}")
        self._env = env
        for agent in self.agents.values():
            agent.start(self.workdir, env)

    # -- running --------------------------------------------------------------------------------------------

    def _tick(self) -> bool:
        """Reap ended agents, start again those due; True when anything changed."""
        changed = False
        now = time.monotonic()
        for agent in self.agents.values():
            code = agent.proc.poll() if agent.proc is not None and len(agent.exits) < agent.starts else None
            if code is not None:
                agent.exits.append(code)
                changed = True
                crashed = code not in FINAL_CODES
                if crashed and agent.starts <= self.restart_limit and self.exit_code is None:
                    agent.restart_at = now + RESTART_S
            if agent.restart_at is not None and now >= agent.restart_at and not self._stop:
                agent.start(self.workdir, self._env)
                changed = True
        workers = [a for a in self.agents.values() if not a.spare]
        if self.exit_code is None and all(a.done for a in workers):
            self.exit_code = run_exit_code([a.exits[-1] for a in workers])
            self.status = "finished"
            changed = True
        return changed

    def _notifications(self) -> None:
        if self.monitoring is None:
            return
        got = self.monitoring.notifications()
        if len(got) > self._seen_notifications:
            with open(self.root / "notifications.jsonl", "a") as out:
                out.writelines(json.dumps(n) + "\n" for n in got[self._seen_notifications:])
            self._seen_notifications = len(got)

    # -- down -----------------------------------------------------------------------------------------------

    def _bring_down(self) -> list[int]:
        """Stop the agents (SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`), then the servers; the pids
        that had to be killed."""
        from ..chaos.runner import tear_down

        self.status = "stopping" if self.status != "failed" else self.status
        self._save()
        for agent in self.agents.values():
            agent.restart_at = None
            if agent.running and agent.proc is not None:
                agent.proc.send_signal(signal.SIGTERM)
        killed: list[int] = []
        deadline = time.monotonic() + STOP_GRACE_S
        for agent in self.agents.values():
            if agent.proc is None:
                continue
            try:
                agent.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                killed.append(agent.proc.pid)
            try:
                os.killpg(agent.proc.pid, signal.SIGKILL)  # the agent's group (its workers have their own)
            except ProcessLookupError:
                pass
            code = agent.proc.wait(timeout=30)
            if len(agent.exits) < agent.starts:
                agent.exits.append(code)
        killed += tear_down(self.run_dir)  # workers and spares' warm pools outliving their agent
        self._notifications()
        if self.monitoring is not None:
            self.monitoring.close()
        if self.etcd is not None:
            self.etcd.close()
        return killed

    def _save(self, killed: list[int] | None = None) -> None:
        servers: dict[str, Any] = {}
        if self.etcd is not None:
            servers["etcd"] = {"url": self.store, "pids": self.etcd.pids(), "log": str(self.etcd.log),
                               "data": str(self.etcd.data)}
        if self.monitoring is not None:
            servers["prometheus"] = {"url": self.monitoring.url, "pids": self.monitoring.pids()}
        state = {"pid": os.getpid(), "status": self.status, "error": self.error, "run_id": self.topology.run_id,
                 "workdir": str(self.workdir), "run_dir": str(self.run_dir), "store": self.store,
                 "servers": servers, "exit_code": self.exit_code,
                 "agents": {n: a.state() for n, a in self.agents.items()}}
        if self.monitoring is not None:
            state["alertmanager"] = self.monitoring.alertmanager_url
            state["prometheus"] = self.monitoring.url
        if killed is not None:
            state["killed"] = killed
        tmp = self.root / (STATE + ".tmp")
        tmp.write_text(json.dumps(state, indent=1) + "\n")
        tmp.replace(self.root / STATE)


# -- the commands' side -------------------------------------------------------------------------------------


def up(topology_path: Path, root: Path, *, workdir: Path | None = None, alert_for_s: float | None = None,
       restart_limit: int = 5) -> dict[str, Any]:
    """Start the supervisor for ``topology_path`` in ``root`` and wait until its agents are started; its state.

    :class:`ConfigError` when the topology is invalid, a cluster is already up in ``root``, or a server is
    missing (naming what to install); a supervisor that failed to start is stopped, its error raised."""
    from ..chaos import cluster, monitor

    topology = load_topology(topology_path)
    wd = resolve_workdir(topology, topology_path, workdir)
    if alert_for_s is not None and alert_for_s <= 0:
        raise ConfigError(f"--alert-for {alert_for_s:g}: give seconds > 0, or leave it out for the rules' own")
    if restart_limit < 0:
        raise ConfigError(f"--restart-limit {restart_limit}: give 0 or more")
    state = read_state(root)
    if state is not None and alive(state.get("pid")):
        raise ConfigError(f"{root}: a local cluster is already up there (supervisor pid {state['pid']}): "
                          f"`resilient local-cluster down --dir {root}` first, or give another --dir")
    for why in (monitor.unavailable(), None if topology.etcd or topology.embedded else cluster.unavailable()):
        if why is not None:
            raise ConfigError(f"local-cluster: {why}")
    root.mkdir(parents=True, exist_ok=True)
    (root / STATE).unlink(missing_ok=True)
    (root / SPEC).write_text(json.dumps({"topology": str(topology_path.resolve()), "workdir": str(wd),
                                         "alert_for_s": alert_for_s, "restart_limit": restart_limit}) + "\n")
    with open(root / "supervisor.log", "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "resilient.deploy.local", str(root.resolve())],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + UP_TIMEOUT_S
    while True:
        state = read_state(root)
        if state is not None and state["status"] in ("running", "finished"):
            return state
        if state is not None and state["status"] == "failed" or proc.poll() is not None:
            proc.wait(timeout=STOP_GRACE_S + 30)
            state = read_state(root) or {}
            raise ConfigError(f"local-cluster did not come up: {state.get('error') or 'see ' + str(root)}"
                              f" (log: {root / 'supervisor.log'})")
        if time.monotonic() > deadline:
            down(root)
            raise ConfigError(f"local-cluster did not come up in {UP_TIMEOUT_S:g} s (log: {root / 'supervisor.log'})")
        time.sleep(0.2)


def recorded_pids(state: dict[str, Any]) -> list[int]:
    """Every process the state file names as running: the supervisor, the servers, the agents."""
    pids = [state.get("pid")]
    pids += [p for s in state.get("servers", {}).values() for p in s.get("pids", [])]
    pids += [a.get("pid") for a in state.get("agents", {}).values()]
    return [int(p) for p in pids if p]


def down(root: Path, timeout_s: float = STOP_GRACE_S + 60) -> dict[str, Any]:
    """Stop the cluster in ``root`` and wait for its supervisor; the final state, with ``left``: processes it
    started that are still alive afterwards (killed now, and reported)."""
    from ..chaos.runner import leftovers

    state = read_state(root)
    if state is None:
        raise ConfigError(f"{root}: no local cluster was brought up there ({root / STATE} is missing); give the "
                          "--dir that `up` used")
    before = recorded_pids(state)
    pid = state.get("pid")
    if pid is not None and alive(pid):
        os.kill(int(pid), signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    final = read_state(root) or state
    left = [p for p in before + recorded_pids(final) if alive(p)]
    left += [p for p in leftovers(Path(final["run_dir"])) if p not in left] if final.get("run_dir") else []
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    final["left"] = sorted(set(left))
    return final


def wait(root: Path, timeout_s: float) -> dict[str, Any] | None:
    """Wait until the run in ``root`` is over (its state), or None at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = read_state(root)
        if state is None:
            raise ConfigError(f"{root}: no local cluster was brought up there; give the --dir that `up` used")
        if state["status"] in ("finished", "failed", "stopped") or not alive(state.get("pid")):
            return state
        if time.monotonic() > deadline:
            return None
        time.sleep(0.5)


def kill_node(root: Path, node: str) -> int:
    """SIGKILL ``node``'s agent (a machine lost; its workers die with it); the pid killed."""
    state = read_state(root)
    if state is None:
        raise ConfigError(f"{root}: no local cluster was brought up there; give the --dir that `up` used")
    agents = state.get("agents", {})
    if node not in agents:
        raise ConfigError(f"node {node!r}: not in this cluster; its nodes are {', '.join(agents)}")
    pid = agents[node].get("pid")
    if pid is None or not alive(pid):
        raise ConfigError(f"node {node!r}: its agent is not running now (see `resilient local-cluster status`)")
    os.kill(int(pid), signal.SIGKILL)
    return int(pid)


def main(argv: list[str]) -> int:
    """The supervisor: ``python -m resilient.deploy.local DIR``."""
    return Supervisor(Path(argv[0])).serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
