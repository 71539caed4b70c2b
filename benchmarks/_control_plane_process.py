"""One process of the control-plane simulation: a share of the simulated agents, driven by the parent's commands.

``control_plane_bench.py`` starts a few of these processes, each hosting
N/P agents (``_control_plane_agents.Agent``).  The parent sends commands
down a pipe (start, join a round, kill a node, ...) and each process answers
with what it saw, its times read from ``time.time()``: every process runs on
this one machine, so their clocks are the same clock.

Each process also measures how far behind its own schedule it runs (its
*lag*): how late each periodic write and each watch-loop pass began after it
was due, how late a thread sleeping 50 ms at a time wakes, and the CPU of a
pass.  Where these grow, the latencies measured are this simulator's, not
the protocol's.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _control_plane_agents import AT, Agent, Recorder

from resilient.coord.etcd_transport import EtcdConfig
from resilient.coord.store import ControlStoreError

TICK_S = 0.1
"""The agents' watch loop interval (``--monitor-interval``): how often a woken agent reads its snapshot."""
SLEEP_PROBE_S = 0.05
"""The lag probe's sleep: how late it wakes is how late any of this process's threads can run."""


@dataclass(frozen=True, kw_only=True)
class Spec:
    """What one simulation process hosts."""

    url: str
    """etcd, as the agents' ``--store`` takes it."""
    token: str
    """The run token (every agent signs with it)."""
    outage_tolerance_s: float
    """How long each agent's etcd client retries an unanswered request (the agent's ``outage_tolerance_s``)."""
    nodes: tuple[tuple[str, int | None], ...]
    """The hosted nodes: (name, rank), rank None for a spare node."""
    members: int
    """Member nodes in the whole run (the rendezvous' most)."""
    threads: int
    """Threads for the agents' requests and passes in this process."""
    nice: int
    """This process's niceness (above etcd's: where cores run short, the simulation waits, not etcd)."""
    idle: bool
    """Run this process at the scheduler's idle priority instead (it runs only when nothing else wants a core)."""


