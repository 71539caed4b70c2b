"""Running a drill on this machine: the reference run, the faulted run, teardown, and the score.

:func:`run_drill` brings up what the drill's topology asks for (one node
agent under ``resilient run``, its ranks and spares, on loopback), runs the
uninterrupted reference first when the drill expects equality, then the
same workload with the drill's fault plan, and scores what the run left
(:mod:`resilient.chaos.score`).  Every process a run starts lives in a
process group of its own; it is killed when the run overruns the drill's
timeout, on Ctrl-C and on any error, and the drill fails when a process of
it is still alive afterwards.

Each drill writes into ``OUT/<name>/``: ``reference/`` and ``faulted/``
(the run directories, traces, checkpoints and final states: those of an
earlier run of the drill are removed first), ``plan.json`` (the fault
schedule as the workers got it), ``<name>.json``, ``<name>.md`` and the
timeline ``<name>.png`` (:mod:`resilient.chaos.timeline`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError
from ..faults.plan import FaultPlan
from . import cluster, monitor, netns, s3proxy
from .drill import Drill
from .gameday import predict
from .host import HostInjector
from .host_faults import unavailable
from .score import Measured, Observed, Verdict, judge, to_json
from .timeline import draw

Progress = Callable[[str], None]


@dataclass(frozen=True)
class DrillResult:
    drill: Drill
    observed: Observed
    measured: Measured
    verdicts: list[Verdict]
    record: dict[str, Any]
    report: Path
    """The Markdown report."""

    @property
    def passed(self) -> bool:
        return bool(self.record["passed"])


def agent_command(drill: Drill, run_dir: Path, out: Path, plan: Path | None, run_id: str,
                  metrics_port: int | None = None, *, node: str = "n0", spare: bool = False,
                  store: str | None = None, ckpt: str | None = None, endpoint: str | None = None,
                  address: str = "127.0.0.1") -> list[str]:
    """``resilient run`` for one of the drill's runs (``plan`` None: the reference, without faults or spares).

    The reference of a drill of several nodes is one agent with every rank of the world (the same world, the
    same data split, the same sums); its faulted run is one agent per ``node``, meeting through ``store``."""
    t, w = drill.topology, drill.workload
    ranks = str(t.nproc_per_node) if t.min_ranks is None or plan is None else f"{t.min_ranks}:{t.nproc_per_node}"
    if plan is None and drill.clustered:
        ranks = str(drill.world)
    restarts = 3 + len(drill.all_host_faults) + len(drill.faults)
    cmd = [sys.executable, "-m", "resilient", "run", "--run-dir", str(run_dir), "--quiet", "--run-id", run_id,
           "--node-id", node, "--nproc-per-node", ranks, "--max-restarts", str(restarts)]
    if plan is not None and store is not None:
        nnodes = str(t.nodes) if t.min_nodes is None else f"{t.min_nodes}:{t.nodes}"
        cmd += ["--nnodes", nnodes, "--store", store, "--local-addr", address, "--rdzv-last-call", "1",
                *(["--role", "spare"] if spare else [])]
    if plan is not None:
        cmd += ["--fault-plan", str(plan), *(["--spares", str(t.spares)] if t.spares else [])]
        for name, seconds in t.section_timeouts:
            cmd += ["--section-timeout", f"{name}={seconds:g}"]
        cmd += list(t.agent_args)
    if metrics_port is not None:
        cmd += ["--metrics-port", str(metrics_port)]
    script = drill.script_path()
    if script is None:
        cmd += ["-m", "resilient.chaos.workload", "--steps", str(w.steps), "--out", str(out),
                "--ckpt", ckpt or str(out / "ckpt"), "--every", str(w.checkpoint_every),
                *(["--endpoint-url", endpoint] if endpoint else [])]
        if w.step_sleep_s:
            cmd += ["--step-sleep", f"{w.step_sleep_s:g}"]
        if w.own_group:
            cmd += ["--own-group"]
    else:
        cmd += [str(script), *w.args]
    return cmd


def run_once(cmd: list[str], log: Path, timeout_s: float, progress: Progress | None = None,
             label: str = "", tick: Callable[[], None] | None = None) -> int | None:
    """Run ``cmd`` in a process group of its own; its exit status, or None when it overran ``timeout_s``.

    ``tick`` is called ten times a second while it runs (the host faults' injector).  Whatever happens (the
    timeout, Ctrl-C, an error here), the whole group is killed before this returns."""
    return run_agents({"": (cmd, log)}, timeout_s, progress, label, tick)[""]


def run_agents(agents: dict[str, tuple[list[str], Path]], timeout_s: float, progress: Progress | None = None,
               label: str = "", tick: Callable[[], None] | None = None,
               env: dict[str, str] | None = None,
               late: dict[str, tuple[list[str], Path]] | None = None) -> dict[str, int | None]:
    """Run every agent (``{node: (command, log)}``), each in a process group of its own, until all have ended;
    each one's exit status, None for those still running at ``timeout_s``.  Agents put into ``late`` while this
    runs (by ``tick``: a resubmitted job) are started then and waited for too.  Every group is killed before
    this returns, whatever happens."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    codes: dict[str, int | None] = {name: None for name in agents}
    started = time.monotonic()

    def start(name: str, cmd: list[str], log: Path) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                           env=env)
        codes[name] = None

    try:
        for name, (cmd, log) in agents.items():
            start(name, cmd, log)
        while True:
            for name, (cmd, log) in list((late or {}).items()):
                if name not in procs:
                    start(name, cmd, log)
            for name, proc in procs.items():
                if codes[name] is None:
                    codes[name] = proc.poll()
            if all(c is not None for c in codes.values()):
                break
            time.sleep(0.1 if tick is not None else 0.5)
            if tick is not None:
                tick()
            elapsed = time.monotonic() - started
            if progress is not None:
                progress(f"{label}: {elapsed:.0f} s")
            if elapsed > timeout_s:
                break
    finally:
        for proc in procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the agent's group; its workers have sessions of their own
            except ProcessLookupError:
                pass
            if proc.poll() is None:
                proc.wait(timeout=30)
    return codes


