"""The control plane at scale, by simulation: N agents' store sides on one real etcd, N = 16 ... 1,024.

    python benchmarks/control_plane_bench.py                        # writes benchmarks/results/control_plane_bench.{json,md,png}
    python benchmarks/control_plane_bench.py --agents 16 --trials 1 # a quick look (about a minute)

Each simulated agent is the store side of a real agent
(``_control_plane_agents.Agent``): its own etcd client, the watch of the
run's launches (``PrefixWatch``; the scorer, the agent of rank 0, also the
watch of every node's timing windows), its ``Presence`` (a signed presence
key on a 9 s lease renewed every 3 s, the peers judged from the accusations
in the watch), its ``ClusterStore`` and ``ClusterWatch`` (the recovery keys,
the pool, the decision's claim and one-transaction commit) and its
``EtcdRendezvous``.  What a real agent's other parts write is written as
they write it: every second the timing windows of its rank (its outbox,
full: 16 windows, as with steps of a few tens of milliseconds), sent to the
scorer's timing link (a UDP datagram; to etcd while no scorer is announced,
as the agent's peer watch does), the scorer announcing its link once; every
second the question the peer watch asks of the rendezvous (nodes waiting
to join?); every second the quarantine check, from a watch of the node's
record as the agent's quarantine gate keeps it; every 30 s the status copy
(``status/<node>``, about 2 kB).  The workers are simulated: each
member node holds one rank; a few spare nodes each hold one warm spare in
the pool.  Probes are simulated too: a lost node's probers write their
(signed) accusations themselves, at once when it was killed (its port
refuses) and ``SILENCE_S`` after the loss when it went silent (powered off).

The agents are spread over ``--procs`` processes (``_control_plane_process``),
each hosting N/P of them, so that the simulation uses every core; the
parent drives them through pipes and compares their ``time.time()`` (one
machine, one clock).  No agent shares anything with another: each asks etcd
exactly what a real agent asks, as often.  The processes run in the
scheduler's idle class, each in a session of its own at the lowest weight,
so that etcd is served first where the cores run short.  The nodes start in
waves of ``--wave``, each once every started agent sees every started node
live.  Once a second the parent reads etcd itself, timed (the *canary*):
whether etcd answers promptly while the simulation runs.

Per N: a fresh etcd; the agents started and settled; the member nodes form
the run's first rendezvous round (every member's ``EtcdRendezvous.next`` at
once: the time until each has its place, p50 and p99); then

* **steady state**, ``--window`` seconds: requests begun on etcd (its
  ``grpc_server_started_total``) in total and per agent, by method; watch
  events delivered per agent per second; etcd's CPU (cores) and resident
  memory; the simulator's CPU (cores) and lag;
* **node loss with a ready spare** (``--trials`` times, alternately killed
  and silent): a member node's agent stops (its client fails every request
  from then on, its lease lapses); its probers accuse it; every agent's
  presence judges it lost; the survivors report waiting, the generation's
  collector reads the reports, takes the generation's claim and commits the
  promotion of a pool spare in one transaction; every agent applies it (its
  watch loop's pass reads it) and the members publish their next
  generation.  Times from the loss to: the node judged lost by every agent;
  the decision committed; the decision in every agent's copy of the keys
  (its watch delivered it); the decision read by every agent's pass (p50,
  p99);
* **a grow**: the agent holding rank 0 commits a grow onto a pool spare; the
  time until every agent read it (p50, p99);
* **a restart's round**: every live member node of the first round joins the
  next round at once: the time until each has its place (p50, p99).

The simulator's lag, per phase and over its processes: how late each
periodic write and each watch-loop pass began after it was due, how late a
thread sleeping 50 ms wakes (p50, p99, max), and the CPU of a watch-loop
pass.  Where the lag nears the latencies, those are this machine's limit,
not the protocol's: a real agent does its share on a core of its own.

Targets: steady load at most 0.5 requests per agent per second, flat in N;
at 1,024 agents, p99 from a killed node to its decision read by every agent
at most 1 s, from a silent node at most ``SILENCE_S`` + 1 s.  There is no
peer in this run: torchrun's agents meet in etcd only at a rendezvous.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import secrets
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _control_plane_agents import AT, ROOT
from _control_plane_process import Spec, serve
from _control_plane_report import TARGET_KILLED_S, TARGET_REQUESTS, TARGET_SILENT_S, plot, render
from _provenance import commit, load_now, uncommitted_code_changes
from store_load_bench import counters

from resilient.chaos.cluster import Etcd
from resilient.coord.etcd import EtcdClient
from resilient.coord.etcd_transport import EtcdConfig
from resilient.coord.liveness import PROBERS, SILENCE_S, probers_of
from resilient.coord.store import ControlStoreError

HERE = Path(__file__).resolve().parent


class Fleet:
    """The simulation's processes, driven together: each command goes to all at once, then every answer is read."""

    def __init__(self, specs: list[Spec]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.pipes = []
        self.procs = []
        for spec in specs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(child, spec), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def all(self, name: str, *args: Any, timeout_s: float = 600.0) -> list[Any]:
        for pipe in self.pipes:
            pipe.send((name, args))
        answers = []
        deadline = min(time.monotonic() + timeout_s, DEADLINE[0])
        for pipe in self.pipes:
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"{name}: a simulation process did not answer within {timeout_s:.0f} s")
            status, value = pipe.recv()
            if status != "ok":
                raise RuntimeError(f"{name} failed in a simulation process: {value}")
            answers.append(value)
        return answers

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def close(self) -> None:
        DEADLINE[0] = math.inf  # closing is never cut short
        try:
            self.all("close", timeout_s=120.0)
        except (TimeoutError, RuntimeError, OSError, EOFError):
            pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "n": 0}
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 3),
            "p99": round(ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))], 3),
            "n": len(ordered)}


