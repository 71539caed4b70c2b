"""The rendered compose stack up under a real Docker engine, with images built here (no registry is reachable).

The test starts its own dockerd (:mod:`tests.docker_engine`), builds the agent image from the rendered
Dockerfile on a Debian base made by debootstrap, tags stand-ins for the etcd, Prometheus and Alertmanager
images from this machine's Debian binaries, and brings up the rendered ``docker-compose.yml``: etcd, moto's S3
server, Prometheus, Alertmanager, two agents and a spare. A 2-node training runs through it; one node's
container is killed mid-run and the spare takes its ranks; the run completes, Prometheus scraped every agent,
and ``down -v`` leaves no container, volume or engine process behind.

What the test changes in the rendered files, as a user would by hand: the published ports (free loopback
ones), the build's ``BASE`` argument and Prometheus's scrape interval (2 s instead of 15 s, so that a scrape is
sure to fall inside the short run); Grafana is left out (no image of it can be made here).
"""

from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from resilient.chaos.monitor import free_port
from resilient.deploy.render import ETCD_IMAGE, render
from resilient.deploy.topology import load_topology

from . import docker_engine

ROOT = Path(__file__).resolve().parent.parent
RUN = "compose"
STEPS = 300


@pytest.fixture(scope="module")
def engine():
    missing = docker_engine.missing()
    assert not missing, f"not installed: {missing} (scripts/setup.sh --for tests installs them)"
    root = Path(tempfile.mkdtemp(prefix="rdocker-"))  # short: dockerd's sockets live under it
    engine = docker_engine.DockerEngine(root)
    work = Path(tempfile.mkdtemp(prefix="resilient-base-"))
    try:
        docker_engine.base_image(engine, work)
        docker_engine.server_images(engine, {"etcd": ETCD_IMAGE, "prometheus": "prom/prometheus:v2.42.0",
                                             "alertmanager": "prom/alertmanager:v0.25.0"})
        yield engine
    finally:
        shutil.rmtree(work, ignore_errors=True)
        left = engine.close()
        assert left == [], left


