"""A real Slurm for the tests: munged, slurmctld and slurmd from Debian's packages, without systemd.

Everything lives in one directory (configuration, state, spool, logs, munge's socket), the daemons listen on
free loopback ports, and :meth:`SlurmCluster.close` stops them and checks that none is left.  Requeues are
fast: ``AuthInfo=cred_expire=5`` (a requeued job waits a credential lifetime before it may start again, 120 s
by default).  Needs root (slurmd runs jobs as their users) and ``scripts/setup.sh --for tests``, which installs
the packages with their services neither started nor enabled.

With ``nodes > 1`` the compute nodes ``n1`` ... ``nN`` are that many slurmd daemons on this machine (``slurmd
-N``, each on a port of its own, ``NodeAddr=127.0.0.1``): an allocation of several nodes, each with its own
``SLURMD_NODENAME``, as on a cluster.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from .prometheus_server import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")


class SlurmCluster:
    """One controller and ``nodes`` compute nodes (this machine) with a partition ``debug``."""

    def __init__(self, root: Path, nodes: int = 1) -> None:
        missing = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not installed: run scripts/setup.sh --for tests")
        if os.geteuid() != 0:
            raise RuntimeError("a Slurm compute node runs as root: run the tests as root")
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.nodes = [self.node] if nodes == 1 else [f"n{i}" for i in range(1, nodes + 1)]
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen] = []
        munge = root / "munge"
        for sub in ("state", "spool", "log", "munge"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)
        munge.chmod(0o755)  # munged wants its socket's directory open to all, and its own
        user = pwd.getpwnam("munge")
        os.chown(munge, user.pw_uid, user.pw_gid)
        self.socket = munge / "munge.socket"
        cpus = os.cpu_count() or 1
        nodes_conf = "\n".join(
            f"NodeName={n} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN" + (
                f" NodeHostname={self.node} Port={free_port()}" if nodes > 1 else f" Port={free_port()}")
            for n in self.nodes)
        for n in self.nodes:
            (root / "spool" / n).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(f"""ClusterName=resilient-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket},cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=30
MinJobAge=600
{nodes_conf}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        self._start(["runuser", "-u", "munge", "--", "munged", "--foreground", f"--socket={self.socket}",
                     f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log", f"--seed-file={munge}/seed"])
        self._wait(self.socket.exists, 10, "munged's socket")
        self._start(["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for node in self.nodes:
            self._start(["slurmd", "-D", "-f", str(self.conf), *(["-N", node] if nodes > 1 else [])])
        self._wait(lambda: self.sinfo().split().count("idle") == len(self.nodes), 30,
                   f"node(s) {', '.join(self.nodes)} idle in sinfo")

    def _start(self, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{Path(argv[0]).name}-{len(self._procs)}.out", "wb")  # noqa: SIM115
        self._procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True))
        log.close()

    def _wait(self, ok: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            dead = [p.args for p in self._procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0]} exited; see {self.root}/log")
            time.sleep(0.5)
        raise RuntimeError(f"timed out waiting for {what}; see {self.root}/log")

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=self.env, check=False)

    def sinfo(self) -> str:
        return self.run("sinfo", "-h", "-N", "-o", "%T").stdout

    def sbatch(self, script: Path, env: dict[str, str]) -> int:
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=30,
                              env={**env, "SLURM_CONF": str(self.conf)}, check=False, cwd=script.parent)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed: {done.stderr}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...); {} once it is forgotten."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id)).stdout
        return dict(w.split("=", 1) for w in out.split() if "=" in w)

    def wait_state(self, job_id: int, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(1)
        raise AssertionError(f"job {job_id} not in {states} after {timeout} s: {self.job(job_id)}")

    def close(self) -> list[str]:
        """Cancel every job, stop the daemons; the processes still alive afterwards (none, normally)."""
        self.run("scancel", "--full", "-u", "root")
        for p in reversed(self._procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in self._procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        left = subprocess.run(["pgrep", "-a", "-f", str(self.root)], capture_output=True, text=True,
                              check=False).stdout.splitlines()
        return [line for line in left if "pgrep" not in line]