def _lag_summary(taken: list[dict[str, Any]]) -> dict[str, Any]:
    """The processes' lag samples merged: per kind, how late (p50, p99, max, seconds); a pass's CPU (ms)."""
    late: dict[str, list[float]] = {}
    cpu: list[float] = []
    skipped: dict[str, int] = {}
    for t in taken:
        for k, v in t["late"].items():
            late.setdefault(k, []).extend(v)
        cpu.extend(t["pass_cpu"])
        for k, v in t["skipped"].items():
            skipped[k] = skipped.get(k, 0) + v
    out: dict[str, Any] = {k: {**_pcts(v), "max": round(max(v), 3)} for k, v in sorted(late.items()) if v}
    if cpu:
        ordered = sorted(cpu)
        out["pass_cpu_ms"] = {"p50": round(1000 * statistics.median(ordered), 2),
                              "p99": round(1000 * ordered[round(0.99 * (len(ordered) - 1))], 2),
                              "n": len(ordered)}
    out["skipped_as_still_in_flight"] = skipped
    return out


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _etcd_pid(etcd: Etcd) -> int:
    """The etcd server's process, found by its data directory on its command line."""
    wanted = f"--data-dir={etcd.data}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if wanted in (entry / "cmdline").read_bytes().split(b"\0"):
                    return int(entry.name)
            except OSError:
                continue
    raise RuntimeError(f"no etcd process with {wanted.decode()}")


class Canary:
    """Every second, one read of etcd from this (parent) process, timed, and etcd's CPU since the last: whether
    etcd itself answers promptly while the simulated agents run (printed every ``report_s``)."""

    def __init__(self, url: str, etcd_pid: int, report_s: float = 10.0) -> None:
        self._client = EtcdClient(EtcdConfig.from_url(url))
        self._pid = etcd_pid
        self._report = report_s
        self.samples: list[float] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        cpu, at, printed = _proc_cpu(self._pid), time.monotonic(), time.monotonic()
        while not self._done.wait(1.0):
            t = time.monotonic()
            try:
                self._client.get(ROOT + "canary")
                self.samples.append(time.monotonic() - t)
            except ControlStoreError as e:
                print(f"  canary: {type(e).__name__}: {e}", flush=True)
            if time.monotonic() - printed >= self._report:
                now_cpu, now = _proc_cpu(self._pid), time.monotonic()
                recent = self.samples[-10:]
                print(f"  etcd {((now_cpu - cpu) / (now - at)):.2f} cores, read in {max(recent, default=0):.3f} s "
                      f"at most, load {os.getloadavg()[0]:.1f}", flush=True)
                cpu, at, printed = now_cpu, now, now

    def take(self) -> dict[str, float | None]:
        """The reads' times since the last take (p50, p99, max)."""
        found, self.samples = self.samples, []
        return {**_pcts(found), "max": round(max(found), 3) if found else None}

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=10)


def _requests(after: dict[Any, float], before: dict[Any, float]) -> float:
    """Requests begun on etcd between two readings of its counters."""
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == "grpc_server_started_total")


DEADLINE = [math.inf]
"""When the whole run must end (``--deadline-s``, monotonic): every wait past it gives up, and its N is a failure."""


