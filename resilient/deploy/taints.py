"""The fleet's node quarantine as Kubernetes node taints, with the record's expiry.

On Kubernetes the rendered agents take the node's name as their node id
(``spec.nodeName``), so a quarantine record names a machine.  This
reconciler (``resilient quarantine taints``, a Deployment of one in the
rendered ``quarantine.yaml``) brings every Node in line with the fleet's
records in etcd, every ``interval_s``:

- a Node with a record in force gets the taint ``resilient.dev/quarantine=<fleet>:NoSchedule``
  (no new pod lands there; pods already running stay: the agent on it
  steps out of its run by itself) and the annotations
  ``resilient.dev/quarantine-until`` (UTC, from the record lease's time left)
  and ``resilient.dev/quarantine-reason``;
- a Node with that taint for this fleet and no record in force (the lease
  ran out, or ``resilient quarantine release``) loses the taint and the
  annotations.

The expiry is etcd's: a record lives on a lease, and the taint goes at the
first pass after it lapses.  Other taints, and this taint of another fleet,
are left as they are.  Each change is one JSON merge patch carrying the
Node's ``resourceVersion``, so a Node changed meanwhile is answered 409 and
tried again at the next pass.  :func:`plan` is pure; :class:`KubeNodes` is
the API's two calls (list the Nodes, patch one), with the in-cluster
service account or an explicit server, token and CA.
"""

from __future__ import annotations

import json
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..coord.quarantine import Standing
from ..core.errors import ConfigError

TAINT_KEY = "resilient.dev/quarantine"
UNTIL = "resilient.dev/quarantine-until"
REASON = "resilient.dev/quarantine-reason"
EFFECT = "NoSchedule"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
REASON_CHARS = 1000


@dataclass(frozen=True)
class Change:
    """One Node's patch and what it does, for the log."""

    node: str
    patch: dict[str, Any]
    describe: str


def _ours(taint: Mapping[str, Any], fleet: str) -> bool:
    return bool(taint.get("key") == TAINT_KEY and taint.get("value") == fleet)


def plan(nodes: Iterable[Mapping[str, Any]], standing: Iterable[Standing], fleet: str, now: float
         ) -> tuple[list[Change], list[str]]:
    """The patches that bring ``nodes`` (Node objects as the API lists them) in line with the records in force,
    and the quarantined node ids no Node is named after (reported, nothing to taint)."""
    records = {s.record.node: s for s in standing}
    changes: list[Change] = []
    seen: set[str] = set()
    for node in nodes:
        meta, spec = node.get("metadata") or {}, node.get("spec") or {}
        name = str(meta.get("name"))
        seen.add(name)
        taints = list(spec.get("taints") or [])
        annotations = meta.get("annotations") or {}
        tainted = any(_ours(t, fleet) for t in taints)
        record = records.get(name)
        version = {"resourceVersion": meta.get("resourceVersion")} if meta.get("resourceVersion") else {}
        if record is not None:
            until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now + record.remaining_s))
            reason = record.record.reason[:REASON_CHARS]
            # The expiry is the lease's: its time left moves a second or so between passes; patch only for a new
            # record (or a changed reason), not for that drift.
            if tainted and annotations.get(REASON) == reason and UNTIL in annotations:
                continue
            kept = [t for t in taints if not _ours(t, fleet)]
            patch = {"metadata": {**version, "annotations": {UNTIL: until, REASON: reason}},
                     "spec": {"taints": [*kept, {"key": TAINT_KEY, "value": fleet, "effect": EFFECT}]}}
            changes.append(Change(name, patch, f"tainted node {name} {TAINT_KEY}={fleet}:{EFFECT} until {until} "
                                                f"(offence {record.record.offence}): {reason}"))
        elif tainted:
            patch = {"metadata": {**version, "annotations": {UNTIL: None, REASON: None}},
                     "spec": {"taints": [t for t in taints if not _ours(t, fleet)]}}
            changes.append(Change(name, patch, f"untainted node {name}: its quarantine in fleet {fleet} ended"))
    return changes, sorted(set(records) - seen)


class KubeNodes:
    """The Kubernetes API's Nodes: list them, merge-patch one (HTTPS with a bearer token, or plain HTTP)."""

    def __init__(self, server: str, token_file: Path | None, ca: Path | None = None, timeout_s: float = 10.0) -> None:
        self.server = server.rstrip("/")
        self.token_file = token_file
        """Read at every call: a projected service-account token is rotated by the kubelet."""
        self.timeout_s = timeout_s
        self._context = ssl.create_default_context(cafile=str(ca)) if ca is not None else None

    @classmethod
    def in_cluster(cls) -> KubeNodes:
        """From the pod's service account (``KUBERNETES_SERVICE_HOST`` and the mounted token and CA)."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        token = SERVICE_ACCOUNT / "token"
        if not host or not token.exists():
            raise ConfigError("not inside a Kubernetes pod (no KUBERNETES_SERVICE_HOST or service account token): "
                              "give --api URL, and --token-file (and --ca) for its credentials")
        server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        return cls(server, token, SERVICE_ACCOUNT / "ca.crt")

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if self.token_file is not None:
            headers["Authorization"] = f"Bearer {self.token_file.read_text().strip()}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/merge-patch+json"
        req = urllib.request.Request(self.server + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._context) as r:
            return dict(json.load(r))

    def nodes(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v1/nodes").get("items") or [])

    def patch(self, name: str, patch: dict[str, Any]) -> None:
        self._call("PATCH", f"/api/v1/nodes/{urllib.parse.quote(name, safe='')}", patch)


def reconcile(api: KubeNodes, standing: list[Standing], fleet: str, now: float | None = None
              ) -> tuple[list[str], list[str]]:
    """One pass: apply :func:`plan`'s patches; (what changed, what failed), each a line for the log."""
    changes, unmatched = plan(api.nodes(), standing, fleet, time.time() if now is None else now)
    done, failed = [], []
    for change in changes:
        try:
            api.patch(change.node, change.patch)
            done.append(change.describe)
        except urllib.error.HTTPError as e:
            why = "changed meanwhile (409): tried again at the next pass" if e.code == 409 else \
                f"HTTP {e.code} {e.reason}" + (" (the service account needs patch on nodes)" if e.code == 403 else "")
            failed.append(f"node {change.node}: {why}")
        except OSError as e:
            failed.append(f"node {change.node}: {type(e).__name__}: {e}")
    failed += [f"quarantined node id {n!r} names no Kubernetes Node: nothing to taint" for n in unmatched]
    return done, failed
