"""``resilient quarantine ls|add|release``: the fleet's node quarantine records in etcd.

``ls`` lists the records in force (reason, source, offence, time left),
each node's offences and its newest burn-in; ``add NODE --reason R`` keeps
a node out of every run's next rendezvous (a node in a generation leaves it
within a second), for the fleet's expiry doubled once per earlier offence;
``release NODE`` ends a record now (the node still burns in before it
rejoins; ``--forget`` clears its offences too).  Records live under
``/resilient-fleet/<fleet>/`` (see :mod:`resilient.coord.quarantine`).
"""

from __future__ import annotations

import argparse
import getpass
import json
import socket
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError


def add_parser(commands: Any) -> None:
    p = commands.add_parser("quarantine", help="list, add or release node quarantine records (across machines)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = actions.add_parser("ls", help="the records in force, offences and burn-ins")
    add = actions.add_parser("add", help="keep a node out of every run's next rendezvous")
    add.add_argument("node", metavar="NODE", help="the node id, as given to `resilient run --node-id`")
    add.add_argument("--reason", required=True, help="why (shown in status, events and `ls`)")
    add.add_argument("--expiry", type=float, default=600.0, metavar="S",
                     help="a first offence's expiry; each earlier offence doubles it (default 600)")
    release = actions.add_parser("release", help="end a node's record now (it burns in before it rejoins)")
    release.add_argument("node", metavar="NODE")
    release.add_argument("--forget", action="store_true", help="clear its offences too (its next expiry is the first)")
    taints = actions.add_parser(
        "taints", help="keep Kubernetes node taints in line with the records (resilient.dev/quarantine)",
        description="Every --interval seconds: taint each Kubernetes Node that has a quarantine record in force "
                    "resilient.dev/quarantine=<fleet>:NoSchedule, with the record's expiry and reason as "
                    "annotations, and untaint it once the record has ended (needs get, list and patch on nodes; "
                    "the rendered quarantine.yaml runs it with such a service account).")
    taints.add_argument("--api", metavar="URL", help="the API server (default: the pod's in-cluster service)")
    taints.add_argument("--token-file", type=Path, metavar="FILE", help="a bearer token for --api")
    taints.add_argument("--ca", type=Path, metavar="FILE", help="the CA bundle of --api (https)")
    taints.add_argument("--interval", type=float, default=10.0, metavar="S", help="seconds between passes (10)")
    taints.add_argument("--once", action="store_true", help="one pass, then exit (1 if a change failed)")
    for sub in (ls, add, release, taints):
        sub.add_argument("--store", required=True, metavar="URL", help="etcd://HOST:PORT[,HOST:PORT]")
        sub.add_argument("--fleet", default="default", metavar="NAME", help="the fleet (default 'default')")
        sub.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_quarantine)


def cmd_quarantine(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ..coord.etcd import EtcdClient, EtcdConfig
    from ..coord.quarantine import FleetQuarantine, QuarantineConfig, check_name

    expiry = getattr(args, "expiry", 600.0)
    if not expiry >= 1:
        raise ConfigError(f"--expiry {expiry}: a quarantine lasts at least 1 second")
    config = QuarantineConfig(fleet=args.fleet, expiry_s=expiry,
                              max_expiry_s=max(QuarantineConfig().max_expiry_s, expiry))
    fleet = FleetQuarantine(EtcdClient(EtcdConfig.from_url(args.store, outage_tolerance_s=10.0)), config)
    if args.action == "taints":
        return _taints(args, fleet)
    if args.action == "ls":
        standing = {s.record.node: s for s in fleet.list()}
        burn_ins, offences = fleet.burn_ins(), fleet.all_offences()
        nodes = sorted(set(standing) | set(burn_ins) | set(offences))
        rows: list[dict[str, Any]] = [{"node": n, "offences": offences.get(n, 0),
                 "standing": None if n not in standing else {**asdict(standing[n].record),
                                                              "remaining_s": standing[n].remaining_s},
                                        "burn_in": burn_ins.get(n)} for n in nodes]
        if args.json:
            print(json.dumps({"fleet": args.fleet, "nodes": rows}, indent=2))
            return 0
        if not rows:
            print(f"fleet {args.fleet}: no node is quarantined, has an offence or has burned in")
        for row in rows:
            s, b = row["standing"], row["burn_in"]
            state = (f"QUARANTINED ({s['source']}, offence {s['offence']}, {s['remaining_s']} s left of "
                     f"{s['expiry_s']:.0f} s): {s['reason']}") if s else "free"
            last = "" if not b else f"; last burn-in {'passed' if b.get('passed') else 'FAILED'}: {b.get('reason')}"
            print(f"{row['node']}: {state}; offences {row['offences']}{last}")
        return 0
    node = check_name("node id", args.node)
    if args.action == "add":
        by = f"{getpass.getuser()}@{socket.gethostname()}"
        created, record = fleet.add(node, reason=args.reason, source="operator", by=by)
        out = {"node": node, "added": created, "record": asdict(record)}
        print(json.dumps(out) if args.json else
              (f"node {node} quarantined (offence {record.offence}): {record.expiry_reason}" if created else
               f"node {node} is already quarantined (offence {record.offence}): {record.reason}"))
        return 0
    released = fleet.release(node, forget=args.forget)
    print(json.dumps({"node": node, "released": released, "forgot": args.forget}) if args.json else
          (f"node {node} released: it burns in before it rejoins" if released else
           f"node {node} had no quarantine record in force") + (" (offences cleared)" if args.forget else ""))
    return 0


def _taints(args: argparse.Namespace, fleet: Any) -> int:
    import time

    from ..coord.store import ControlStoreError
    from ..deploy.taints import KubeNodes, reconcile

    if not args.interval > 0:
        raise ConfigError(f"--interval {args.interval}: give seconds > 0")
    if args.api:
        api = KubeNodes(args.api, args.token_file, args.ca)
    else:
        api = KubeNodes.in_cluster()
    said: set[str] = set()
    while True:
        try:
            done, failed = reconcile(api, fleet.list(), args.fleet)
        except (ControlStoreError, OSError) as e:
            done, failed = [], [f"pass failed, tried again in {args.interval:g} s: {type(e).__name__}: {e}"]
        for line in done:
            print(f"resilient quarantine taints: {line}", flush=True)
        for line in failed:
            if line not in said or args.once:  # a standing problem is said once, not at every pass
                print(f"resilient quarantine taints: {line}", flush=True)
        said = set(failed)
        if args.once:
            return 1 if any("names no Kubernetes Node" not in f for f in failed) else 0
        time.sleep(args.interval)
