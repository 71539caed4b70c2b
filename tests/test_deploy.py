"""``resilient deploy render``: the topology file, and each target's files checked by the tools that read them.

Kubernetes manifests by ``kubernetes-validate --strict`` (its schemas are offline), the PrometheusRule's
rules by ``promtool``, the compose file by ``docker-compose config -q``, the Slurm scripts by ``shellcheck``;
every agent command a target starts is parsed by ``resilient run``'s own parser.  The files under
``deploy/`` and ``agents/`` are the example topologies' renders, kept current here.
"""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from resilient.cli.main import build_parser
from resilient.deploy.render import KUBERNETES_VERSION, TARGETS, render
from resilient.deploy.topology import TopologyError, load_topology, parse_topology
from resilient.core.exitcodes import EXIT_CONFIG, EXIT_PREEMPTED_AGENT, EXIT_STOPPED, EXIT_UNRECOVERABLE

from .agent_helpers import agent_env

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "dashboards"
EXAMPLE = ROOT / "deploy" / "topology.toml"
HOSTS = ROOT / "agents" / "topology.toml"
PROMTOOL = ROOT / ".servers" / "usr" / "bin" / "promtool"


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resilient", "deploy", *args], capture_output=True, text=True,
                          timeout=60, env=agent_env(), check=False, cwd=cwd)


