"""The Kubernetes target: etcd, the agents' indexed Jobs, monitoring, dashboards, a PyTorchJob and the quarantine's
taints, as plain manifests (see :mod:`resilient.deploy.render`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.errors import ConfigError
from ..core.exitcodes import EXIT_CONFIG, EXIT_PREEMPTED_AGENT, EXIT_STOPPED, EXIT_UNRECOVERABLE
from .common import ETCD_IMAGE, NO_RESTART, agent_args, alert_groups, environment, fixed_port, store_url, to_yaml
from .taints import TAINT_KEY
from .topology import Topology

KUBERNETES_VERSION = "1.30.0"


def k8s(t: Topology, assets: Path, header: str) -> dict[str, str]:
    fixed_port(t, "k8s")
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
        store = store_url(list(t.etcd))
    else:
        etcd_name = f"{name}-etcd"
        peers = ",".join(f"{etcd_name}-{i}=http://{etcd_name}-{i}.{etcd_name}.{ns}.svc:2380" for i in range(3))
        store = store_url([f"{etcd_name}-{i}.{etcd_name}.{ns}.svc:2379" for i in range(3)])
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
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in environment(t).items()]
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
    manifests = to_yaml(docs, header)
    monitoring = to_yaml([
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": meta(f"{name}-agents"),
         "spec": {"selector": {"matchLabels": agents},
                  "podMetricsEndpoints": [{"port": "metrics", "interval": "15s"}]}},
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": meta(f"{name}-alerts"),
         "spec": {"groups": alert_groups(assets)}},
    ], header + " Needs the Prometheus Operator's CRDs.")
    boards = sorted((assets / "grafana").glob("*.json"))
    dashboards = to_yaml([{"apiVersion": "v1", "kind": "ConfigMap",
                         "metadata": meta(f"{name}-dashboards", {"grafana_dashboard": "1"}),
                         "data": {b.name: b.read_text() for b in boards}}], header + " Grafana's sidecar loads "
                       "ConfigMaps labelled grafana_dashboard=1.")
    pytorchjob = to_yaml([{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": meta(f"{name}-pytorchjob"),
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
    quarantine = to_yaml([
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
