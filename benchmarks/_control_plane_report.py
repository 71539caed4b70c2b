"""The control-plane benchmark's result file and plot, from its results (``control_plane_bench.py`` measures)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from resilient.coord.liveness import SILENCE_S

TARGET_REQUESTS = 0.5
"""Steady requests per agent per second (the issue's target)."""
TARGET_KILLED_S = 1.0
"""p99 from a killed node to its decision read by every agent, at 1,024 agents."""
TARGET_SILENT_S = SILENCE_S + 1.0
"""p99 from a silent node to its decision read by every agent, at 1,024 agents: the silence, and 1 s."""


def _worst(r: dict[str, Any], key: str, how: str | None = None) -> float | None:
    """The worst p99 of ``key`` over a result's node losses (those lost ``how``: killed or silent)."""
    return max((t[key]["p99"] for t in r.get("node_loss", []) if t.get(key) and t[key]["p99"] is not None
                and how in (None, t.get("how"))), default=None)


def _most(r: dict[str, Any], key: str) -> float | None:
    """The largest ``key`` over a result's node losses."""
    return max((t[key] for t in r.get("node_loss", []) if t.get(key) is not None), default=None)


def _lag_worst(r: dict[str, Any], kind: str, pct: str) -> float | None:
    """The worst ``pct`` of the simulator's ``kind`` lag over the steady window and the losses."""
    found = [(r.get("steady") or {}).get("simulator_lag", {}).get(kind, {}).get(pct)]
    found += [t.get("simulator_lag", {}).get(kind, {}).get(pct) for t in r.get("node_loss", [])]
    return max((x for x in found if x is not None), default=None)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if "steady" in r]
    if not done:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    ns = [r["agents"] for r in done]
    left.plot(ns, [r["steady"]["requests_per_agent_per_s"] for r in done], "o-", label="all requests")
    methods = sorted({m for r in done for m in r["steady"]["by_method_per_agent_per_s"]})
    for m in methods:
        left.plot(ns, [r["steady"]["by_method_per_agent_per_s"].get(m, 0.0) for r in done], ".--",
                  label=m.replace("etcdserverpb.", ""))
    left.axhline(TARGET_REQUESTS, color="grey", linestyle=":", label=f"target ({TARGET_REQUESTS})")
    left.set_xscale("log", base=2)
    left.set_xlabel("agents")
    left.set_ylabel("requests to etcd per agent per second")
    left.set_title("steady load")
    left.legend(fontsize=7)
    for key, label, how in (("applied_s", "killed: decision read by all", "killed"),
                            ("decision_delivered_s", "killed: decision in every watch", "killed"),
                            ("applied_s", "silent: decision read by all", "silent"),
                            ("judged_lost_s", "silent: judged lost by all", "silent")):
        points = [(r["agents"], _worst(r, key, how)) for r in results if _worst(r, key, how) is not None]
        right.plot([x for x, _ in points], [y for _, y in points], "o-", label=f"{label}, p99")
    lag = [(r["agents"], _lag_worst(r, "sleep", "p99")) for r in results if _lag_worst(r, "sleep", "p99") is not None]
    right.plot([x for x, _ in lag], [y for _, y in lag], "x:", color="black", label="simulator's lag (sleep), p99")
    right.axhline(TARGET_KILLED_S, color="grey", linestyle=":", label=f"target, killed ({TARGET_KILLED_S:g} s)")
    right.axhline(TARGET_SILENT_S, color="grey", linestyle="--", label=f"target, silent ({TARGET_SILENT_S:g} s)")
    right.set_xscale("log", base=2)
    if any(line.get_xydata().size for line in right.get_lines()):
        right.set_yscale("log")
    right.set_xlabel("agents")
    right.set_ylabel("seconds after the loss")
    right.set_title("node loss, by every agent")
    right.legend(fontsize=7)
    failed = [f"{r['agents']}" for r in results if r.get("failed")]
    if failed:
        fig.text(0.5, 0.01, f"not measured to the end (see the result file): {', '.join(failed)} agents",
                 ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)


def _p(d: dict[str, Any] | None, key: str = "p99") -> Any:
    return (d or {}).get(key)


def _failure(r: dict[str, Any]) -> str:
    """Why an N was not measured to the end, with its agents' errors (the first of them), or ''."""
    if not r.get("failed"):
        return ""
    first = (r.get("first_errors") or [""])[0].split(": ", 1)[-1]
    return f"{r['failed'].splitlines()[0]}; agents' errors: {r.get('errors')}" + (f", the first: {first}" if first else "")


