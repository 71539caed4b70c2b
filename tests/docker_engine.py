"""A Docker engine of the tests' own, and the images a compose stack needs, built here with no registry.

:class:`DockerEngine` starts Debian's ``dockerd`` directly (no systemd) with every path of its own under one
directory: data root, exec root, a unix socket, a pid file. It leaves the host's firewall and sysctls alone
(``--iptables=false --ip-forward=false --ip-masq=false --bridge=none``): containers of one compose network talk
over their bridge, and published ports are served on 127.0.0.1 by docker-proxy. Where the host's ``FORWARD``
policy drops bridged traffic (br_netfilter loaded), one rule accepting traffic between compose bridges is added
for the engine's lifetime. :meth:`DockerEngine.close` stops every container, then the engine, removes its
directory, and returns the processes left behind (none, or the test fails).

:func:`base_image` builds the stand-in for ``python:3.11-slim`` that no registry can give here: a Debian
bookworm made by ``debootstrap`` (Python 3.11), a virtualenv with PyTorch's CPU wheel and the project's runtime
dependencies from this machine's wheels, imported with ``docker import``; pip in it installs from those wheels
only. :func:`server_images` tags stand-ins for the etcd, Prometheus and Alertmanager images the rendered compose
file names, made of this machine's Debian binaries with the upstream images' entrypoints.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTUP_S = 60.0
BASE_IMAGE = "resilient-test-base:bookworm"
RUNTIME = ["torch==2.13.0", "psutil>=5.9", "xxhash>=3.0", "boto3>=1.36", "prometheus-client>=0.20",
           "moto[server]>=5", "setuptools>=68", "wheel"]
"""What the base image carries: the agent image's pip then finds each of its requirements satisfied."""


def missing() -> list[str]:
    """The commands this needs that are not installed (``scripts/setup.sh --for tests`` installs them)."""
    return [c for c in ("dockerd", "docker", "docker-compose", "debootstrap") if shutil.which(c) is None]


class DockerEngine:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.sock = root / "docker.sock"
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.sock}", "COMPOSE_INTERACTIVE_NO_CLI": "1"}
        self._rule: list[str] | None = None
        self.log = root / "dockerd.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                ["dockerd", f"--data-root={root / 'data'}", f"--exec-root={root / 'exec'}", "-H", f"unix://{self.sock}",
                 f"--pidfile={root / 'docker.pid'}", "--iptables=false", "--ip-forward=false", "--ip-masq=false",
                 "--bridge=none"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + STARTUP_S
        while self.docker("info", check=False).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"dockerd did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)
        self._allow_bridges()

    def docker(self, *args: str, check: bool = True, timeout: float = 600, cwd: Path | None = None,
               stdin: bytes | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(["docker", *args], env=self.env, capture_output=True, timeout=timeout, cwd=cwd,
                              input=stdin, check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} failed ({proc.returncode}):\n"
                               f"{proc.stdout.decode()[-3000:]}\n{proc.stderr.decode()[-3000:]}")
        return proc

    def compose(self, project: Path, *args: str, check: bool = True, timeout: float = 900
                ) -> subprocess.CompletedProcess:
        proc = subprocess.run(["docker-compose", "-p", "rtest", *args], env=self.env, cwd=project,
                              capture_output=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(f"docker-compose {' '.join(args)} failed ({proc.returncode}):\n"
                               f"{proc.stdout.decode()[-4000:]}\n{proc.stderr.decode()[-4000:]}")
        return proc

    def _allow_bridges(self) -> None:
        forward = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True, check=False)
        nf = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
        if forward.returncode == 0 and "-P FORWARD DROP" in forward.stdout and nf.exists() \
                and nf.read_text().strip() == "1":
            self._rule = ["FORWARD", "-i", "br-+", "-o", "br-+", "-j", "ACCEPT"]
            subprocess.run(["iptables", "-I", *self._rule], check=True)

    def close(self) -> list[str]:
        """Stop the containers and the engine, remove its directory; what was left running (described)."""
        if self.proc.poll() is None:
            ids = self.docker("ps", "-aq", check=False).stdout.decode().split()
            if ids:
                self.docker("rm", "-f", *ids, check=False, timeout=120)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        if self._rule is not None:
            subprocess.run(["iptables", "-D", *self._rule], check=False)
        left = [line for line in subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True,
                                                check=False).stdout.splitlines() if str(self.root) in line]
        for line in left:
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        for mount in reversed(Path("/proc/mounts").read_text().splitlines()):
            point = mount.split()[1]
            if point.startswith(str(self.root) + "/"):
                left.append(f"mount {point}")
                subprocess.run(["umount", "-l", point], capture_output=True, check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        return left


def base_image(engine: DockerEngine, work: Path) -> str:
    """Build and import :data:`BASE_IMAGE` (see the module's docstring); its name."""
    rootfs = work / "rootfs"
    subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                    "bookworm", str(rootfs), "http://deb.debian.org/debian"], check=True, capture_output=True,
                   timeout=900)
    wheels = rootfs / "opt" / "wheels"
    wheels.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels), *RUNTIME], check=True,
                   capture_output=True, timeout=900)
    subprocess.run(["chroot", str(rootfs), "python3", "-m", "venv", "/opt/venv"], check=True, capture_output=True)
    subprocess.run(["chroot", str(rootfs), "/opt/venv/bin/pip", "install", "-q", "--no-index", "--find-links",
                    "/opt/wheels", *RUNTIME], check=True, capture_output=True, timeout=900)
    for wheel in wheels.glob("torch-*.whl"):
        wheel.unlink()  # installed; the other wheels stay for the agent image's own pip (no index here)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    assert tar.stdout is not None
    imported = subprocess.run(
        ["docker", "import", "--change", "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
         "--change", "ENV PIP_NO_INDEX=1", "--change", "ENV PIP_FIND_LINKS=/opt/wheels", "-", BASE_IMAGE],
        stdin=tar.stdout, env=engine.env, capture_output=True, timeout=600, check=False)
    tar.stdout.close()
    tar.wait()
    if imported.returncode != 0:
        raise RuntimeError(f"docker import failed: {imported.stderr.decode()[-2000:]}")
    shutil.rmtree(rootfs, ignore_errors=True)
    return BASE_IMAGE