class Lag:
    """How late this process's actions run against their schedule (seconds), and what a pass costs (CPU s)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.late: dict[str, list[float]] = {}
        self.pass_cpu: list[float] = []
        self.skipped: dict[str, int] = {}

    def add(self, what: str, seconds: float) -> None:
        with self.lock:
            self.late.setdefault(what, []).append(seconds)

    def take(self) -> dict[str, Any]:
        with self.lock:
            found = {"late": {k: [round(x, 4) for x in v] for k, v in self.late.items()},
                     "pass_cpu": [round(x, 5) for x in self.pass_cpu], "skipped": dict(self.skipped)}
            self.late, self.pass_cpu, self.skipped = {}, [], {}
        return found


class Process:
    """This process's agents and the loops that drive them: the periodic writes, the watch loops, the lag probe."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.config = EtcdConfig.from_url(spec.url, outage_tolerance_s=spec.outage_tolerance_s)
        self.recorder = Recorder()
        self.lag = Lag()
        self.agents = [Agent(self.config, spec.token, spec.members, self.recorder, node, rank)
                       for node, rank in spec.nodes]
        self.by_node = {a.node: a for a in self.agents}
        self.started = 0
        self.done = threading.Event()
        self.pool = ThreadPoolExecutor(spec.threads)
        self.loops = ThreadPoolExecutor(spec.threads)  # the watch loops' passes, never queued behind the writes
        self.threads: list[threading.Thread] = []
        self.pending: set[tuple[str, str]] = set()
        """(agent, action) submitted and not yet done: an agent never has two of one action in flight (as a real
        agent, whose periodic writes wait for the one before); one skipped instead is counted."""
        self.pending_lock = threading.Lock()

    def live_agents(self) -> list[Agent]:
        return [a for a in self.agents if not a.client.dead]

    # --------------------------------------------------------------- the loops
    def _submit(self, pool: ThreadPoolExecutor, agent: Agent, action: str, due: float) -> bool:
        """Submit ``action`` of ``agent`` unless one is still in flight (False: skipped)."""
        with self.pending_lock:
            if (agent.node, action) in self.pending:
                with self.lag.lock:
                    self.lag.skipped[action] = self.lag.skipped.get(action, 0) + 1
                return False
            self.pending.add((agent.node, action))
        pool.submit(self._safe, agent, action, due)
        return True

    def _safe(self, agent: Agent, action: str, due: float) -> None:
        self.lag.add(action, time.monotonic() - due)
        cpu = time.thread_time()
        try:
            getattr(agent, action)()
        except ControlStoreError as e:
            agent._error(f"{action}: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - one agent's failure is recorded, the others go on
            agent._error(f"{action}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
        finally:
            if action == "tick":
                spent = time.thread_time() - cpu
                with self.lag.lock:
                    self.lag.pass_cpu.append(spent)
            with self.pending_lock:
                self.pending.discard((agent.node, action))

    def _periodic(self, agents: list[Agent], every_s: float, action: str) -> None:
        """Run ``action`` of each live agent every ``every_s``, the agents spread evenly over the interval."""
        step = every_s / max(1, len(agents))
        start = time.monotonic()
        while not self.done.is_set():
            for i, agent in enumerate(agents):
                due = start + i * step
                wait = due - time.monotonic()
                if wait > 0 and self.done.wait(wait):
                    return
                if not agent.client.dead:
                    self._submit(self.pool, agent, action, due)
            start += every_s
            # A round that ran past its interval is not made up for: the next starts now (its lag was recorded).
            start = max(start, time.monotonic())

    def _ticker(self) -> None:
        """The agents' watch loops: a woken agent reads its snapshot and acts, at most every TICK_S; an agent that
        has a wait to report, or collects the reports, passes every TICK_S woken or not (a real agent's loop
        passes every monitor interval on a core of its own; here the passes that would find nothing to do are
        left out).  A pass is due when the loop came round to its agent; the loop itself is due every TICK_S."""
        due = time.monotonic()
        while not self.done.is_set():
            start = time.monotonic()
            self.lag.add("tick_loop", start - due)
            for agent in self.agents:
                polls = agent.waiting_for is not None and (agent.reported != agent.generation or agent.collecting)
                if (agent.woken.is_set() or polls) and not agent.client.dead:
                    woken = agent.woken.is_set()
                    agent.woken.clear()
                    if not self._submit(self.loops, agent, "tick", start) and woken:
                        agent.woken.set()  # its pass still runs: the change that woke it is read by the next one
            due = max(start + TICK_S, time.monotonic())
            self.done.wait(due - time.monotonic())

    def _sleep_probe(self) -> None:
        """Sleep SLEEP_PROBE_S at a time: how late it wakes is how late this process can run anything."""
        while not self.done.is_set():
            due = time.monotonic() + SLEEP_PROBE_S
            time.sleep(SLEEP_PROBE_S)
            self.lag.add("sleep", time.monotonic() - due)

    def run_loops(self) -> None:
        members = [a for a in self.agents if a.member]
        for every, action, chosen in ((1.0, "publish_timing", members), (1.0, "ask_waiting", members),
                                      (1.0, "read_quarantine", self.agents), (30.0, "publish_status", self.agents)):
            self.threads.append(threading.Thread(target=self._periodic, args=(chosen, every, action), daemon=True))
        self.threads.append(threading.Thread(target=self._ticker, daemon=True))
        self.threads.append(threading.Thread(target=self._sleep_probe, daemon=True))
        for t in self.threads:
            t.start()

    # --------------------------------------------------------------- the parent's commands
    def start(self, count: int) -> dict[str, Any]:
        """Start the next ``count`` of this process's agents (a few at a time, as nodes come up)."""
        wave = self.agents[self.started:self.started + count]
        self.started += len(wave)
        with ThreadPoolExecutor(2) as starting:
            list(starting.map(lambda a: a.start(), wave))
        return {"retries": self.recorder.start_retries, "started": self.started}

    def fewest_live(self) -> int:
        """The fewest nodes any started agent judges alive."""
        return min((len(a.presence.live()) for a in self.agents[:self.started]), default=10**9)

    def join_round(self, members_only: bool) -> dict[str, Any]:
        joining = [a for a in self.live_agents() if a.member or not members_only]
        if not joining:
            return {"placed": [], "generation": None, "formed_by": []}
        with ThreadPoolExecutor(len(joining)) as pool:
            placed = list(pool.map(lambda a: a.join_round(), joining))
        return {"placed": placed, "generation": joining[0].generation,
                "formed_by": sorted({why for a in joining for _, why in a.rendezvous.formed[-1:]})}

    def publish_first(self, generation: int) -> None:
        with ThreadPoolExecutor(self.spec.threads) as pool:
            for agent in self.agents:
                agent.generation = generation
                if agent.rank is not None:
                    pool.submit(agent.store.publish_node, generation, {agent.rank: agent.worker},
                                world_size=self.spec.members, store="127.0.0.1:1", opted_in=True, batch=None)
                else:
                    pool.submit(agent.store.register_spare, agent.worker, time.time())
                if agent.rank == 0:
                    agent.store.set_current(generation)

    def sample(self) -> dict[str, Any]:
        return {"events": sum(a.events for a in self.agents), "cpu_s": time.process_time(), "wall": time.time()}

    def kill(self, victim: str) -> None:
        if victim in self.by_node:
            self.by_node[victim].stop()

    def accuse(self, victim: str, probers: list[str]) -> None:
        for node in probers:
            prober = self.by_node.get(node)
            if prober is not None:
                key = AT.suspect(victim, node)
                prober.client.put(key, prober.seal.seal(key, {"why": "no answer", "at": time.time()}),
                                  lease=prober.presence.lease)

    def marks(self) -> dict[str, Any]:
        r = self.recorder
        with r.lock:
            return {"judged": dict(r.judged_at), "applied": dict(r.applied_at), "accused_seen": dict(r.accused_seen_at),
                    "decision_seen": dict(r.decision_seen_at), "decided": r.decided,
                    "alive": len(self.live_agents())}

    def generation_of(self, victim: str) -> int | None:
        agent = self.by_node.get(victim)
        return agent.generation if agent is not None else None

    def grow(self) -> float | None:
        lead = next((a for a in self.live_agents() if a.rank == 0), None)
        if lead is None:
            return None
        for attempt in range(3):
            try:
                return lead.grow()
            except ControlStoreError as e:
                # Its lease lapsed: this process ran too late to renew it (the machine was short of cores); its
                # presence takes a new one at its next renewal.
                lead._error(f"grow: {type(e).__name__}: {e}")
                if attempt == 2:
                    raise
                time.sleep(2.0)
        return None

    def errors(self) -> dict[str, Any]:
        with self.recorder.lock:
            return {"count": len(self.recorder.errors), "first": self.recorder.errors[:5],
                    "start_retries": self.recorder.start_retries}

    def close(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(timeout=30)
        with ThreadPoolExecutor(16) as closing:
            list(closing.map(lambda a: a.close(), self.agents))
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.loops.shutdown(wait=True, cancel_futures=True)


def _lowest_autogroup() -> None:
    """A session of this process's own, its scheduling group at the lowest weight (where the kernel has them)."""
    group = Path("/proc/self/autogroup")
    if not group.exists():
        return
    os.setsid()
    try:
        group.write_text("19")
    except OSError:
        pass  # not allowed here: the threads' own priority still applies within the session


def serve(conn: Any, spec: Spec) -> None:
    """A simulation process's main: build the agents, then answer the parent's commands until ``close``.

    Each command is ``(name, args)``; each answer ``("ok", result)`` or ``("error", text)``."""
    threading.stack_size(512 * 1024)
    # Below etcd in the scheduler's eyes: where this machine's cores run short, the simulated agents wait, not
    # etcd (on a real cluster etcd has cores of its own).  Where the kernel groups tasks by session (autogroup),
    # etcd runs in a session of its own and competes with this process's session as a whole, whatever the
    # priority of its threads: so this process takes a session of its own, at the lowest weight.  The policy is
    # set before any thread starts: they inherit it.
    _lowest_autogroup()
    if spec.idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(spec.nice)
    process = Process(spec)
    commands: dict[str, Callable[..., Any]] = {
        "start": process.start, "fewest_live": process.fewest_live, "join_round": process.join_round,
        "publish_first": process.publish_first, "run_loops": process.run_loops, "sample": process.sample,
        "lag": process.lag.take, "watch": process.recorder.reset, "kill": process.kill, "accuse": process.accuse,
        "marks": process.marks, "generation_of": process.generation_of, "grow": process.grow, "errors": process.errors}
    while True:
        name, args = conn.recv()
        if name == "close":
            try:
                process.close()
            finally:
                conn.send(("ok", None))
            return
        try:
            conn.send(("ok", commands[name](*args)))
        except Exception as e:  # noqa: BLE001 - the parent records it as this N's failure
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}"))