def _wait(what: str, ok: Any, timeout_s: float, interval_s: float = 0.05) -> None:
    deadline = min(time.monotonic() + timeout_s, DEADLINE[0])
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s (or the run's deadline)")
        time.sleep(interval_s)


def _merged(fleet: Fleet) -> dict[str, Any]:
    """Every process's marks of the trial in flight, merged."""
    found: dict[str, Any] = {"judged": {}, "applied": {}, "accused_seen": {}, "decision_seen": {}, "decided": None,
                             "alive": 0}
    for m in fleet.all("marks"):
        for k in ("judged", "applied", "accused_seen", "decision_seen"):
            found[k].update(m[k])
        found["decided"] = found["decided"] or m["decided"]
        found["alive"] += m["alive"]
    return found


def _round(fleet: Fleet, members_only: bool, timeout_s: float) -> dict[str, Any]:
    """Every (member) node joins the next rendezvous round at once: when each had its place, why it formed."""
    t0 = time.time()
    answers = fleet.all("join_round", members_only, timeout_s=timeout_s)
    placed = [t - t0 for a in answers for t in a["placed"]]
    return {"placed_s": _pcts(placed), "nodes": len(placed),
            "generation": next(a["generation"] for a in answers if a["generation"] is not None),
            "formed_by": sorted({w for a in answers for w in a["formed_by"]})}


def measure(n: int, args: argparse.Namespace) -> dict[str, Any]:
    procs = args.procs or max(1, min(16, math.ceil(n / 64)))
    root = Path(tempfile.mkdtemp(prefix=f"control-plane-{n}-"))
    etcd = Etcd(root / "etcd")
    metrics = f"http://{etcd.url.split('://', 1)[1]}/metrics"
    etcd_pid = _etcd_pid(etcd)
    spares = args.trials + 2
    members = n - spares
    nodes = [(f"n{i:04d}", i) if i < members else (f"s{i - members:04d}", None) for i in range(n)]
    token = secrets.token_hex(32)
    threads = max(8, args.threads // procs)
    specs = [Spec(url=etcd.url, token=token, outage_tolerance_s=args.outage_tolerance_s, nodes=tuple(nodes[p::procs]), members=members, threads=threads,
                  nice=args.nice, idle=not args.no_idle)
             for p in range(procs)]
    result: dict[str, Any] = {"agents": n, "member_nodes": members, "spare_nodes": spares,
                              "simulator_processes": procs, "threads_per_process": threads}
    canary = Canary(etcd.url, etcd_pid)
    fleet = Fleet(specs)
    started = time.monotonic()
    dead: set[str] = set()
    try:
        # The nodes come up in waves of --wave, each wave once every started agent sees every started node live:
        # started all at once, the agents' judging of each new node would be more than this machine can do.
        up = 0
        waves: list[dict[str, Any]] = []
        result["start_waves"] = waves
        while up < n:
            t = time.monotonic()
            starts = fleet.all("start", math.ceil(args.wave / procs), timeout_s=args.settle_timeout)
            up = sum(s["started"] for s in starts)
            waves.append({"nodes": up})
            _wait(f"every agent to see the {up} nodes started live",
                  lambda up=up: min(fleet.all("fewest_live")) >= up, args.settle_timeout, interval_s=0.2)
            waves[-1].update({"seconds": round(time.monotonic() - t, 1), "canary_read_s": canary.take()})
            print(f"N={n} start: {json.dumps(waves[-1])}", flush=True)
        result["start_s"] = round(time.monotonic() - started, 2)
        result["start_retries"] = sum(s["retries"] for s in starts)
        result["start_canary_read_s"] = canary.take()
        result["first_round"] = _round(fleet, True, args.settle_timeout)
        print(f"N={n} first round: {json.dumps(result['first_round'])}", flush=True)
        first = result["first_round"]["generation"]
        fleet.all("publish_first", first)
        fleet.all("run_loops")
        time.sleep(5.0)
        before, t0 = counters(metrics), time.monotonic()
        sims0, cpu0 = fleet.all("sample"), _proc_cpu(etcd_pid)
        fleet.all("lag")
        canary.take()
        time.sleep(args.window)
        after, t1 = counters(metrics), time.monotonic()
        sims1, cpu1 = fleet.all("sample"), _proc_cpu(etcd_pid)
        lag = _lag_summary(fleet.all("lag"))
        read = canary.take()
        seconds = t1 - t0
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}
        started_calls = {f"{k[1]} ({k[2]})": v for k, v in delta.items()
                         if k[0] == "grpc_server_started_total" and v > 0}
        total = sum(started_calls.values())
        events = sum(b["events"] - a["events"] for a, b in zip(sims0, sims1, strict=True))
        sim_cpu = sum(b["cpu_s"] - a["cpu_s"] for a, b in zip(sims0, sims1, strict=True))
        result["steady"] = {
            "window_s": round(seconds, 2), "requests_per_s": round(total / seconds, 1),
            "requests_per_agent_per_s": round(total / seconds / n, 3),
            "by_method_per_agent_per_s": {k: round(v / seconds / n, 3) for k, v in sorted(started_calls.items())},
            "watch_events_per_agent_per_s": round(events / seconds / n, 2),
            "etcd_cpu_cores": round((cpu1 - cpu0) / seconds, 3), "etcd_rss_mib": round(_proc_rss_mib(etcd_pid), 1),
            "simulator_cpu_cores": round(sim_cpu / seconds, 3), "simulator_lag": lag,
            "canary_read_s": read,
        }
        print(f"N={n} steady: {json.dumps(result['steady'])}", flush=True)
        losses = []
        for trial in range(args.trials):
            live_members = [node for node, rank in nodes if rank is not None and node not in dead]
            victim = live_members[(trial * 7 + 1) % len(live_members)]
            how = "killed" if trial % 2 == 0 else "silent"
            live_nodes = {node for node, _ in nodes if node not in dead}
            probers = probers_of(live_nodes, victim, PROBERS)
            generation = next(g for g in fleet.all("generation_of", victim) if g is not None)
            decision_key = AT.decision(generation)
            fleet.all("watch", victim, frozenset(probers), decision_key)
            sims_before, etcd_before = fleet.all("sample"), _proc_cpu(etcd_pid)
            fleet.all("lag")
            canary.take()
            requests_before = counters(metrics)
            # Alternately killed (its port refuses at once: its probers accuse it at once) and silent (powered
            # off, its traffic dropped: accused after SILENCE_S without an answer).
            lost_at = time.time()
            fleet.all("kill", victim)
            dead.add(victim)
            if how == "silent":
                time.sleep(max(0.0, lost_at + SILENCE_S - time.time()))
            fleet.all("accuse", victim, probers)
            alive = n - len(dead)
            try:
                _wait("every agent to read the decision", lambda alive=alive: len(_merged(fleet)["applied"]) >= alive,
                      args.trial_timeout, interval_s=0.1)
                complete = True
            except TimeoutError:
                complete = False
            marks = _merged(fleet)
            sims_after, etcd_after = fleet.all("sample"), _proc_cpu(etcd_pid)
            requests = _requests(counters(metrics), requests_before)
            spent = max(1e-9, time.time() - lost_at)
            events = sum(b["events"] - a["events"] for a, b in zip(sims_before, sims_after, strict=True))
            decided = marks["decided"]

            def since(stamps: dict[str, float], zero: float, victim: str = victim) -> dict[str, float | None]:
                return _pcts([t - zero for node, t in stamps.items() if node != victim])

            losses.append({
                "victim": victim, "how": how, "generation": generation, "complete": complete,
                "judged_lost_s": since(marks["judged"], lost_at),
                "accusations_delivered_s": since(marks["accused_seen"], lost_at),
                "decided_s": round(decided - lost_at, 3) if decided else None,
                "decision_delivered_s": since(marks["decision_seen"], lost_at),
                "applied_s": since(marks["applied"], lost_at),
                "applied_after_decision_s": since(marks["applied"], decided) if decided else None,
                "agents_applied": len(marks["applied"]), "agents_alive": alive,
                # What the recovery cost, from the loss until every agent read the decision: watch events each
                # agent received, requests begun on etcd, and the CPU of etcd and of the simulator meanwhile.
                "watch_events_per_agent": round(events / alive, 1),
                "requests_per_agent": round(requests / alive, 1),
                "seconds": round(spent, 2),
                "etcd_cpu_cores": round((etcd_after - etcd_before) / spent, 2),
                "simulator_cpu_cores": round(sum(b["cpu_s"] - a["cpu_s"] for a, b in
                                                 zip(sims_before, sims_after, strict=True)) / spent, 2),
                "simulator_lag": _lag_summary(fleet.all("lag")), "canary_read_s": canary.take()})
            print(f"N={n} loss {trial}: {json.dumps(losses[-1])}", flush=True)
            fleet.all("watch", None, frozenset(), None)
            time.sleep(args.settle_s)  # the members publish their next generation; the simulator catches up
        result["node_loss"] = losses
        generation = max(g for g in fleet.all("generation_of", nodes[0][0]) if g is not None)
        fleet.all("watch", None, frozenset(), AT.decision(generation))
        committed = [t for t in fleet.all("grow") if t is not None]
        grow: dict[str, Any] = {"committed": bool(committed)}
        if committed:
            alive = n - len(dead)
            try:
                _wait("every agent to read the grow", lambda: len(_merged(fleet)["applied"]) >= alive,
                      args.trial_timeout, interval_s=0.1)
            except TimeoutError:
                pass
            marks = _merged(fleet)
            grow["decision_delivered_s"] = _pcts([t - committed[0] for t in marks["decision_seen"].values()])
            grow["applied_after_decision_s"] = _pcts([t - committed[0] for t in marks["applied"].values()])
            grow["agents_applied"], grow["agents_alive"] = len(marks["applied"]), alive
        fleet.all("watch", None, frozenset(), None)
        result["grow"] = grow
        print(f"N={n} grow: {json.dumps(grow)}", flush=True)
        time.sleep(args.settle_s)
        result["restart_round"] = _round(fleet, True, args.trial_timeout)
        print(f"N={n} restart round: {json.dumps(result['restart_round'])}", flush=True)
    except (TimeoutError, RuntimeError) as e:  # recorded: what this machine could not simulate is a result
        result["failed"] = f"{type(e).__name__}: {str(e)[:2000]}"
        result["canary_read_s_until_failed"] = canary.take()
        print(f"N={n}: {result['failed']}", flush=True)
    finally:
        try:
            errors = fleet.all("errors", timeout_s=60.0)
            result["errors"] = sum(e["count"] for e in errors)
            result["first_errors"] = [line for e in errors for line in e["first"]][:5]
        except (TimeoutError, RuntimeError, OSError, EOFError) as e:
            result["errors"] = f"not read: {type(e).__name__}: {e}"
        canary.close()
        fleet.close()
        etcd.close()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", default="16,64,256,1024")
    p.add_argument("--window", type=float, default=20.0, help="seconds of steady state measured per N")
    p.add_argument("--trials", type=int, default=4, help="node losses per N (alternately killed and silent)")
    p.add_argument("--trials-at", default="", help="fewer trials for some N, as N:TRIALS,... (e.g. 1024:2)")
    p.add_argument("--procs", type=int, default=0, help="simulation processes (0: one per 64 agents, at most 16)")
    p.add_argument("--threads", type=int, default=64, help="threads for requests and passes, over all processes")
    p.add_argument("--no-idle", action="store_true",
                   help="run the simulation processes at --nice instead of the idle scheduling class")
    p.add_argument("--nice", type=int, default=10, help="with --no-idle: their niceness (etcd keeps 0)")
    p.add_argument("--wave", type=int, default=64, help="nodes started at once, before all see them live")
    p.add_argument("--settle-timeout", type=float, default=600.0)
    p.add_argument("--trial-timeout", type=float, default=60.0)
    p.add_argument("--settle-s", type=float, default=3.0, help="pause after each loss and the grow")
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="end the whole run within this many seconds (an N still running is recorded as failed)")
    p.add_argument("--outage-tolerance-s", type=float, default=30.0,
                   help="the simulated agents' etcd client outage tolerance (the agent's default: 30)")
    p.add_argument("--note", default="", help="a line for the result file (e.g. why fewer trials at some N)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "control_plane_bench")
    args = p.parse_args()
    started, load = time.time(), load_now()
    fewer = {int(a): int(b) for a, b in (x.split(":") for x in args.trials_at.split(",") if x)}
    if args.deadline_s:
        DEADLINE[0] = time.monotonic() + args.deadline_s
    results: list[dict[str, Any]] = []
    for n in (int(x) for x in args.agents.split(",")):
        deadline = DEADLINE[0]
        results.append(measure(n, argparse.Namespace(**{**vars(args), "trials": fewer.get(n, args.trials)})))
        DEADLINE[0] = deadline
        write(results, args, started, load)  # each N as it is done: a later N's failure loses nothing
    print(args.out.with_suffix(".md").read_text())
    return 0


def write(results: list[dict[str, Any]], args: argparse.Namespace, started: float, load: dict[str, Any]) -> None:
    out = {"commit": commit(), "uncommitted": uncommitted_code_changes(),
           "command": "python benchmarks/control_plane_bench.py " + shlex.join(sys.argv[1:]), "load": load,
           "load_after": load_now(), "seconds": round(time.time() - started, 1), "cpus": os.cpu_count(),
           "note": args.note, "results": results,
           "targets": {"requests_per_agent_per_s": TARGET_REQUESTS, "killed_to_read_p99_s": TARGET_KILLED_S,
                       "silent_to_read_p99_s": TARGET_SILENT_S, "at_agents": 1024}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    args.out.with_suffix(".md").write_text(render(out))


if __name__ == "__main__":
    sys.exit(main())