def stack(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    """The rendered compose files for a 2-node run with a spare, its build context filled, ports made free."""
    topology = tmp_path / "topology.toml"
    topology.write_text(f"""
[run]
id = "{RUN}"
script = "resilient.chaos.workload"
module = true
args = ["--steps", "{STEPS}", "--every", "20", "--out", "/work/runs/{RUN}/out", "--ckpt", "/work/runs/{RUN}/ckpt",
        "--step-sleep", "0.05"]
workdir = "/work"
image = "resilient-agent:test"

[nodes]
count = 2
nproc_per_node = 1
spares = 1

[checkpoint]
dir = "/work/runs/{RUN}/ckpt"
""")
    out = tmp_path / "stack"
    for rel, text in render(load_topology(topology), "compose", assets=ROOT / "dashboards").items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    src = out / "resilient-src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("resilient", "dashboards"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (out / "work").mkdir()
    doc = yaml.safe_load((out / "docker-compose.yml").read_text())
    services = doc["services"]
    del services["grafana"]
    ports = {}
    for name, inside in (("prometheus", 9090), ("alertmanager", 9093)):
        ports[name] = free_port()
        services[name]["ports"] = [f"127.0.0.1:{ports[name]}:{inside}"]
    for name, service in services.items():
        if "build" in service:
            service["build"]["args"] = {"BASE": docker_engine.BASE_IMAGE}
    (out / "docker-compose.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    prometheus = yaml.safe_load((out / "prometheus.yml").read_text())
    prometheus["global"]["scrape_interval"] = "2s"
    (out / "prometheus.yml").write_text(yaml.safe_dump(prometheus, sort_keys=False))
    return out, ports


def query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        return list(json.load(r)["data"]["result"])


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def up_by_instance(port: int, expr: str = "up") -> dict[str, str]:
    return {s["metric"]["instance"]: s["value"][1] for s in query(port, expr)}


def read(engine: docker_engine.DockerEngine, project: Path, path: str) -> str:
    """A file of the run volume, copied out of node0's container (``docker cp``, a tar stream: the bytes as they
    are; a one-off container's output through ``docker-compose run`` came back with a line broken in two)."""
    cid = engine.compose(project, "ps", "-q", "node0").stdout.decode().strip()
    proc = engine.docker("cp", f"{cid}:{path}", "-", check=False, timeout=120)
    if proc.returncode != 0:
        return ""
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as archive:
        [member] = archive.getmembers()
        data = archive.extractfile(member)
        assert data is not None, member
        return data.read().decode()


def exit_code(engine: docker_engine.DockerEngine, project: Path, service: str) -> int | None:
    cid = engine.compose(project, "ps", "-q", service).stdout.decode().strip()
    state = json.loads(engine.docker("inspect", cid).stdout)[0]["State"]
    return None if state["Running"] else int(state["ExitCode"])


# The engine's images are built in the module fixture, which this test's timeout covers: debootstrap, pip and
# docker import take about 130 s here, the stack's build and run about 100 s (a CI run took over 300 s).
@pytest.mark.timeout(900)
def test_the_rendered_stack_trains_two_nodes_through_a_lost_node_with_its_spare(engine, tmp_path):
    project, ports = stack(tmp_path)
    engine.compose(project, "build")
    try:
        # The servers first, Prometheus ready, then the agents: Prometheus (the stand-in with the rendered
        # configuration) must scrape every agent by its service name, the node to be lost included, before it is
        # lost, and the run is short.
        engine.compose(project, "up", "-d", "etcd", "s3", "prometheus", "alertmanager")
        deadline = time.monotonic() + 120
        while not ready(ports["prometheus"]):
            assert time.monotonic() < deadline, engine.compose(project, "logs", "--tail", "30", check=False).stdout
            time.sleep(0.5)
        engine.compose(project, "up", "-d")
        agents = {"node0:9400": "1", "node1:9400": "1", "spare0:9400": "1"}
        deadline = time.monotonic() + 240
        while up_by_instance(ports["prometheus"]) != agents:
            assert time.monotonic() < deadline, (up_by_instance(ports["prometheus"]), engine.compose(
                project, "logs", "--tail", "30", check=False).stdout)
            time.sleep(0.5)
        ckpt = f"/work/runs/{RUN}/ckpt"

        def newest_commit() -> int:
            # Any commit from step 60 on, not step 60's own: retention drops it 3 commits later (3 s of training),
            # less than a few of these one-off containers take to list the directory on a loaded machine.
            names = engine.compose(project, "run", "--rm", "--no-deps", "-T", "--entrypoint", "ls", "node0", ckpt,
                                   check=False, timeout=120).stdout.decode().split()
            return max((int(n.split("_")[1]) for n in names if re.fullmatch(r"step_\d{10}", n)), default=-1)

        deadline = time.monotonic() + 240
        while (newest := newest_commit()) < 60:
            assert time.monotonic() < deadline, engine.compose(project, "logs", "--tail", "30", check=False).stdout
            time.sleep(2)
        assert newest < STEPS, f"the run had finished (step {newest} committed) before its node could be lost"
        engine.compose(project, "kill", "node1")  # a machine lost, with its agent
        deadline = time.monotonic() + 300
        while exit_code(engine, project, "node0") is None or exit_code(engine, project, "spare0") is None:
            assert time.monotonic() < deadline, engine.compose(project, "logs", "--tail", "40", check=False).stdout
            time.sleep(2)
        logs = engine.compose(project, "logs", "--no-color", check=False).stdout.decode()
        assert exit_code(engine, project, "node0") == 0 and exit_code(engine, project, "spare0") == 0, logs[-6000:]
        final = json.loads(read(engine, project, f"/work/runs/{RUN}/out/final.json"))
        assert final["step"] == STEPS and final["world"] == 2, final
        events = [json.loads(line) for line in read(engine, project, f"/work/runs/{RUN}/events.jsonl").splitlines()]
        kinds = [e["kind"] for e in events]
        assert "node_lost" in kinds, kinds
        rungs = [e.get("action") for e in events if e["kind"] == "recovery_decided"]
        assert "promote_spare" in rungs, (rungs, kinds)
        trace = [json.loads(line) for line in read(engine, project, f"/work/runs/{RUN}/out/trace.jsonl").splitlines()]
        # Every step trained by the world (the lost node may have died after a step's all-reduce, before writing
        # its line), and none twice: the spare took the lost ranks in process.
        assert {t["step"] for t in trace} == set(range(STEPS)), "every step was trained"
        for rank in (0, 1):
            mine = [t["step"] for t in trace if t["rank"] == rank]
            assert len(mine) == len(set(mine)), f"rank {rank} re-did steps"
        # The lost node shows as down to whoever is on call; the others were up to the end of the run.
        assert up_by_instance(ports["prometheus"])["node1:9400"] == "0"
        assert up_by_instance(ports["prometheus"], "max by (instance) (max_over_time(up[10m]))") == agents
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['alertmanager']}/-/ready", timeout=5) as r:
            assert r.status == 200
    finally:
        engine.compose(project, "down", "-v", "--remove-orphans", check=False)
    assert engine.docker("ps", "-aq").stdout.decode().split() == []
    assert engine.docker("volume", "ls", "-q").stdout.decode().split() == []
