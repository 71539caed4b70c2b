"""One topology, four targets: the files a user deploys (and may edit), with the same meaning everywhere.

Every target starts one ``resilient run`` agent per node (``--node-id`` a
stable name, ``--nnodes`` and ``--nproc-per-node`` from the topology) and
one ``--role spare`` agent per spare node; every agent meets the others
through etcd (the topology's endpoints, or an etcd the target runs itself)
and serves its metrics on ``[metrics] port``.  What each target adds:

- ``slurm``: an sbatch script that keeps the spare nodes in the allocation,
  starts etcd on the first node when no endpoints are given, runs the
  agents with ``srun``, and maps the agents' exit codes to a requeue (see
  :data:`SLURM_EXITS`); a prolog that runs the node burn-in.
- ``k8s``: a 3-member etcd StatefulSet with its headless Service (when no
  endpoints are given), the workers as an indexed Job whose pod failure
  policy follows the same exit codes, the spare pods, a PodMonitor, a
  PrometheusRule made from the shipped alert rules, and the dashboards as
  a ConfigMap.
- ``compose``: a test cluster: etcd, Prometheus scraping every agent,
  Alertmanager, Grafana provisioned with the dashboards, an S3-compatible
  store (moto's server), the agents and the spares, and a Dockerfile for
  the agent image.
- ``systemd``: a unit for a worker host and one for a spare host, and the
  environment file both read.

Pure: :func:`render` returns the files (relative path -> text); writing them
is the CLI's.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..exitcodes import EXIT_CONFIG, EXIT_PREEMPTED_AGENT, EXIT_STOPPED, EXIT_UNHEALTHY, EXIT_UNRECOVERABLE
from .taints import TAINT_KEY
from .topology import Topology

TARGETS = ("slurm", "k8s", "compose", "systemd")
NO_RESTART = (EXIT_STOPPED, EXIT_CONFIG, EXIT_UNRECOVERABLE)
"""The agents' final exit codes: a verdict, and the workers' do-not-restart codes it passes on."""
ETCD_IMAGE = "gcr.io/etcd-development/etcd:v3.5.17"
KUBERNETES_VERSION = "1.30.0"
"""The Kubernetes version the manifests are validated against (``kubernetes-validate --strict``)."""
SLURM_EXITS = {
    0: "the run finished: the job ends",
    EXIT_PREEMPTED_AGENT: "the agents checkpointed and stopped (the time limit's SIGTERM, 120 s before it): "
                          "requeued, however many times, it resumes from the newest commit (a preemption, "
                          "`scontrol requeue` or scancel ends the job from Slurm's side, which requeues it or not; "
                          "give KillWait and GraceTime at least the agents' --preempt-grace, 60 s, so the "
                          "agents can checkpoint first)",
    EXIT_UNHEALTHY: "a node failed its health check: requeued without that node",
    EXIT_STOPPED: "stopped with a verdict (restart budget spent, crash loop, a worker's do-not-restart code): "
                  "not requeued",
}
"""What the sbatch script does with the agents' exit status (each agent's, from a file it writes: a verdict on
any node decides, then an unhealthy node, then a stop, then a 0 on any node: the run finished); any other status (an agent that crashed or
was killed) is requeued while ``SLURM_RESTART_COUNT`` (which counts every requeue, the time limit's too) is under
the topology's max_restarts."""
HEADER = "Rendered by `resilient deploy render` from {source}; edit freely (render again to start over)."


def render(topology: Topology, target: str, *, assets: Path, source: str = "topology.toml") -> dict[str, str]:
    """The files of ``target`` for ``topology``; ``assets`` is the shipped ``dashboards/`` folder."""
    builders: dict[str, Callable[[Topology, Path, str], dict[str, str]]] = {
        "slurm": _slurm, "k8s": _k8s, "compose": _compose, "systemd": _systemd}
    if target not in builders:
        raise ConfigError(f"--target {target!r}: use one of {', '.join(TARGETS)}")
    return builders[target](topology, assets, HEADER.format(source=source))


def agent_args(t: Topology, *, node_id: str, store: str | None, spare: bool = False,
               local_addr: str | None = None, run_dir: str | None = None, burn_in: bool = False) -> list[str]:
    """``resilient run`` options and the script, for one agent (the words after ``resilient``)."""
    args = ["run", "--run-id", t.run_id, "--node-id", node_id, "--nnodes", t.node_range,
            "--nproc-per-node", str(t.nproc_per_node), "--max-restarts", str(t.max_restarts),
            "--metrics-port", str(t.metrics_port), "--metrics-addr", t.metrics_addr]
    if store:
        args += ["--store", store]
    if spare:
        args += ["--role", "spare"]
    if local_addr:
        args += ["--local-addr", local_addr]
    if run_dir:
        args += ["--run-dir", run_dir]
    if t.checkpoint_dir and "://" not in t.checkpoint_dir:
        args += ["--health-path", t.checkpoint_dir]
    if burn_in:
        args += ["--burn-in"]
    args += list(t.extra_agent_args)
    args += (["-m"] if t.module else []) + [t.script, *t.args]
    return args


def _store_url(endpoints: list[str]) -> str:
    return "etcd://" + ",".join(endpoints)


def _env(t: Topology) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}
    if t.checkpoint_endpoint:
        env["RESILIENT_S3_ENDPOINT_URL"] = t.checkpoint_endpoint
        env["AWS_ENDPOINT_URL_S3"] = t.checkpoint_endpoint
    return env