def tool(name: str) -> str:
    """A validating tool the tests need: scripts/setup.sh --for tests installs it; missing is a failure."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    assert found, f"{name} is not installed: run scripts/setup.sh --for tests"
    return found


def run_args(words: list[str]) -> object:
    """``words`` (after ``resilient``) parsed by the real ``resilient run`` parser: an error exits."""
    assert words[0] == "run", words
    return build_parser().parse_args(words)


MINIMAL = {"run": {"id": "r", "script": "train.py"}}


@pytest.mark.parametrize(("raw", "message"), [
    ({"run": {"id": "r", "script": "t.py"}, "node": {}}, "[node]: unknown table"),
    ({"run": {"id": "r", "script": "t.py", "scrpt": 1}}, "[run] scrpt: unknown key; [run] has"),
    ({"run": {"script": "t.py"}}, "[run] id: missing"),
    ({"run": {"id": "Big_Run", "script": "t.py"}}, "use 1 to 40 lower-case letters"),
    ({**MINIMAL, "nodes": {"count": "4:2"}}, "MIN:MAX needs 1 <= MIN <= MAX"),
    ({**MINIMAL, "nodes": {"count": 0}}, "[nodes] count = 0: must be an integer >= 1"),
    ({**MINIMAL, "nodes": {"nproc_per_node": True}}, "must be an integer >= 1"),
    ({**MINIMAL, "store": {"etcd": ["10.0.0.5"]}}, "is not HOST:PORT"),
    ({**MINIMAL, "slurm": {"nodes": "4"}}, "set by the rendered script from the topology"),
    ({**MINIMAL, "metrics": {"port": 70000}}, "a port is at most 65535"),
    ({**MINIMAL, "run": {"id": "r", "script": "t.py", "args": "--x"}}, "[run] args = '--x': must be a list"),
])
def test_a_bad_topology_is_refused_with_the_key_and_the_fix(raw, message):
    with pytest.raises(TopologyError) as err:
        parse_topology(raw)
    assert message in str(err.value)


def test_the_committed_examples_are_what_rendering_their_topologies_gives():
    for topology, targets in ((EXAMPLE, ("slurm", "k8s", "compose")), (HOSTS, ("systemd",))):
        t = load_topology(topology)
        for target in targets:
            out = topology.parent / target
            files = render(t, target, assets=ASSETS, source=topology.name)
            committed = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
            assert committed == sorted(files), (target, committed)
            for rel, text in files.items():
                assert (out / rel).read_text() == text, f"{out / rel} differs from a fresh render: render again"


def test_kubernetes_manifests_validate_strictly_and_the_rules_pass_promtool(tmp_path):
    out = ROOT / "deploy" / "k8s"
    validate = tool("kubernetes-validate")
    docs = [d for f in ("manifests.yaml", "dashboards.yaml", "monitoring.yaml", "pytorchjob.yaml", "quarantine.yaml")
            for d in yaml.safe_load_all((out / f).read_text())]
    native = ("manifests.yaml", "dashboards.yaml", "quarantine.yaml")
    done = subprocess.run([validate, "--strict", "-k", KUBERNETES_VERSION, *(str(out / f) for f in native)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "ERROR" not in done.stdout + done.stderr, done.stdout + done.stderr
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("StatefulSet", "demo-etcd"), ("Service", "demo-etcd"), ("Job", "demo-workers"), ("Job", "demo-spares"),
            ("PodMonitor", "demo-agents"), ("PrometheusRule", "demo-alerts"), ("ConfigMap", "demo-dashboards"),
            ("PyTorchJob", "demo-pytorchjob"), ("Deployment", "demo-quarantine-taints"),
            ("ClusterRole", "training-demo-quarantine-taints")} <= kinds, kinds
    passed = done.stdout + done.stderr
    for kind, name in kinds:
        if kind in ("StatefulSet", "Service", "Job", "ConfigMap", "PersistentVolumeClaim"):
            assert f"passed for resource {kind.lower()}/{name}" in passed, (kind, name, passed)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    # The Job follows the agents' exit codes: a verdict fails it, a disruption is not counted.
    rules = by[("Job", "demo-workers")]["spec"]["podFailurePolicy"]["rules"]
    # (The API server wants the codes in order: the schema does not say so.)
    assert rules[0]["action"] == "FailJob" and rules[0]["onExitCodes"]["values"] == sorted(
        [EXIT_STOPPED, EXIT_CONFIG, EXIT_UNRECOVERABLE])
    assert rules[1] == {"action": "Ignore", "onExitCodes": {"containerName": "agent", "operator": "In",
                                                             "values": [EXIT_PREEMPTED_AGENT]}}
    assert rules[2] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    # Every agent's pod shares the run directory (the token every node must have) on one ReadWriteMany volume.
    assert by[("PersistentVolumeClaim", "demo-runs")]["spec"]["accessModes"] == ["ReadWriteMany"]
    for name in ("demo-workers", "demo-spares"):
        pod = by[("Job", name)]["spec"]["template"]["spec"]
        assert pod["volumes"] == [{"name": "runs", "persistentVolumeClaim": {"claimName": "demo-runs"}}]
        assert pod["containers"][0]["volumeMounts"] == [{"name": "runs", "mountPath": "/work/runs"}]
    worker = by[("PyTorchJob", "demo-pytorchjob")]["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "Never" and worker["template"]["metadata"]["labels"]["resilient/agent"] == "true"
    # The PodMonitor and the headless Service select the agents' pods, and not etcd's.
    pod_labels = by[("Job", "demo-workers")]["spec"]["template"]["metadata"]["labels"]
    etcd_labels = by[("StatefulSet", "demo-etcd")]["spec"]["template"]["metadata"]["labels"]
    for selector in (by[("PodMonitor", "demo-agents")]["spec"]["selector"]["matchLabels"],
                     by[("Service", "demo-agents")]["spec"]["selector"]):
        assert selector.items() <= pod_labels.items() and not selector.items() <= etcd_labels.items()
    # The PrometheusRule is the shipped alert rules, and promtool accepts them.
    groups = by[("PrometheusRule", "demo-alerts")]["spec"]["groups"]
    assert groups == yaml.safe_load((ASSETS / "prometheus" / "alerts.yml").read_text())["groups"]
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": groups}))
    checked = subprocess.run([str(PROMTOOL), "check", "rules", str(tmp_path / "rules.yml")], capture_output=True,
                             text=True, timeout=60, check=False)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    # Every agent: a command `resilient run` accepts, node ids from the Job index, spares with --role spare.
    for name, role in (("demo-workers", None), ("demo-spares", "spare")):
        [container] = by[("Job", name)]["spec"]["template"]["spec"]["containers"]
        args = run_args(container["args"])
        assert args.role == (role or "worker") and args.store.count(".demo-etcd.training.svc:2379") == 3
        assert args.node_id == "$(NODE_NAME)" and args.local_addr == "$(POD_IP)"
        assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in container["env"]
        assert (args.nnodes, args.nproc_per_node, args.metrics_port) == ("2", "2", 9400)
        affinity = by[("Job", name)]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        [term] = affinity["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname" and term["labelSelector"]["matchLabels"].items() \
            <= by[("Job", "demo-workers")]["spec"]["template"]["metadata"]["labels"].items()
    # The quarantine's taints: a command the CLI accepts, with the agents' store and fleet, and only node rights.
    taints = by[("Deployment", "demo-quarantine-taints")]["spec"]["template"]["spec"]
    [container] = taints["containers"]
    parsed = build_parser().parse_args(container["args"])
    assert (parsed.action, parsed.fleet, parsed.store) == ("taints", "default", args.store)
    [rule] = by[("ClusterRole", "training-demo-quarantine-taints")]["rules"]
    assert rule == {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]}


def test_the_slurm_scripts_and_ours_pass_shellcheck_and_start_the_agents_the_agent_accepts():
    out = ROOT / "deploy" / "slurm"
    scripts = [out / "demo.sbatch", out / "prolog.sh", *sorted((ROOT / "scripts").glob("*.sh")), ROOT / ".ci" / "run"]
    checked = subprocess.run([tool("shellcheck"), "--severity=style", *map(str, scripts)], capture_output=True,
                             text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    script = (out / "demo.sbatch").read_text()
    assert "#SBATCH --nodes=3" in script and "#SBATCH --requeue" in script and "#SBATCH --partition=debug" in script
    [line] = [x for x in script.splitlines() if "-m resilient run" in x]
    words = shlex.split(line.split("-m resilient ", 1)[1].replace('"${role[@]}"', "--role spare")
                        .replace('"${store[@]}"', '--store "$STORE"'))
    args = run_args(words)
    assert args.role == "spare" and args.node_id == "$SLURMD_NODENAME" and args.store == "$STORE"
    assert args.burn_in and args.health_path == ["/work/runs/demo/ckpt"]
    # The exit codes: a verdict is not requeued, a preemption and an agent's crash are.
    verdict = script[script.index(f"    {EXIT_STOPPED}|"):]
    assert "not requeued" in verdict.split(";;")[0] and "scontrol requeue" not in verdict.split(";;")[0]


def test_the_compose_file_is_valid_and_scrapes_every_agent(tmp_path):
    out = ROOT / "deploy" / "compose"
    done = subprocess.run([tool("docker-compose"), "-f", str(out / "docker-compose.yml"), "config", "-q"],
                          capture_output=True, text=True, timeout=60, check=False, cwd=out)
    assert done.returncode == 0, done.stdout + done.stderr
    compose = yaml.safe_load((out / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"etcd", "node0", "node1", "spare0", "s3", "prometheus", "alertmanager", "grafana"} <= set(services)
    assert run_args(services["spare0"]["command"]).role == "spare" and services["node0"]["entrypoint"] == ["resilient"]
    assert run_args(services["node1"]["command"]).node_id == "node1"
    scrape = yaml.safe_load((out / "prometheus.yml").read_text())["scrape_configs"][0]["static_configs"][0]
    assert scrape["targets"] == ["node0:9400", "node1:9400", "spare0:9400"]
    # promtool checks the configuration with its rule file (mounted in the container; here, the copy beside it).
    local = tmp_path / "prometheus.yml"
    local.write_text((out / "prometheus.yml").read_text().replace("/etc/prometheus/alerts.yml",
                                                                 str(out / "alerts.yml")))
    checked = subprocess.run([str(PROMTOOL), "check", "config", str(local)], capture_output=True, text=True,
                             timeout=60, check=False)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    assert (out / "alerts.yml").read_text() == (ASSETS / "prometheus" / "alerts.yml").read_text()


def test_systemd_units_start_the_agent_and_keep_a_verdict_final():
    out = ROOT / "agents" / "systemd"
    for unit, role in (("resilient-demo.service", "worker"), ("resilient-demo-spare.service", "spare")):
        ini = configparser.ConfigParser(interpolation=None, strict=True)
        ini.read_string((out / unit).read_text())
        service = ini["Service"]
        words = shlex.split(service["ExecStart"].replace("%H", "host1"))
        assert words[:3] == ["/srv/train/.venv/bin/python", "-m", "resilient"]
        args = run_args(words[3:])
        assert args.role == role and args.node_id == "host1" and args.store.startswith("etcd://10.0.0.5:2379,")
        assert str(args.token_file) == "/etc/resilient/demo.token"
        assert set(service["RestartPreventExitStatus"].split()) >= {str(EXIT_STOPPED), str(EXIT_CONFIG)}
        assert service["Restart"] == "on-failure" and service["EnvironmentFile"] == "-/etc/resilient/demo.env"
    assert "RESILIENT_S3_ENDPOINT_URL=http://10.0.0.9:9000" in (out / "demo.env").read_text()
    # systemd would expand $ and % in ExecStart: a script's own are doubled, and only the node id is %H.
    t = load_topology(HOSTS)
    odd = render(parse_topology({"run": {"id": "x", "script": "t.py", "args": ["--fmt", "%H:$HOME 100%"]},
                                 "store": {"etcd": list(t.etcd)}}), "systemd", assets=ASSETS)
    assert '--fmt "%%H:$$HOME 100%%"' in odd["resilient-x.service"] and "--node-id %H " in odd["resilient-x.service"]
    # Hosts need etcd beside them: a multi-node topology without endpoints is refused, saying so.
    with pytest.raises(Exception, match="needs \\[store\\] etcd endpoints"):
        render(load_topology(EXAMPLE), "systemd", assets=ASSETS)


def test_render_writes_every_target_and_never_over_a_users_edits(tmp_path):
    for target in TARGETS:
        topology = HOSTS if target == "systemd" else EXAMPLE
        done = cli("render", "--target", target, str(topology), "--out", str(tmp_path / target))
        assert done.returncode == 0, done.stderr
    assert (tmp_path / "slurm" / "demo.sbatch").stat().st_mode & 0o111
    edited = tmp_path / "k8s" / "manifests.yaml"
    edited.write_text("# mine\n")
    again = cli("render", "--target", "k8s", str(EXAMPLE), "--out", str(tmp_path / "k8s"))
    assert again.returncode == 2 and "already has" in again.stderr and "--force" in again.stderr
    assert edited.read_text() == "# mine\n"
    forced = cli("render", "--target", "k8s", str(EXAMPLE), "--out", str(tmp_path / "k8s"), "--force")
    assert forced.returncode == 0 and edited.read_text() != "# mine\n"
    bad = tmp_path / "bad.toml"
    bad.write_text("[run]\nid = 'x'\n")
    refused = cli("render", "--target", "slurm", str(bad), "--out", str(tmp_path / "x"))
    assert refused.returncode == 2 and "bad.toml: [run] script: missing" in refused.stderr


def test_under_slurm_the_agent_takes_its_run_node_and_launch_from_the_job():
    from resilient.cli.run_cmd import build_config

    slurm = {"SLURM_JOB_ID": "812", "SLURM_RESTART_COUNT": "2", "SLURMD_NODENAME": "gpu17"}
    config = build_config(build_parser().parse_args(["run", "--store", "etcd://h:2379", "-m", "json.tool"]), slurm)
    assert (config.run_id, config.node_id, config.launch_id) == ("slurm-812", "gpu17", "slurm-812-2")
    given = build_config(build_parser().parse_args(["run", "--run-id", "r", "--node-id", "n", "-m", "json.tool"]),
                         slurm)
    assert (given.run_id, given.node_id) == ("r", "n")
    with pytest.raises(Exception, match="--store needs --run-id"):
        build_config(build_parser().parse_args(["run", "--store", "etcd://h:2379", "-m", "json.tool"]), {})
