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
is the CLI's.  The Kubernetes target is in :mod:`resilient.deploy.k8s`, what
every target shares (the agents' command line, YAML) in
:mod:`resilient.deploy.common`.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError
from ..core.exitcodes import EXIT_CONFIG, EXIT_PREEMPTED_AGENT, EXIT_STOPPED, EXIT_UNHEALTHY, EXIT_UNRECOVERABLE
from .common import ETCD_IMAGE, agent_args, environment, fixed_port, store_url, to_yaml
from .k8s import KUBERNETES_VERSION, k8s
from .topology import Topology

__all__ = ["ETCD_IMAGE", "KUBERNETES_VERSION", "SLURM_EXITS", "TARGETS", "agent_args", "render"]

TARGETS = ("slurm", "k8s", "compose", "systemd")
"""The agents' final exit codes: a verdict, and the workers' do-not-restart codes it passes on."""
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
        "slurm": _slurm, "k8s": k8s, "compose": _compose, "systemd": _systemd}
    if target not in builders:
        raise ConfigError(f"--target {target!r}: use one of {', '.join(TARGETS)}")
    return builders[target](topology, assets, HEADER.format(source=source))


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
    env = "\n".join(f"export {k}={q(v)}" for k, v in environment(t).items())
    if t.etcd:
        etcd = f'STORE={q(store_url(list(t.etcd)))}\n'
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



# ---------------------------------------------------------------------------------------------------- compose
def _compose(t: Topology, assets: Path, header: str) -> dict[str, str]:
    fixed_port(t, "compose")
    env = environment(t)
    etcd = list(t.etcd) or ["etcd:2379"]
    store = store_url(etcd)
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
    compose = to_yaml([{"version": "3.8", "services": services, "volumes": {"runs": {}}}], header)
    prometheus = to_yaml([{"global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
                         "rule_files": ["/etc/prometheus/alerts.yml"],
                         "alerting": {"alertmanagers": [{"static_configs": [{"targets": ["alertmanager:9093"]}]}]},
                         "scrape_configs": [{"job_name": "resilient", "static_configs": [{
                             "targets": [f"{node}:{t.metrics_port}" for node, _ in agents]}]}]}], header)
    alerts = (assets / "prometheus" / "alerts.yml").read_text()
    alertmanager = to_yaml([{"route": {"receiver": "log", "group_by": ["alertname", "run_id"]},
                          "receivers": [{"name": "log"}]}], header + " Add a real receiver (e-mail, PagerDuty, "
                         "Slack) for on-call.")
    datasource = to_yaml([{"apiVersion": 1, "datasources": [{"name": "Prometheus", "uid": "prometheus",
                                                           "type": "prometheus", "access": "proxy",
                                                           "url": "http://prometheus:9090", "isDefault": True}]}],
                       header)
    provider = to_yaml([{"apiVersion": 1, "providers": [{"name": "resilient", "orgId": 1, "folder": "resilient",
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
    store = store_url(list(t.etcd)) if t.etcd else None
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
    env = "".join(f"{k}={v}\n" for k, v in environment(t).items())
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
