"""The fleet's quarantine records in a real etcd, as Kubernetes node taints that end with the record.

No Kubernetes API server can run on this machine, so the Nodes endpoint is a stand-in on loopback that keeps
to the API's contract for the two calls the reconciler makes: ``GET /api/v1/nodes`` and ``PATCH
/api/v1/nodes/<name>`` with ``application/merge-patch+json`` (RFC 7386: a list is replaced, a null removes a
key), a ``resourceVersion`` in the patch that must match (409 otherwise), a bearer token (401 otherwise).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
import time
import urllib.error
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from resilient.coord.etcd import EtcdClient, EtcdConfig
from resilient.coord.quarantine import FleetQuarantine, QuarantineConfig
from resilient.deploy.taints import REASON, TAINT_KEY, UNTIL, KubeNodes, plan, reconcile

from .agent_helpers import agent_env

TOKEN = "test-token"


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


class NodesAPI:
    """The stand-in Nodes endpoint (see the module's docstring); ``conflicts`` answers that many PATCHes 409."""

    def __init__(self, nodes: dict[str, dict[str, Any]]) -> None:
        self.nodes = {name: {"metadata": {"name": name, "resourceVersion": "1", "annotations": {}},
                             "spec": spec} for name, spec in nodes.items()}
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.conflicts = 0
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self._answer(401, {"kind": "Status", "code": 401, "reason": "Unauthorized"})
                    return False
                return True

            def do_GET(self) -> None:
                if self._authorized() and self.path == "/api/v1/nodes":
                    self._answer(200, {"kind": "NodeList", "items": list(api.nodes.values())})
                elif self.path != "/api/v1/nodes":
                    self._answer(404, {"kind": "Status", "code": 404})

            def do_PATCH(self) -> None:
                if not self._authorized():
                    return
                name = self.path.removeprefix("/api/v1/nodes/")
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.headers.get("Content-Type") != "application/merge-patch+json" or name not in api.nodes:
                    self._answer(415 if name in api.nodes else 404, {"kind": "Status"})
                    return
                node = api.nodes[name]
                asked = body.get("metadata", {}).get("resourceVersion")
                if api.conflicts or (asked is not None and asked != node["metadata"]["resourceVersion"]):
                    api.conflicts = max(0, api.conflicts - 1)
                    node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
                    self._answer(409, {"kind": "Status", "code": 409, "reason": "Conflict"})
                    return
                api.patches.append((name, body))
                merged = merge(node, body)
                merged["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
                api.nodes[name] = merged
                self._answer(200, merged)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def taints(self, name: str) -> list[dict[str, Any]]:
        return list(self.nodes[name]["spec"].get("taints") or [])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def fleet_of(server: Any, **config: Any) -> FleetQuarantine:
    client = EtcdClient(EtcdConfig.from_url(server.url, outage_tolerance_s=5.0))
    return FleetQuarantine(client, QuarantineConfig(fleet=f"f-{uuid.uuid4().hex[:10]}", **config))


GPU = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def token_file(tmp_path: Any) -> Any:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def test_a_record_taints_its_node_until_its_lease_lapses_and_other_taints_stay(etcd_server, tmp_path):
    fleet = fleet_of(etcd_server, expiry_s=3, max_expiry_s=60)
    other = {"key": TAINT_KEY, "value": "another-fleet", "effect": "NoSchedule"}
    api = NodesAPI({"gpu-a": {"taints": [GPU]}, "gpu-b": {"taints": [other]}, "gpu-c": {}})
    kube = KubeNodes(api.url, token_file(tmp_path))
    name = fleet.config.fleet
    try:
        fleet.add("gpu-a", reason="persistent straggler: step 2.1x its peers", source="straggler", by="gpu-a")
        fleet.add("gone-node", reason="a machine since removed", source="operator", by="ops")
        standing = fleet.list()
        [left] = [s.remaining_s for s in standing if s.record.node == "gpu-a"]
        assert 0 <= left <= 3, standing  # the lease etcd granted, counting down
        done, failed = reconcile(kube, standing, name, now=1_700_000_000.0)
        assert len(done) == 1 and done[0].startswith("tainted node gpu-a"), done
        assert failed == ["quarantined node id 'gone-node' names no Kubernetes Node: nothing to taint"], failed
        assert api.taints("gpu-a") == [GPU, {"key": TAINT_KEY, "value": name, "effect": "NoSchedule"}]
        notes = api.nodes["gpu-a"]["metadata"]["annotations"]
        assert notes[REASON] == "persistent straggler: step 2.1x its peers"
        assert notes[UNTIL] == f"2023-11-14T22:13:{20 + left}Z", notes  # now= plus the lease's time left
        assert api.taints("gpu-b") == [other] and api.taints("gpu-c") == [], "no record, no change"

        # The token is read at every call (the kubelet rotates a service account's): a changed file counts.
        (tmp_path / "token").write_text("rotated-away\n")
        with pytest.raises(urllib.error.HTTPError) as refused:
            reconcile(kube, fleet.list(), name)
        assert refused.value.code == 401
        token_file(tmp_path)
        # A second pass changes nothing (the lease's time left moves; the taint is what counts).
        patches = len(api.patches)
        assert reconcile(kube, fleet.list(), name)[0] == [] and len(api.patches) == patches

        while fleet.get("gpu-a") is not None:  # until etcd ends the lease (no bound: the test's timeout guards)
            time.sleep(0.2)
        done, _ = reconcile(kube, fleet.list(), name)
        assert done == [f"untainted node gpu-a: its quarantine in fleet {name} ended"], done
        assert api.taints("gpu-a") == [GPU] and api.nodes["gpu-a"]["metadata"]["annotations"] == {}
        assert api.taints("gpu-b") == [other], "another fleet's taint is not ours to lift"
    finally:
        api.close()


def test_a_node_changed_meanwhile_is_patched_at_the_next_pass_and_release_lifts_at_once(etcd_server, tmp_path):
    fleet = fleet_of(etcd_server, expiry_s=600)
    api = NodesAPI({"gpu-a": {"taints": [GPU]}})
    kube = KubeNodes(api.url, token_file(tmp_path))
    name = fleet.config.fleet
    try:
        fleet.add("gpu-a", reason="burn-in failed", source="burn_in", by="gpu-a")
        api.conflicts = 1
        done, failed = reconcile(kube, fleet.list(), name)
        assert done == [] and failed == ["node gpu-a: changed meanwhile (409): tried again at the next pass"]
        assert api.taints("gpu-a") == [GPU]
        done, failed = reconcile(kube, fleet.list(), name)
        assert len(done) == 1 and failed == [] and len(api.taints("gpu-a")) == 2
        assert fleet.release("gpu-a")
        done, _ = reconcile(kube, fleet.list(), name)
        assert done[0].startswith("untainted node gpu-a") and api.taints("gpu-a") == [GPU]
    finally:
        api.close()


def test_the_command_runs_a_pass_with_a_token_file_and_refuses_a_wrong_token(etcd_server, tmp_path):
    fleet = fleet_of(etcd_server, expiry_s=600)
    api = NodesAPI({"gpu-a": {}})
    try:
        fleet.add("gpu-a", reason="operator: fan failure", source="operator", by="ops")
        token = tmp_path / "token"

        def taints(secret: str) -> subprocess.CompletedProcess:
            token.write_text(secret + "\n")
            return subprocess.run([sys.executable, "-m", "resilient", "quarantine", "taints", "--store",
                                   etcd_server.url, "--fleet", fleet.config.fleet, "--api", api.url, "--token-file",
                                   str(token), "--once"], capture_output=True, text=True, timeout=60,
                                  env=agent_env(), check=False)

        refused = taints("wrong")
        assert refused.returncode == 1 and "401" in refused.stdout and api.taints("gpu-a") == [], refused.stdout
        ok = taints(TOKEN)
        assert ok.returncode == 0 and "tainted node gpu-a" in ok.stdout, ok.stdout + ok.stderr
        assert api.taints("gpu-a") == [{"key": TAINT_KEY, "value": fleet.config.fleet, "effect": "NoSchedule"}]
    finally:
        api.close()


def test_plan_is_pure_and_keeps_other_fleets_and_keys():
    nodes = [{"metadata": {"name": "a", "resourceVersion": "7"},
              "spec": {"taints": [GPU, {"key": TAINT_KEY, "value": "f", "effect": "NoSchedule"}]}}]
    changes, unmatched = plan(nodes, [], "f", now=0.0)
    [change] = changes
    assert change.patch == {"metadata": {"resourceVersion": "7", "annotations": {UNTIL: None, REASON: None}},
                            "spec": {"taints": [GPU]}}
    assert unmatched == []
    assert plan(nodes, [], "g", now=0.0) == ([], []), "fleet g has no taint there to lift"