def _yaml(docs: list[dict[str, Any]], header: str) -> str:
    try:
        import yaml
    except ImportError as e:
        raise ConfigError("rendering YAML needs PyYAML: pip install 'resilient-train[deploy]'") from e

    class Plain(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:  # every value written out: a hand-editable file
            return True

    body = "---\n".join(yaml.dump(d, Dumper=Plain, sort_keys=False, default_flow_style=False, width=110)
                         for d in docs)
    return f"# {header}\n{body}"


def _alert_groups(assets: Path) -> list[dict[str, Any]]:
    import yaml

    path = assets / "prometheus" / "alerts.yml"
    try:
        return list(yaml.safe_load(path.read_text())["groups"])
    except (OSError, KeyError, TypeError) as e:
        raise ConfigError(f"cannot read the shipped alert rules at {path} ({e}); reinstall resilient-train") from e


# ---------------------------------------------------------------------------------------------------- slurm
def _slurm(t: Topology, assets: Path, header: str) -> dict[str, str]:
    q = shlex.quote
    options = {"job-name": t.run_id, "nodes": str(t.total_nodes), "ntasks-per-node": "1",
               "output": f"{t.workdir}/slurm-{t.run_id}-%j.out", "open-mode": "append", **t.slurm}
    sbatch = "\n".join(f"#SBATCH --{k}={v}" for k, v in options.items())
    agent = " ".join(q(a) for a in agent_args(t, node_id="__NODE__", store="__STORE__", spare=True,
                                                local_addr="__ADDR__", run_dir="__RUNDIR__", burn_in=not t.embedded))
    agent = (agent.replace("--role spare", '"${role[@]}"').replace("--store __STORE__", '"${store[@]}"')
             .replace("__NODE__", '"$SLURMD_NODENAME"').replace("__ADDR__", '"$addr"')
             .replace("__RUNDIR__", '"$RUN_DIR"'))
    exits = "\n".join(f"#   {code:>3}  {what}" for code, what in SLURM_EXITS.items())
    env = "\n".join(f"export {k}={q(v)}" for k, v in _env(t).items())
    if t.etcd:
        etcd = f'STORE={q(_store_url(list(t.etcd)))}\n'
    elif t.embedded:
        etcd = "# One node and no etcd in the topology: the agent's embedded store.\nSTORE=\n"
    else:
        etcd = f'''# No etcd in the topology: one member on the first node of the allocation, for this job only.
first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
first_addr=$(node_addr "$first")
if [ -z "$first_addr" ]; then
    echo "resilient: no address for node $first (its NodeAddr in slurm.conf, or its name, does not resolve)" >&2
    exit {EXIT_CONFIG}
fi
ETCD_DIR=${{ETCD_DIR:-/tmp/resilient-etcd-$SLURM_JOB_ID}}
ETCD_PORT=${{ETCD_PORT:-2379}}
ETCD_PEER_PORT=${{ETCD_PEER_PORT:-2380}}
srun --nodes=1 --ntasks=1 -w "$first" --overlap "${{ETCD:-etcd}}" --name {q(t.run_id)} \\
    --data-dir "$ETCD_DIR" --listen-client-urls "http://$first_addr:$ETCD_PORT" \\
    --advertise-client-urls "http://$first_addr:$ETCD_PORT" --listen-peer-urls "http://$first_addr:$ETCD_PEER_PORT" \\
    --initial-advertise-peer-urls "http://$first_addr:$ETCD_PEER_PORT" \\
    --initial-cluster "{t.run_id}=http://$first_addr:$ETCD_PEER_PORT" >"$RUN_DIR/etcd-$SLURM_JOB_ID.log" 2>&1 &
etcd_pid=$!
trap 'kill "$etcd_pid" 2>/dev/null' EXIT
STORE="etcd://$first_addr:$ETCD_PORT"
'''
    script = f'''#!/bin/bash
# {header}
#
# One `resilient run` agent per node: the first {t.nodes} node(s) train ({t.nproc_per_node} process(es) each),
# the last {t.spare_nodes} stand by as spare nodes (--role spare) and take a lost node's ranks.
# The agents' exit status decides what Slurm does next:
{exits}
#   other  an agent crashed or was killed: requeued while SLURM_RESTART_COUNT < {t.max_restarts}
# `resilient run` reads SLURM_JOB_ID and SLURM_RESTART_COUNT: a requeued job is a new launch of the same
# run, which resumes from the newest committed checkpoint.
{sbatch}
#SBATCH --requeue
#SBATCH --signal=B:TERM@120
set -uo pipefail
cd {q(t.workdir)} || exit 1
RUN_DIR={q(f"{t.workdir}/runs/{t.run_id}")}
mkdir -p "$RUN_DIR"
{env}
# A node's address: Slurm's NodeAddr for it (its name, unless slurm.conf gives another), resolved (an IP as it is).
node_addr() {{
    local a
    a=$(scontrol show node "$1" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | head -n 1 | cut -d= -f2)
    {{ getent ahostsv4 "${{a:-$1}}" || getent ahosts "${{a:-$1}}"; }} | awk '{{print $1; exit}}'
}}
{etcd}
# The time limit's warning (--signal=B:TERM@120) reaches this script: SIGTERM to the agents, which checkpoint
# and stop (exit {EXIT_PREEMPTED_AGENT}).  A preemption, `scontrol requeue` or scancel signal the job steps themselves.
trap 'kill -TERM "$srun_pid" 2>/dev/null' TERM
# One agent per node; the last {t.spare_nodes} node(s) of the allocation are the spares.  Each writes its exit
# status to a file of its own: srun's status is only the highest of them.
EXITS="$RUN_DIR/exits-$SLURM_JOB_ID-${{SLURM_RESTART_COUNT:-0}}"
rm -rf "$EXITS" && mkdir -p "$EXITS"
# shellcheck disable=SC2317  # run on every node by srun, through bash -c
agent() {{
    local addr role=() store=() code
    [ -z "$STORE" ] || store=(--store "$STORE")
    addr=$(node_addr "$SLURMD_NODENAME")
    [ -n "$addr" ] || addr=$(hostname -I | awk '{{print $1}}')
    if [ "$SLURM_NODEID" -ge {t.nodes} ]; then
        role=(--role spare)
    fi
    {q(t.python)} -m resilient {agent}
    code=$?
    echo "$code $SLURMD_NODENAME" >"$EXITS/$SLURM_NODEID"
    return "$code"
}}
export -f agent node_addr
export STORE RUN_DIR EXITS
srun --overlap --kill-on-bad-exit=0 --ntasks-per-node=1 --nodes={t.total_nodes} bash -c agent &
srun_pid=$!
wait "$srun_pid"
status=$?
while kill -0 "$srun_pid" 2>/dev/null; do  # a trapped signal interrupted the first wait
    wait "$srun_pid"
    status=$?
done
# The job's verdict from every agent's: a verdict anywhere stops it; then an unhealthy node; then a stop; then a
# 0 is the run finished (a node lost on the way, its spare having taken over, does not requeue it); with none
# of those, a node that wrote nothing (its agent killed) is a crash, srun's status.
codes=$(cat "$EXITS"/* 2>/dev/null | awk '{{print $1}}' | sort -u | paste -sd' ' -)
for verdict in {EXIT_STOPPED} {EXIT_CONFIG} {EXIT_UNRECOVERABLE} {EXIT_UNHEALTHY} {EXIT_PREEMPTED_AGENT} 0; do
    if [[ " $codes " == *" $verdict "* ]]; then
        status=$verdict
        break
    fi
done
restarts=${{SLURM_RESTART_COUNT:-0}}
state=$(squeue -h -j "$SLURM_JOB_ID" -o %T 2>/dev/null)
if [ "$status" != 0 ] && [ -n "$state" ] && [ "$state" != RUNNING ]; then
    # Slurm itself is ending this job (a preemption, `scontrol requeue`, scancel): it requeues, or not.
    echo "resilient: agents exited $status while Slurm ends the job ($state): left to Slurm"
    exit "$status"
fi
case "$status" in
    0)
        echo "resilient: run {t.run_id} finished" ;;
    {EXIT_STOPPED}|{EXIT_CONFIG}|{EXIT_UNRECOVERABLE})
        echo "resilient: run {t.run_id} stopped with a verdict (exit $status): not requeued; see $RUN_DIR" ;;
    {EXIT_UNHEALTHY})
        bad=$(grep -h "^{EXIT_UNHEALTHY} " "$EXITS"/* | awk '{{print $2}}' | sort -u | paste -sd, -)
        echo "resilient: unhealthy node(s) stepped out ($bad): requeued without them"
        scontrol requeuehold "$SLURM_JOB_ID"  # a pending job's node list can be changed, a running one's not
        scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$bad"
        scontrol release "$SLURM_JOB_ID" ;;
    {EXIT_PREEMPTED_AGENT})
        echo "resilient: the agents checkpointed and stopped (the time limit's signal): requeued"
        scontrol requeue "$SLURM_JOB_ID" ;;
    *)
        if [ "$restarts" -lt {t.max_restarts} ]; then
            echo "resilient: agents exited $status: requeued (restart $((restarts + 1)) of {t.max_restarts})"
            scontrol requeue "$SLURM_JOB_ID"
        else
            echo "resilient: agents exited $status after $restarts requeues: not requeued"
        fi ;;
esac
exit "$status"
'''
    python = t.python if t.python.startswith("/") else f"/usr/bin/{t.python}"
    partition = t.slurm.get("partition")
    only = ("# Only jobs of the partition this run uses (a prolog is the whole cluster's, and gets no job name).\n"
            f'[ "${{SLURM_JOB_PARTITION:-}}" = {q(partition)} ] || exit 0\n') if partition else ""
    prolog = f'''#!/bin/bash
# {header}
#
# A Slurm prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/resilient.sh) that runs the node burn-in
# measurement (a matmul, a disk write with fsync, a local gloo all-reduce) before a job starts here.  A node
# that cannot do them fails the prolog: Slurm drains it (the reason is in slurmd's log) and requeues the job,
# held.  The agents (started with --burn-in) also judge each node's numbers against the fleet's.
set -uo pipefail
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin  # a prolog gets no search path
{only}scratch=${{RESILIENT_BURNIN_SCRATCH:-/tmp}}/resilient-burnin-$SLURM_JOB_ID
mkdir -p "$scratch"
if ! report=$({q(python)} -m resilient.watchdog.burnin --scratch "$scratch" 2>&1); then
    rm -rf "$scratch"
    echo "resilient burn-in failed on $(hostname): ${{report:0:400}}" >&2
    exit 1
fi
rm -rf "$scratch"
exit 0
'''
    readme = f'''# Slurm: run {t.run_id}

{header}

```bash
sbatch {t.run_id}.sbatch          # {t.total_nodes} node(s): {t.nodes} training, {t.spare_nodes} spare
squeue -j JOBID; tail -f {t.workdir}/slurm-{t.run_id}-JOBID.out
scontrol requeue JOBID            # a preemption by hand: the run resumes from its newest commit
```

Exit status of the agents and what the script does with it:

| status | meaning and action |
|---|---|
{chr(10).join(f"| {code} | {what} |" for code, what in SLURM_EXITS.items())}
| other | an agent crashed or was killed: requeued while `SLURM_RESTART_COUNT` < {t.max_restarts} |

`prolog.sh` runs the node burn-in before the job starts on a node (install it as the cluster's prolog).
'''
    return {f"{t.run_id}.sbatch": script, "prolog.sh": prolog, "README.md": readme}


# ---------------------------------------------------------------------------------------------------- k8s
def _fixed_port(t: Topology, target: str) -> None:
    if t.metrics_port == 0:
        raise ConfigError(f"--target {target} scrapes every agent on a fixed port: give [metrics] port (e.g. 9400)")


def _k8s(t: Topology, assets: Path, header: str) -> dict[str, str]:
    _fixed_port(t, "k8s")
    runs = f"{t.workdir.rstrip('/')}/runs"
    if t.checkpoint_dir and "://" not in t.checkpoint_dir and not t.checkpoint_dir.startswith(runs + "/"):
        raise ConfigError(f"[checkpoint] dir = {t.checkpoint_dir!r}: pods share no disk but the run volume at {runs}; "
                          f"put local checkpoints under it (e.g. {runs}/{t.run_id}/ckpt) or use s3://")
    ns, name = t.namespace, t.run_id
    labels = {"app.kubernetes.io/name": "resilient", "app.kubernetes.io/instance": name}

    def meta(n: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
        return {"name": n, "namespace": ns, "labels": {**labels, **(extra or {})}}
    docs: list[dict[str, Any]] = []
    if t.etcd:
        store = _store_url(list(t.etcd))
    else:
        etcd_name = f"{name}-etcd"
        peers = ",".join(f"{etcd_name}-{i}=http://{etcd_name}-{i}.{etcd_name}.{ns}.svc:2380" for i in range(3))
        store = _store_url([f"{etcd_name}-{i}.{etcd_name}.{ns}.svc:2379" for i in range(3)])
        etcd_labels = {**labels, "app.kubernetes.io/component": "etcd"}
        etcd_meta = meta(etcd_name, {"app.kubernetes.io/component": "etcd"})
        docs.append({"apiVersion": "v1", "kind": "Service", "metadata": etcd_meta,
                     "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": etcd_labels,
                              "ports": [{"name": "client", "port": 2379}, {"name": "peer", "port": 2380}]}})
        docs.append({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": etcd_meta, "spec": {
            "serviceName": etcd_name, "replicas": 3, "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": etcd_labels},
            "template": {"metadata": {"labels": etcd_labels}, "spec": {"containers": [{
                "name": "etcd", "image": ETCD_IMAGE,
                "command": ["/usr/local/bin/etcd"],
                "args": ["--name=$(POD_NAME)", "--data-dir=/var/lib/etcd",
                         "--listen-client-urls=http://0.0.0.0:2379", "--listen-peer-urls=http://0.0.0.0:2380",
                         f"--advertise-client-urls=http://$(POD_NAME).{etcd_name}.{ns}.svc:2379",
                         f"--initial-advertise-peer-urls=http://$(POD_NAME).{etcd_name}.{ns}.svc:2380",
                         f"--initial-cluster={peers}", "--initial-cluster-state=new",
                         f"--initial-cluster-token={etcd_name}"],
                "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                "ports": [{"name": "client", "containerPort": 2379}, {"name": "peer", "containerPort": 2380}],
                "readinessProbe": {"httpGet": {"path": "/health", "port": 2379}, "periodSeconds": 5},
                "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}]}]}},
            "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
                "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}]}})
    agents = {**labels, "resilient/agent": "true"}
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in _env(t).items()]
    # The node id is the Kubernetes node's name: a quarantine record then names a machine (quarantine.yaml turns
    # it into a taint), and one agent pod runs per machine (the anti-affinity below).
    env += [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    one_per_machine = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": agents}, "topologyKey": "kubernetes.io/hostname"}]}}

    def job(role: str, count: int, spare: bool) -> dict[str, Any]:
        node_id = "$(NODE_NAME)"
        role_labels = {**agents, "app.kubernetes.io/component": role}
        job_meta = meta(f"{name}-{role}", {"app.kubernetes.io/component": role})
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": job_meta, "spec": {
            "completionMode": "Indexed", "completions": count, "parallelism": count,
            "backoffLimit": t.max_restarts * count,
            # The agents' exit codes: a verdict ends the Job; a preemption (the pod disrupted) is not counted.
            # A stop (75: a peer's agent was asked to stop, and every node checkpointed) is not counted either.
            "podFailurePolicy": {"rules": [
                {"action": "FailJob", "onExitCodes": {"containerName": "agent", "operator": "In",
                                                      "values": sorted(NO_RESTART)}},
                {"action": "Ignore", "onExitCodes": {"containerName": "agent", "operator": "In",
                                                     "values": [EXIT_PREEMPTED_AGENT]}},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
            "template": {"metadata": {"labels": role_labels}, "spec": {
                "restartPolicy": "Never", "subdomain": f"{name}-agents",
                "terminationGracePeriodSeconds": 120, "affinity": one_per_machine,
                "volumes": [{"name": "runs", "persistentVolumeClaim": {"claimName": f"{name}-runs"}}],
                "containers": [{
                    "name": "agent", "image": t.image, "workingDir": t.workdir,
                    "command": ["resilient"],
                    "args": agent_args(t, node_id=node_id, store=store, spare=spare, local_addr="$(POD_IP)"),
                    "env": env,
                    "volumeMounts": [{"name": "runs", "mountPath": runs}],
                    "ports": [{"name": "metrics", "containerPort": t.metrics_port}]}]}}}}

    # The run directory (its token, which every node must share, its events) and local checkpoints: one volume
    # every agent's pod mounts, so it needs a ReadWriteMany storage class (NFS, CephFS, a cloud file store).
    docs.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta(f"{name}-runs"), "spec": {
        "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "50Gi"}}}})
    docs.append({"apiVersion": "v1", "kind": "Service", "metadata": meta(f"{name}-agents"), "spec": {
        "clusterIP": "None", "selector": agents, "ports": [{"name": "metrics", "port": t.metrics_port}]}})
    docs.append(job("workers", t.nodes, False))
    if t.spare_nodes:
        docs.append(job("spares", t.spare_nodes, True))
    manifests = _yaml(docs, header)
    monitoring = _yaml([
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": meta(f"{name}-agents"),
         "spec": {"selector": {"matchLabels": agents},
                  "podMetricsEndpoints": [{"port": "metrics", "interval": "15s"}]}},
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": meta(f"{name}-alerts"),
         "spec": {"groups": _alert_groups(assets)}},
    ], header + " Needs the Prometheus Operator's CRDs.")
    boards = sorted((assets / "grafana").glob("*.json"))
    dashboards = _yaml([{"apiVersion": "v1", "kind": "ConfigMap",
                         "metadata": meta(f"{name}-dashboards", {"grafana_dashboard": "1"}),
                         "data": {b.name: b.read_text() for b in boards}}], header + " Grafana's sidecar loads "
                       "ConfigMaps labelled grafana_dashboard=1.")
    pytorchjob = _yaml([{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": meta(f"{name}-pytorchjob"),
                         "spec": {"pytorchReplicaSpecs": {"Worker": {
                             # Never: a verdict (exit 80) must not be restarted in place; runPolicy counts the rest.
                             "replicas": t.nodes, "restartPolicy": "Never",
                             "template": {"metadata": {"labels": {**agents, "app.kubernetes.io/component": "workers"}},
                                          "spec": {
                                 "affinity": one_per_machine,
                                 "volumes": [{"name": "runs", "persistentVolumeClaim": {"claimName": f"{name}-runs"}}],
                                 "containers": [{
                                 "name": "pytorch", "image": t.image, "workingDir": t.workdir,
                                 "command": ["resilient"],
                                 "args": agent_args(t, node_id="$(NODE_NAME)", store=store, local_addr="$(POD_IP)"),
                                 "env": env,
                                 "volumeMounts": [{"name": "runs", "mountPath": runs}],
                                 "ports": [{"name": "metrics", "containerPort": t.metrics_port}]}]}}}},
                                  "runPolicy": {"backoffLimit": t.max_restarts}}}],
                       header + " An alternative to the workers' Job of manifests.yaml for clusters that run the "
                       "Kubeflow training operator: the agents inside a PyTorchJob's workers (needs its CRD, and "
                       "the etcd, the volume and the Service of manifests.yaml).")
    fleet = _fleet(t)
    account = f"{name}-quarantine-taints"
    cluster_name = f"{ns}-{account}"  # cluster-scoped: unique across namespaces
    quarantine = _yaml([
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(account)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": cluster_name, "labels": labels},
         "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": cluster_name, "labels": labels},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_name},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ns}]},
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": meta(account, {"app.kubernetes.io/component": "quarantine-taints"}), "spec": {
             "replicas": 1,
             "selector": {"matchLabels": {**labels, "app.kubernetes.io/component": "quarantine-taints"}},
             "template": {"metadata": {"labels": {**labels, "app.kubernetes.io/component": "quarantine-taints"}},
                          "spec": {"serviceAccountName": account, "containers": [{
                              "name": "taints", "image": t.image, "command": ["resilient"],
                              "args": ["quarantine", "taints", "--store", store, "--fleet", fleet],
                              "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}]}]}}}},
    ], header + f" The fleet {fleet!r}'s quarantine records as node taints {TAINT_KEY}={fleet}:NoSchedule, "
       "lifted when a record ends (resilient quarantine taints).")
    return {"manifests.yaml": manifests, "monitoring.yaml": monitoring, "dashboards.yaml": dashboards,
            "pytorchjob.yaml": pytorchjob, "quarantine.yaml": quarantine, "README.md": _k8s_readme(t, header)}


def _fleet(t: Topology) -> str:
    """The quarantine fleet the agents obey (``--fleet`` in ``[run] agent_args``, else ``default``)."""
    args = list(t.extra_agent_args)
    for i, arg in enumerate(args):
        if arg == "--fleet" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--fleet="):
            return arg.split("=", 1)[1]
    return "default"


def _k8s_readme(t: Topology, header: str) -> str:
    return f'''# Kubernetes: run {t.run_id}

{header} Validated against Kubernetes {KUBERNETES_VERSION} (`kubernetes-validate --strict`).

```bash
kubectl apply -f manifests.yaml     # etcd (3 members, unless the topology names endpoints), the agents
kubectl apply -f monitoring.yaml    # PodMonitor and PrometheusRule (Prometheus Operator)
kubectl apply -f dashboards.yaml    # Grafana dashboards (sidecar label grafana_dashboard=1)
kubectl -n {t.namespace} get pods -l app.kubernetes.io/instance={t.run_id}
```

The workers are an indexed Job of {t.nodes} pod(s), the spares a Job of {t.spare_nodes} pod(s), one agent pod
per machine (pod anti-affinity); each agent's node id is its Kubernetes node's name, so a quarantine record
names a machine, and `quarantine.yaml` (a service account that may patch nodes, and a Deployment of one running
`resilient quarantine taints`) taints a quarantined machine `{TAINT_KEY}=<fleet>:NoSchedule` until its record
ends, with the expiry and the reason as annotations.  The pod failure policy follows the agents' exit codes: {EXIT_STOPPED}
(a verdict), {EXIT_CONFIG} and {EXIT_UNRECOVERABLE} fail the Job; a disrupted pod (preemption, eviction) and a
stop ({EXIT_PREEMPTED_AGENT}: one agent was asked to stop, and every node checkpointed) are not counted against
`backoffLimit`; any other failure is retried.  Every agent's pod mounts the volume `{t.run_id}-runs`
(ReadWriteMany: NFS, CephFS, a cloud file store) at `{t.workdir.rstrip("/")}/runs`: the run directory, whose
token every node must share, and local checkpoints.  `pytorchjob.yaml` is the same agents as a Kubeflow
PyTorchJob.
'''


# ---------------------------------------------------------------------------------------------------- compose
def _compose(t: Topology, assets: Path, header: str) -> dict[str, str]:
    _fixed_port(t, "compose")
    env = _env(t)
    etcd = list(t.etcd) or ["etcd:2379"]
    store = _store_url(etcd)
    services: dict[str, Any] = {}
    if not t.etcd:
        services["etcd"] = {"image": ETCD_IMAGE, "command": [
            "/usr/local/bin/etcd", "--name=etcd", "--data-dir=/var/lib/etcd",
            "--listen-client-urls=http://0.0.0.0:2379", "--advertise-client-urls=http://etcd:2379"]}
    agents = [(f"node{i}", False) for i in range(t.nodes)] + [(f"spare{i}", True) for i in range(t.spare_nodes)]
    for node, spare in agents:
        services[node] = {"build": {"context": ".", "dockerfile": "Dockerfile"}, "image": t.image,
                          "hostname": node, "working_dir": t.workdir, "entrypoint": ["resilient"],
                          "command": agent_args(t, node_id=node, store=store, spare=spare, local_addr=node),
                          "environment": {**env, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"},
                          "volumes": ["runs:" + f"{t.workdir}/runs"],
                          **({"depends_on": ["etcd"]} if not t.etcd else {})}
    services["s3"] = {"image": t.image, "entrypoint": ["moto_server"], "command": ["-H", "0.0.0.0", "-p", "5000"]}
    services["prometheus"] = {"image": "prom/prometheus:v2.42.0", "volumes": [
        "./prometheus.yml:/etc/prometheus/prometheus.yml:ro", "./alerts.yml:/etc/prometheus/alerts.yml:ro"],
        "ports": ["127.0.0.1:9090:9090"]}
    services["alertmanager"] = {"image": "prom/alertmanager:v0.25.0", "volumes": [
        "./alertmanager.yml:/etc/alertmanager/alertmanager.yml:ro"], "ports": ["127.0.0.1:9093:9093"]}
    services["grafana"] = {"image": "grafana/grafana:10.4.2", "ports": ["127.0.0.1:3000:3000"], "volumes": [
        "./grafana/datasources.yaml:/etc/grafana/provisioning/datasources/resilient.yaml:ro",
        "./grafana/dashboards.yaml:/etc/grafana/provisioning/dashboards/resilient.yaml:ro",
        "./grafana/dashboards:/var/lib/grafana/dashboards/resilient:ro"]}
    compose = _yaml([{"version": "3.8", "services": services, "volumes": {"runs": {}}}], header)
    prometheus = _yaml([{"global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
                         "rule_files": ["/etc/prometheus/alerts.yml"],
                         "alerting": {"alertmanagers": [{"static_configs": [{"targets": ["alertmanager:9093"]}]}]},
                         "scrape_configs": [{"job_name": "resilient", "static_configs": [{
                             "targets": [f"{node}:{t.metrics_port}" for node, _ in agents]}]}]}], header)
    alerts = (assets / "prometheus" / "alerts.yml").read_text()
    alertmanager = _yaml([{"route": {"receiver": "log", "group_by": ["alertname", "run_id"]},
                          "receivers": [{"name": "log"}]}], header + " Add a real receiver (e-mail, PagerDuty, "
                         "Slack) for on-call.")
    datasource = _yaml([{"apiVersion": 1, "datasources": [{"name": "Prometheus", "uid": "prometheus",
                                                           "type": "prometheus", "access": "proxy",
                                                           "url": "http://prometheus:9090", "isDefault": True}]}],
                       header)
    provider = _yaml([{"apiVersion": 1, "providers": [{"name": "resilient", "orgId": 1, "folder": "resilient",
                                                       "type": "file", "options": {
                                                           "path": "/var/lib/grafana/dashboards/resilient"}}]}],
                     header)
    dockerfile = f'''# {header}
# The agent image: Python, PyTorch's CPU build (installed first, so pip never resolves a CUDA build), this
# project, and the training script's directory. For GPUs, start FROM an image with CUDA and install torch for it.
# Without a registry: `docker-compose build --build-arg BASE=<an image you imported>` (one with Python 3.11;
# pip finds nothing to do for what it already has).
ARG BASE=python:3.11-slim
FROM ${{BASE}}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${{TORCH_INDEX_URL}}
COPY resilient-src /opt/resilient
RUN pip install --no-cache-dir "/opt/resilient[s3,metrics]" "moto[server]>=5"
WORKDIR {t.workdir}
COPY work/ {t.workdir}/
'''
    files = {"docker-compose.yml": compose, "prometheus.yml": prometheus, "alerts.yml": alerts,
             "alertmanager.yml": alertmanager, "grafana/datasources.yaml": datasource,
             "grafana/dashboards.yaml": provider, "Dockerfile": dockerfile}
    for board in sorted((assets / "grafana").glob("*.json")):
        files[f"grafana/dashboards/{board.name}"] = board.read_text()
    files["README.md"] = f'''# Compose: a test cluster for run {t.run_id}

{header}

Before `build`, put this project's source in `resilient-src/` and the training script's directory in
`work/` (the image's {t.workdir}). Where no registry is reachable, import a Python 3.11 image (with PyTorch
and the project's dependencies, or a pip that finds them) and build on it:
`docker-compose build --build-arg BASE=<that image>`; the etcd, Prometheus and Alertmanager images must be
imported (`docker load`) under the names `docker-compose.yml` gives them.

```bash
docker-compose build && docker-compose up -d
docker-compose logs -f node0
open http://127.0.0.1:3000         # Grafana, dashboards provisioned; Prometheus on :9090, Alertmanager :9093
docker-compose kill node1          # a node lost: {"a spare takes its ranks" if t.spare_nodes else "the run recovers"}
docker-compose down -v
```

Services: {", ".join(services)}. The S3-compatible store is moto's server at `http://s3:5000`, for a script
given `--ckpt-dir s3://BUCKET/...` and that endpoint (`[checkpoint] endpoint_url`): it keeps objects in memory
and starts with no bucket, so create one first (`docker-compose exec node0 python -c "import boto3;
boto3.client('s3', endpoint_url='http://s3:5000').create_bucket(Bucket='BUCKET')"`).
'''
    return files


# ---------------------------------------------------------------------------------------------------- systemd
def _systemd(t: Topology, assets: Path, header: str) -> dict[str, str]:
    store = _store_url(list(t.etcd)) if t.etcd else None
    if store is None and not t.embedded:
        raise ConfigError("--target systemd needs [store] etcd endpoints: the hosts of a multi-node run meet "
                          "through an etcd that runs beside them (e.g. etcd = [\"10.0.0.5:2379\"])")

    def unit(spare: bool) -> str:
        args = agent_args(t, node_id=_HOST, store=store, spare=spare)
        args[1:1] = ["--token-file", f"/etc/resilient/{t.run_id}.token"]
        words = [_systemd_word(a).replace(_HOST, "%H") for a in args]
        exec_start = " ".join([_systemd_word(t.python), "-m", "resilient", *words])
        what = "spare node" if spare else "worker node"
        return f'''# {header}
# The resilient agent of run {t.run_id} on a {what}; node id: the host name (%H).
[Unit]
Description=resilient agent, run {t.run_id} ({what})
Wants=network-online.target
After=network-online.target

[Service]
Type=exec
WorkingDirectory={t.workdir}
EnvironmentFile=-/etc/resilient/{t.run_id}.env
ExecStart={exec_start}
# A verdict (budget spent, crash loop, a do-not-restart exit) is final; an agent that crashed is restarted.
Restart=on-failure
RestartPreventExitStatus={EXIT_STOPPED} {EXIT_CONFIG} {EXIT_UNRECOVERABLE} {EXIT_UNHEALTHY}
SuccessExitStatus={EXIT_PREEMPTED_AGENT}
RestartSec=10
# Stop: SIGTERM to the agent, which checkpoints and stops its workers (--preempt-grace, 60 s by default).
KillMode=mixed
TimeoutStopSec=90

[Install]
WantedBy=multi-user.target
'''
    env = "".join(f"{k}={v}\n" for k, v in _env(t).items())
    return {f"resilient-{t.run_id}.service": unit(False),
            f"resilient-{t.run_id}-spare.service": unit(True),
            f"{t.run_id}.env": f"# {header}\n# Install as /etc/resilient/{t.run_id}.env\n{env}"}


_HOST = "@NODE@"
"""Stands for the node id in a unit's ExecStart until the words are escaped: then it becomes %H (the host)."""


def _systemd_word(word: str) -> str:
    """One ExecStart argument, as systemd reads it back: %% for a literal %, $$ for a literal $, quoted where
    systemd would split it."""
    word = word.replace("%", "%%").replace("$", "$$")
    return json.dumps(word) if any(c in word for c in " \t\"'\\;") else word