def leftovers(run_dir: Path) -> list[int]:
    """Processes still alive that were started for ``run_dir`` (their ``RESILIENT_RUN_DIR``): workers, spares."""
    mark = f"RESILIENT_RUN_DIR={run_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if state != "Z" and mark in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def tear_down(run_dir: Path, grace_s: float = 10.0) -> list[int]:
    """Wait up to ``grace_s`` for the run's processes to end (workers die with their agent), SIGKILL those left;
    returns the ones that had to be killed (a teardown that needs this is reported)."""
    deadline = time.monotonic() + grace_s
    while (left := leftovers(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a SIGKILL mid-write: not an event
    return out


def _final(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / "final.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _accounts(run_dir: Path) -> list[Any]:
    from ..metrics.report import load

    try:
        return [r.account for r in load(run_dir)]
    except Exception:  # noqa: BLE001  no ledger (the run never started): goodput unknown, scored as such
        return []


def _goodput(run_dir: Path) -> float | None:
    """The run's goodput: the lowest of its nodes' that trained (a spare node that never held a rank has none)."""
    accounts = _accounts(run_dir)
    trained = [a for a in accounts if a.attempted_steps > 0] or accounts
    return min((a.goodput_ratio for a in trained), default=None)


def _verify_commits(drill: Drill, ckpt: Path) -> tuple[int, list[str]] | None:
    """(committed checkpoints, the problems of those that do not verify) in the bundled workload's checkpoint
    directory; None with a script of the user's (its checkpoints are where it keeps them)."""
    if drill.script_path() is not None or not ckpt.is_dir():
        return None
    from ..checkpoint.inspect import list_checkpoints, verify_checkpoint
    from ..checkpoint.locations import open_storage

    storage = open_storage(ckpt)
    names = [c.name for c in list_checkpoints(storage)]
    bad = [f"{r.name}: {r.problem}" for r in (verify_checkpoint(storage, n) for n in names) if not r.ok]
    return len(names), bad


def _verify_s3_commits(s3: s3proxy.S3Endpoint, url: str) -> tuple[int, list[str]]:
    """The same check on the drill's bucket, read from the server directly (not through the fault proxy)."""
    from ..checkpoint.inspect import list_checkpoints, verify_checkpoint
    from ..checkpoint.locations import open_storage

    with s3proxy.credentials():
        storage = open_storage(url, endpoint_url=s3.direct)
        names = [c.name for c in list_checkpoints(storage)]
        bad = [f"{r.name}: {r.problem}" for r in (verify_checkpoint(storage, n) for n in names) if not r.ok]
    return len(names), bad


def _gameday(drill: Drill, out: Path, events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The Young/Daly comparison of a game day (None for another drill, or without both runs' ledgers)."""
    if drill.gameday is None:
        return None
    ref, faulted = _accounts(out / "reference" / "run"), _accounts(out / "faulted" / "run")
    if not ref or not faulted:
        return None
    injected = sum(1 for e in events if e.get("kind") == "fault_injected" and e.get("source") == "host"
                   and (e.get("fault") or {}).get("kind") == "kill")
    return predict(reference=ref[0], faulted=faulted[0], checkpoint_every=drill.workload.checkpoint_every,
                   injected=injected, mtbf_s=drill.gameday.mtbf_s)


def reference_key(drill: Drill) -> tuple[Any, ...] | None:
    """What a drill's uninterrupted reference depends on: the same key, the same final state (the workload is
    deterministic: seeded data, model and streams); None for a drill whose reference cannot be shared (a script of
    the user's, whose outputs the runner does not know; a game day, whose prediction reads its own ledger)."""
    if drill.script_path() is not None or drill.gameday is not None:
        return None
    w = drill.workload
    return w.steps, w.checkpoint_every, w.step_sleep_s, w.own_group, drill.world


def run_drill(drill: Drill, out_root: Path, progress: Progress | None = None,
              references: dict[tuple[Any, ...], dict[str, Any]] | None = None) -> DrillResult:
    """Run ``drill`` (reference first when it expects equality), score it, write its report; a drill whose host
    faults this machine cannot produce is skipped with the reason, and nothing runs.

    ``references``: final states of references already run in this suite, by :func:`reference_key`; a drill with
    the same key reuses one (recorded as ``reference_from``) instead of running it again."""
    out = out_root.resolve() / drill.name  # absolute: the workers' RESILIENT_RUN_DIR, which teardown looks for
    for stale in ("reference", "faulted"):  # an earlier run's checkpoints would be restored, its ledger continued
        shutil.rmtree(out / stale, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda line: None)
    hosted = drill.all_host_faults
    skipped = next((f"{hf.kind}: {why}" for hf in hosted if (why := unavailable(hf.kind))), None)
    if skipped is None and drill.topology.storage == "s3":
        why = s3proxy.unavailable()
        skipped = None if why is None else f"storage: {why}"
    if skipped is None and drill.topology.network == "netns":
        why = netns.unavailable()
        skipped = None if why is None else f"network: {why}"
    if skipped is None and drill.clustered:
        why = cluster.unavailable()
        skipped = None if why is None else f"nodes: {why}"
    if skipped is None and drill.topology.monitoring:
        why = monitor.unavailable()
        skipped = None if why is None else f"monitoring: {why}"
    if skipped is not None:
        say(f"{drill.name}: skipped, {skipped}")
        obs = Observed(events=[], trace=[], final=None, reference=None, goodput=None, exit_code=None,
                       skipped=skipped)
        return _finish(drill, obs, out)
    reference = None
    key = reference_key(drill)
    shared = None if references is None or key is None else references.get(key)
    if drill.needs_reference and shared is not None:
        say(f"{drill.name}: the reference of {shared['drill']} (the same workload and world)")
        reference = shared["final"]
    elif drill.needs_reference:
        ref = out / "reference"
        say(f"{drill.name}: reference run (no faults)")
        try:
            ref_code = run_once(agent_command(drill, ref / "run", ref, None, f"{drill.name}-ref"),
                                ref / "agent.log", drill.timeout_s, progress, f"{drill.name} reference")
        finally:
            tear_down(ref / "run")
        reference = _final(ref)
        if ref_code != 0 or reference is None:
            raise RuntimeError(f"drill {drill.name}: the reference run exited {ref_code} without a final state; "
                               f"see {ref / 'agent.log'}")
        if references is not None and key is not None:
            references[key] = {"drill": drill.name, "final": reference}
    plan = drill.plan()
    plan_path = out / "plan.json"
    plan.dump(plan_path)
    faulted = out / "faulted"
    faulted.mkdir(parents=True, exist_ok=True)
    host: HostInjector | None = None
    say(f"{drill.name}: faulted run, {len(plan.faults) + len(hosted)} fault(s): "
        + "; ".join([*(f.describe() for f in plan.faults), *(h.describe() for h in hosted)]))
    stuck: list[str] = []
    watch: monitor.Monitoring | None = None
    notified: list[dict[str, Any]] = []
    commits: tuple[int, list[str]] | None = None
    etcd: cluster.Etcd | None = None
    net: netns.Network | None = None
    s3: s3proxy.S3Endpoint | None = None
    code: int | None = None
    ckpt, endpoint, env = str(faulted / "ckpt"), None, None
    try:
        names = cluster.node_names(drill.topology.nodes, drill.topology.spare_nodes) if drill.clustered \
            else [("n0", False)]
        if drill.topology.network == "netns":
            net = netns.Network([node for node, _ in names])
            if any(hf.kind == "latency" for hf in hosted):
                net.add_proxies()  # before the first connection: a redirect applies to new connections only
        if drill.clustered:
            etcd = cluster.Etcd(faulted / "etcd", host="127.0.0.1" if net is None else net.host_ip)
        if drill.topology.storage == "s3":
            s3 = s3proxy.S3Endpoint(faulted / "s3", bucket="drill-" + "".join(
                c if c.isalnum() else "-" for c in drill.name.lower())[:50], seed=drill.seed)
            ckpt, endpoint = f"s3://{s3.bucket}/ckpt", s3.url
            env = s3proxy.run_env()
        late: dict[str, tuple[list[str], Path]] = {}
        resubmitted = faulted / "resubmitted"

        def resubmit() -> dict[str, Any]:
            """The same job submitted again (its own run directory, the same checkpoints), the first still running."""
            empty = resubmitted / "plan.json"
            resubmitted.mkdir(parents=True, exist_ok=True)
            FaultPlan(faults=(), seed=drill.seed).dump(empty)
            late["resubmitted"] = (agent_command(drill, resubmitted / "run", resubmitted, empty, drill.name,
                                                 ckpt=ckpt, endpoint=endpoint), resubmitted / "agent.log")
            return {"run_dir": str(resubmitted / "run")}

        if hosted:
            host = HostInjector(hosted, faulted, faulted / "ckpt", drill.name, store=etcd,
                                s3=None if s3 is None else s3.proxy, network=net, resubmit=resubmit)
            host.prepare()
        if drill.topology.monitoring:
            watch = monitor.Monitoring(faulted / "monitoring", for_s=drill.topology.alert_for_s)
        agents = {}
        for node, spare in names:
            port = None
            if watch is not None:
                port = monitor.free_port()
                watch.scrape(node, f"127.0.0.1:{port}")
            cmd = agent_command(drill, faulted / "run", faulted, plan_path, drill.name, port, node=node, spare=spare,
                                store=None if etcd is None else etcd.url, ckpt=ckpt, endpoint=endpoint,
                                address="127.0.0.1" if net is None else net.addresses[node])
            if net is not None:
                cmd = net.wrap(node, cmd)
            agents[node] = (cmd, faulted / ("agent.log" if not drill.clustered else f"agent-{node}.log"))
        codes = run_agents(agents, drill.timeout_s, progress, f"{drill.name} faulted",
                           tick=None if host is None else host.poll, env=env, late=late)
        code = _exit_code(codes, set() if host is None else host.killed_nodes())
    finally:
        if host is not None:  # thawed first: a frozen process cannot die, not even of SIGKILL
            stuck = host.close()
        killed = tear_down(faulted / "run") + tear_down(faulted / "resubmitted" / "run")
        try:
            if s3 is not None:
                commits = _verify_s3_commits(s3, ckpt)
            else:
                commits = _verify_commits(drill, faulted / "ckpt")  # before a tmpfs under it goes
        finally:
            if host is not None:
                stuck = sorted(set(stuck) | set(host.leftovers()) | set(host.unmount()))
        if watch is not None:
            notified = [{**n, "kind": "alert_notified"} for n in watch.notifications()]
            watch.close()
            killed = [*killed, *watch.pids()]  # a server that outlived close() is a process left behind
        if etcd is not None:
            etcd.close()
            killed = [*killed, *etcd.pids()]
        if s3 is not None:
            s3.close()
            killed = [*killed, *s3.pids()]
        if net is not None:  # after every process in it is gone
            net.close()
            stuck = sorted(set(stuck) | set(net.leftovers()))
    events = _read_jsonl(faulted / "run" / "events.jsonl") + ([] if host is None else host.events()) + notified
    last = faulted
    if (faulted / "resubmitted" / "run").is_dir():  # the resubmitted job is the run; the first, its zombie
        last = faulted / "resubmitted"
        events += _read_jsonl(last / "run" / "events.jsonl")
    obs = Observed(events=events, trace=_read_jsonl(last / "trace.jsonl"), final=_final(last),
                   reference=reference, goodput=_goodput(last / "run"), exit_code=code, left_behind=len(killed),
                   cgroups_left=len(stuck), gameday=_gameday(drill, out, events), commits=commits)
    result = _finish(drill, obs, out)
    if shared is not None and drill.needs_reference:
        result.record["reference_from"] = shared["drill"]
        (out / f"{drill.name}.json").write_text(json.dumps(result.record, indent=1) + "\n")
    return result


def _exit_code(codes: dict[str, int | None], killed: set[str]) -> int | None:
    """The run's exit status from its agents': None when one overran the timeout, else the first non-zero of
    the agents the drill did not kill itself (a node lost by ``kill_node`` dies of SIGKILL by design)."""
    if any(c is None for c in codes.values()):
        return None
    kept = [c for node, c in codes.items() if node not in killed]
    return next((c for c in kept if c != 0), 0)


def _finish(drill: Drill, obs: Observed, out: Path) -> DrillResult:
    from .report import render

    measured, verdicts = judge(drill, obs)
    record = to_json(drill, obs, measured, verdicts)
    record["timeline"] = None
    if obs.skipped is None:
        try:
            record["timeline"] = str(draw(obs.events, obs.trace, out / f"{drill.name}.png",
                                          f"{drill.name}: " + "; ".join(f["kind"] for f in record["faults"])))
        except ConfigError as e:
            record["timeline_missing"] = str(e)  # the scores stand without the picture
    (out / f"{drill.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    report = out / f"{drill.name}.md"
    report.write_text(render([record]))
    return DrillResult(drill, obs, measured, verdicts, record, report)