def server_images(engine: DockerEngine, images: dict[str, str]) -> None:
    """Tag stand-ins for the rendered file's server images (``{"etcd": name, "prometheus": name,
    "alertmanager": name}``) from this machine's Debian binaries, with the upstream entrypoints."""
    from resilient.chaos import cluster, monitor

    context = Path(tempfile.mkdtemp(prefix="resilient-standin-"))
    try:
        etcd, prometheus, alertmanager = cluster.etcd_binary(), monitor._binary("prometheus"), \
            monitor._binary("alertmanager")
        assert etcd and prometheus and alertmanager, "etcd, prometheus and alertmanager are installed by setup.sh"
        for src, name in ((etcd, "etcd"), (prometheus, "prometheus"), (alertmanager, "alertmanager")):
            shutil.copy(src, context / name)
        shutil.copytree("/usr/share/prometheus/alertmanager", context / "am-share",
                        ignore=shutil.ignore_patterns("ui"))
        (context / "Dockerfile").write_text(f"""FROM {BASE_IMAGE}
COPY etcd /usr/local/bin/etcd
COPY prometheus /bin/prometheus
COPY alertmanager /bin/alertmanager
COPY am-share /usr/share/prometheus/alertmanager
""")
        engine.docker("build", "-q", "-t", "resilient-test-servers", str(context))
        entry = {
            "etcd": "",
            "prometheus": 'ENTRYPOINT ["/bin/prometheus"]\nCMD ["--config.file=/etc/prometheus/prometheus.yml", '
                          '"--storage.tsdb.path=/prometheus"]',
            "alertmanager": 'ENTRYPOINT ["/bin/alertmanager"]\nCMD ["--config.file=/etc/alertmanager/alertmanager.yml",'
                            ' "--storage.path=/alertmanager"]',
        }
        for kind, tag in images.items():
            engine.docker("build", "-q", "-t", tag, "-", stdin=f"FROM resilient-test-servers\n{entry[kind]}\n".encode())
    finally:
        shutil.rmtree(context, ignore_errors=True)