def render(out: dict[str, Any]) -> str:
    """The result file: the summary per N, the steady load by method, each node loss, the simulator's lag."""
    rows, methods, losses, lags, starts = [], [], [], [], []
    for r in out["results"]:
        n = r["agents"]
        s = r.get("steady", {})
        rows.append(f"| {n} | {s.get('requests_per_agent_per_s')} | {s.get('etcd_cpu_cores')} | {s.get('etcd_rss_mib')} "
                    f"| {s.get('watch_events_per_agent_per_s')} "
                    f"| {_worst(r, 'applied_s', 'killed')} | {_worst(r, 'applied_s', 'silent')} "
                    f"| {_p((r.get('grow') or {}).get('applied_after_decision_s'))} "
                    f"| {_p((r.get('first_round') or {}).get('placed_s'))} "
                    f"| {_p((r.get('restart_round') or {}).get('placed_s'))} "
                    f"| {len(r.get('node_loss', []))} | {_failure(r)} |")
        by = s.get("by_method_per_agent_per_s", {})
        methods.append(f"| {n} | " + "; ".join(f"{k.replace('etcdserverpb.', '')} {v}" for k, v in by.items()) + " |")
        for t in r.get("node_loss", []):
            lag = t.get("simulator_lag", {})
            losses.append(f"| {n} | {t['how']} | {_p(t['accusations_delivered_s'])} | {_p(t['judged_lost_s'])} "
                          f"| {t['decided_s']} | {_p(t['decision_delivered_s'])} | {_p(t['applied_s'])} "
                          f"| {t['agents_applied']}/{t['agents_alive']} | {t['watch_events_per_agent']} "
                          f"| {t['requests_per_agent']} | {t['etcd_cpu_cores']} | {t['simulator_cpu_cores']} "
                          f"| {_p(lag.get('sleep'))} | {_p(lag.get('tick'))} | {_p(lag.get('pass_cpu_ms'), 'p50')} "
                          f"| {_p(t.get('canary_read_s'), 'max')} |")
        lag = s.get("simulator_lag", {})
        lags.append(f"| {n} | {r.get('simulator_processes')} | {s.get('simulator_cpu_cores')} "
                    f"| {_p(lag.get('sleep'))} | {_p(lag.get('sleep'), 'max')} | {_p(lag.get('publish_timing'))} "
                    f"| {_p(lag.get('tick_loop'))} | {_p(s.get('canary_read_s'), 'max')} |")
        waves = r.get("start_waves", [])
        starts.append(f"| {n} | {r.get('start_s')} | {r.get('start_retries')} | "
                      + "; ".join(f"{w['nodes']}: {w.get('seconds', '-')} s, read {_p(w.get('canary_read_s'), 'max')}"
                                  for w in waves) + " |")
    t = out["targets"]
    dirty = f" (with uncommitted changes: {', '.join(x.strip() for x in out['uncommitted'])})" if out["uncommitted"] else ""
    return (
        "# The control plane at scale, simulated\n\n"
        f"commit `{out['commit']}`{dirty}; `{out['command']}`; load at start {out['load']}, at end "
        f"{out['load_after']}; {out['seconds']} s; {out['cpus']} CPUs\n\n"
        + (f"{out['note']}\n\n" if out.get("note") else "")
        + f"Targets: steady requests per agent per second <= {t['requests_per_agent_per_s']}; at 1,024 agents, p99 "
        f"from a killed node to its decision read by every agent <= {t['killed_to_read_p99_s']} s, from a silent "
        f"node <= {t['silent_to_read_p99_s']} s (SILENCE_S + 1 s).\n\n"
        "## Summary\n\n"
        "Latencies in seconds: the worst p99 over the trials of that kind, from the loss.\n\n"
        "| agents | requests/agent/s | etcd cores | etcd RSS MiB | watch events/agent/s "
        "| killed: to decision read by all | silent: to decision read by all | grow: read by all after commit "
        "| first round | restart round | losses | failed |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        "## Steady requests per agent per second, by method\n\n| agents | by method |\n|---|---|\n"
        + "\n".join(methods) + "\n\n"
        "## Each node loss\n\n"
        "Seconds from the loss (p99 over the agents): the accusations in every agent's watch; the node judged lost "
        "by every agent; the decision committed (its commit sent); the decision in every agent's watch; the "
        "decision read by every agent's watch-loop pass.  Then what the loss cost until every agent read the "
        "decision, and the simulator's lag meanwhile: how late a thread sleeping 50 ms woke (p99), how late a "
        "watch-loop pass began after the loop came round to it (p99; up to 0.1 s of it is the loop's interval), "
        "a pass's CPU (ms, p50), and the slowest read of etcd from outside the simulation.\n\n"
        "| agents | how | accusations delivered | judged lost | decided | decision delivered | decision read "
        "| read/alive | watch events/agent | requests/agent | etcd cores | simulator cores | sleep late "
        "| pass late | pass CPU ms | outside read max s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(losses) + "\n\n"
        "## The simulator in steady state\n\n"
        "Its CPU (cores, all its processes), how late its threads ran against their schedule (seconds), and the "
        "slowest read of etcd from outside the simulation (seconds).\n\n"
        "| agents | processes | simulator cores | sleep late p99 | sleep late max | timing write late p99 "
        "| watch loop late p99 | outside read max |\n"
        "|---|---|---|---|---|---|---|---|\n" + "\n".join(lags) + "\n\n"
        "## Starting the agents\n\n"
        "The nodes start in waves; each wave ends when every started agent sees every started node live.  Per "
        "wave: the nodes up, its seconds, and the slowest read of etcd from outside the simulation meanwhile.\n\n"
        "| agents | start s | start retries | waves |\n|---|---|---|---|\n" + "\n".join(starts) + "\n")


