"""``resilient local-cluster up|status|wait|kill|down``: a topology's stack on this machine, on loopback.

The work is in :mod:`resilient.deploy.local`; ``up`` returns once the servers
answer and the agents are started, leaving a supervisor behind; ``down``
stops everything and says whether anything had to be killed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path(".local-cluster")


def add_parser(commands: Any) -> None:
    group = commands.add_parser(
        "local-cluster", help="run a topology's whole stack on this machine (etcd, Prometheus, Alertmanager, "
                              "the agents) from installed binaries, on loopback")
    actions = group.add_subparsers(dest="local_cluster", metavar="ACTION", required=True)

    def with_dir(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--dir", type=Path, default=DEFAULT_DIR, metavar="DIR",
                       help=f"the cluster's state, logs and servers' data (default {DEFAULT_DIR})")
        return p

    p = with_dir(actions.add_parser(
        "up", help="start etcd, Prometheus, Alertmanager and one agent per node of TOPOLOGY",
        description="Start, under a supervisor that outlives this command: etcd (unless the topology gives "
                    "endpoints, or has one node), Prometheus scraping every agent with the shipped alert rules, "
                    "Alertmanager with the shipped routes (notifications to DIR/notifications.jsonl), and one "
                    "agent per node and spare node of TOPOLOGY. A crashed or killed agent is started again, "
                    "as the systemd units do; a verdict is final."))
    p.add_argument("topology", type=Path, metavar="TOPOLOGY", help="the topology file (see deploy/README.md)")
    p.add_argument("--workdir", type=Path, metavar="DIR",
                   help="where the agents run: the script and runs/ (default: the topology's workdir, relative "
                        "to the topology file)")
    p.add_argument("--alert-for", type=float, metavar="S",
                   help="cut every alert rule's `for:` to S seconds, to see alerts fire in a short run "
                        "(default: the rules' own)")
    p.add_argument("--restart-limit", type=int, default=5, metavar="N",
                   help="start a crashed agent again at most N times (default 5)")
    p.set_defaults(handler=cmd_up)
    p = with_dir(actions.add_parser("status", help="the cluster's servers, agents and firing alerts"))
    p.add_argument("--json", action="store_true", help="print the state file as JSON")
    p.set_defaults(handler=cmd_status)
    p = with_dir(actions.add_parser("wait", help="wait until the run is over; exit with its exit code"))
    p.add_argument("--timeout", type=float, default=3600.0, metavar="S", help="give up after S seconds (exit 1)")
    p.set_defaults(handler=cmd_wait)
    p = with_dir(actions.add_parser("kill", help="SIGKILL one node's agent (a machine lost) to see it recovered"))
    p.add_argument("node", metavar="NODE", help="the node id (n0, n1, ..., spare0, ...)")
    p.set_defaults(handler=cmd_kill)
    p = with_dir(actions.add_parser("down", help="stop the agents (they checkpoint), then the servers"))
    p.set_defaults(handler=cmd_down)


def _summary(state: dict[str, Any]) -> str:
    lines = [f"run {state['run_id']}: {state['status']}"
             + (f", exit {state['exit_code']}" if state.get("exit_code") is not None else "")
             + (f" ({state['error']})" if state.get("error") else ""),
             f"  workdir     {state['workdir']}   (run directory {state['run_dir']})",
             f"  store       {state.get('store') or 'embedded (one node)'}"]
    if state.get("prometheus"):
        lines.append(f"  prometheus  {state['prometheus']}")
        lines.append(f"  alertmanager {state.get('alertmanager')}")
    for node, a in state.get("agents", {}).items():
        role = "spare" if a["spare"] else "node"
        now = f"running (pid {a['pid']})" if a["running"] else ("restarting" if a["restart_pending"] else "ended")
        lines.append(f"  {role} {node:<8} {now}; starts {a['starts']}, exits {a['exits'] or '-'}; "
                     f"metrics 127.0.0.1:{a['port']}; log {a['log']}")
    return "\n".join(lines)


def cmd_up(args: argparse.Namespace) -> int:
    from ..deploy.local import up

    state = up(args.topology, args.dir, workdir=args.workdir, alert_for_s=args.alert_for,
               restart_limit=args.restart_limit)
    print(_summary(state))
    print(f"stop it with: resilient local-cluster down --dir {args.dir}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from ..chaos import monitor
    from ..core.errors import ConfigError
    from ..deploy.local import alive, read_state

    state = read_state(args.dir)
    if state is None:
        raise ConfigError(f"{args.dir}: no local cluster was brought up there; give the --dir that `up` used")
    if args.json:
        print(json.dumps(state, indent=1))
        return 0
    if state["status"] in ("running", "finished") and not alive(state.get("pid")):
        state["status"] += " (its supervisor is gone: run `down` to clean up)"
    print(_summary(state))
    firing = monitor.firing(state["prometheus"]) if state.get("prometheus") else []
    print(f"  alerts firing: {', '.join(firing) if firing else 'none'}")
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    from ..deploy.local import wait

    state = wait(args.dir, args.timeout)
    if state is None:
        print(f"the run was not over after {args.timeout:g} s")
        return 1
    print(_summary(state))
    code = state.get("exit_code")
    return int(code) if code is not None else 1


def cmd_kill(args: argparse.Namespace) -> int:
    from ..deploy.local import kill_node

    pid = kill_node(args.dir, args.node)
    print(f"killed node {args.node}'s agent (pid {pid}); its workers die with it")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from ..deploy.local import down

    state = down(args.dir)
    print(_summary(state))
    if state["left"]:
        print(f"had to kill {len(state['left'])} process(es) left behind: {state['left']}")
        return 1
    killed = state.get("killed") or []
    if killed:
        print(f"killed {len(killed)} process(es) that did not stop in time: {killed}")
        return 1
    print("stopped; no process left")
    return 0
