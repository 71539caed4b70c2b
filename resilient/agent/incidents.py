"""Incident records: what broke first, with the evidence an on-call engineer needs.

An incident is written once, as ``<run_dir>/incidents/<id>.json``, and
announced as an ``incident`` event whose fields summarise it.  It names
the first failure (rank, node, exit code or signal, the section and step it
was in), carries the worker's traceback from its error file and, for a
hang, every captured stack, and records what the agent decided.

A node that fails its health check, or keeps a worker that SIGKILL cannot
end, is an incident of kind ``unhealthy`` whose ``problems`` list each
failed check (or each stuck pid with its process state).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..coord import keyspace
from ..core.collective import is_collective_error
from ..core.events import Emit, EventKind, FailureKind
from ..core.exitcodes import describe_exit
from ..core.fsutil import write_json_atomic
from ..watchdog.stacks import StackCapture
from .consequences import short_error

if TYPE_CHECKING:
    from ..coord.proof import SignedStore
    from .rundir import RunDir


@dataclass(frozen=True, kw_only=True)
class Incident:
    """One failure of the run and how the agent answered it."""

    id: str
    node: str
    generation: int
    kind: FailureKind
    """"exit", "signal", "hang", "unhealthy" or "node_lost"."""
    rank: int | None
    pid: int | None
    section: str | None
    step: int | None
    summary: str
    """One line for a pager: what failed, where, and how."""
    exit_code: int | None = None
    signal: int | None = None
    error: Mapping[str, Any] | None = None
    """The worker's error file: exc_type, message, traceback."""
    hang: Mapping[str, Any] | None = None
    """For hangs: timeout, its source, overrun and how the culprit was chosen."""
    stacks: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    """Captured stacks by rank: state, method, text, note."""
    other_failures: tuple[str, ...] = ()
    """Failures besides the first, one line each: a consequence (with its error), stopped by the agent, or
    also failed (see :mod:`resilient.agent.consequences`)."""
    problems: tuple[str, ...] = ()
    """For ``unhealthy``: each failed health check, or each worker that SIGKILL did not end, with its state."""
    decision: Mapping[str, Any] | None = None
    """The restart decision: action, reason, verdict, delay."""
    restored: Mapping[str, Any] | None = None
    """After a restart: what the next generation's ranks restored (:meth:`RestoreSummary.record`)."""
    ladder: Mapping[str, Any] | None = None
    """The recovery ladder's decision when in-process recovery was on offer (``RecoveryDecision.to_event()``):
    why the run did, or did not, recover without a restart."""
    recovered: Mapping[str, Any] | None = None
    """After an in-process recovery: the rung, the new generation, its seconds and where the ranks resumed."""
    performance: Mapping[str, Any] | None = None
    """For ``straggler`` and ``slowdown``: the section, the numbers, the attribution, the host's telemetry and,
    once a slowdown ended, its cost (``ended``)."""
    wall_time: float = field(default_factory=time.time)

    def with_decision(self, decision: Any) -> Incident:
        """This incident with the restart decision taken on it."""
        return replace(self, decision={"action": decision.action.value, "reason": decision.reason,
                                       "verdict": decision.verdict, "delay_s": decision.delay_s})

    def with_restore(self, restored: Mapping[str, Any]) -> Incident:
        """This incident with what the restart restored appended."""
        return replace(self, restored=dict(restored))

    def with_recovery(self, recovered: Mapping[str, Any]) -> Incident:
        """This incident with how the in-process recovery it started completed."""
        return replace(self, recovered=dict(recovered))

    def with_performance(self, performance: Mapping[str, Any]) -> Incident:
        """This incident with its straggler or slowdown record replaced (e.g. a slowdown's end and cost)."""
        return replace(self, performance=dict(performance))

    def store_record(self) -> dict[str, Any]:
        """The run-wide copy kept in the store (readable with ``resilient status --store``)."""
        return {**self.event_fields(), "node": self.node, "wall_time": self.wall_time,
                **({"restored": dict(self.restored)} if self.restored else {}),
                **({"recovered": dict(self.recovered)} if self.recovered else {}),
               **({"performance": dict(self.performance)} if self.performance else {})}

    def event_fields(self) -> dict[str, Any]:
        """The compact form that goes into the event log."""
        error = self.error or {}
        return {
            "id": self.id, "generation": self.generation, "failure": self.kind,
            "rank": self.rank, "section": self.section, "step": self.step, "summary": self.summary,
            "exit_code": self.exit_code, "signal": self.signal,
            "error": f"{error.get('exc_type')}: {error.get('message')}" if error else None,
            "decision": dict(self.decision) if self.decision else None,
            **({"ladder": {k: self.ladder[k] for k in ("action", "reason") if k in self.ladder}}
               if self.ladder else {}),
            **({"problems": list(self.problems)} if self.problems else {}),
        }


def describe_failure(kind: str, rank: int | None, node: str, returncode: int | None, section: str | None,
                     step: int | None, extra: str = "") -> str:
    """A one-line summary such as "rank 1 on n1 killed by SIGKILL in section 'step' at step 57"."""
    what = describe_exit(returncode) if returncode is not None else kind
    where = f" in section '{section}'" if section else ""
    at = f" at step {step}" if step is not None else ""
    who = f"rank {rank}" if rank is not None else "node"
    return f"{who} on {node}: {what}{where}{at}{(': ' + extra) if extra else ''}"


def unhealthy_incident(node: str, generation: int, problems: Sequence[str], *, when: str) -> Incident:
    """The incident for a failed health check (``when``: "before starting workers", "while running")."""
    return Incident(id=f"g{generation:04d}-{node}-unhealthy", node=node, generation=generation, kind="unhealthy",
                    rank=None, pid=None, section=None, step=None,
                    summary=f"node {node} failed its health check {when}: {'; '.join(problems)}",
                    problems=tuple(problems),
                    decision={"action": "stop", "verdict": "unhealthy", "delay_s": 0.0,
                              "reason": "the node steps out of the run (exit 81): schedule the job elsewhere"})


def stuck_incident(node: str, generation: int, stuck: Sequence[Any], *, after: str, wait_s: float) -> Incident:
    """The incident for workers that SIGKILL did not end (``stuck``: :class:`~resilient.agent.sweep.Stuck`)."""
    first = stuck[0]
    problems = tuple(s.describe() for s in stuck)
    return Incident(id=f"g{generation:04d}-{node}-unreaped-{int(time.time())}", node=node, generation=generation,
                    kind="unhealthy", rank=first.rank, pid=first.pid, section=None, step=None,
                    summary=(f"on {node} {after}: {'; '.join(problems)}; no new workers start until "
                             f"{'it is' if len(stuck) == 1 else 'they are'} gone (waiting up to {wait_s:.0f} s)"),
                    problems=problems)


def node_lost_incident(node: str, observer: str, generation: int, why: str) -> Incident:
    """The incident for a peer judged lost (``why``: the evidence), as node ``observer`` saw it."""
    summary = f"node {node} was lost: {why} (seen by node {observer} in generation {generation})"
    return Incident(id=f"g{generation:04d}-{node}-lost", node=node, generation=generation, kind="node_lost",
                    rank=None, pid=None, section=None, step=None, summary=summary)


def read_error_file(path: Path) -> dict[str, Any] | None:
    """The worker's error record, or None if it did not write one (e.g. it was killed)."""
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


OUTPUT_TAIL_BYTES = 65536
"""How much of a worker's output is read back for the traceback it printed last."""
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
"""torch's own prefix on a distributed worker's uncaught traceback (``[rank0]: Traceback ...``)."""


def error_from_output(log: Path) -> dict[str, Any] | None:
    """The error record of a worker that wrote no error file (a script without ``resilient.Run``): the last Python
    traceback in its output, its exception type and message; None when it printed none (a signal, ``exit(1)``)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - OUTPUT_TAIL_BYTES))
            lines = [_RANK_PREFIX.sub("", line) for line in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return None
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return None
    block = lines[starts[-1]:]
    tail = next((i for i, line in enumerate(block[1:], 1) if line and not line.startswith(" ")), None)
    if tail is None:
        return None
    exc_type, _, message = block[tail].partition(":")
    return {"exc_type": exc_type.strip(), "message": message.strip(), "traceback": "\n".join(block[:tail + 1]) + "\n",
            "source": f"the last traceback in {log.name} (the worker wrote no error file: no resilient.Run)"}


def stacks_record(captures: Mapping[int, StackCapture]) -> dict[int, dict[str, Any]]:
    return {rank: asdict(c) for rank, c in sorted(captures.items())}


def write_incident(incidents_dir: Path, incident: Incident) -> Path:
    incidents_dir.mkdir(parents=True, exist_ok=True)
    path = incidents_dir / f"{incident.id}.json"
    write_json_atomic(path, asdict(incident))
    return path


FINDINGS = {"straggler": "slow rank", "slowdown": "the job slowed down"}
"""Incidents that are performance findings, not failures: said in one line as what they are, unless the agent
acted on one (a straggler replaced), which is told like any other incident."""

TRACEBACK_LINES = 20
"""Lines of the first failure's traceback the console shows (the incident file keeps all of it)."""


def format_incident(incident: Incident, path: Path | None = None) -> str:
    """The console's account: the first failure, the end of its traceback, one line per consequence, the decision.

    Workers' own tracebacks are held back from the console (see
    :mod:`resilient.agent.launcher`), so this is where the first failure's
    shows, under its incident, and a survivor's shows only as its one line.
    """
    finding = FINDINGS.get(incident.kind)
    if finding is not None and not incident.decision:  # nothing failed and nothing was done: a measurement
        where = f" (details: {path})" if path is not None else ""
        return f"resilient: {finding} (the run goes on): {incident.summary}{where}"
    out = [f"resilient: incident {incident.id}: {incident.summary}"]
    error = incident.error or {}
    trace = str(error.get("traceback") or "").rstrip().splitlines()
    if trace and is_collective_error(error):  # the cause is elsewhere: its traceback says nothing more
        out.append(f"resilient:   rank {incident.rank} raised {short_error(error)} (traceback in the incident file)")
    elif trace:
        cut = len(trace) > TRACEBACK_LINES
        out.append(f"resilient:   rank {incident.rank} raised{' (last lines)' if cut else ''}:")
        out.extend(f"resilient:   | {line}" for line in trace[-TRACEBACK_LINES:])
    out.extend(f"resilient:   {line}" for line in incident.other_failures)
    if incident.ladder and incident.ladder.get("action") not in ("promote_spare", "shrink"):
        out.append(f"resilient:   not recovered in process: {incident.ladder.get('reason')}")
    if incident.decision:
        out.append(f"resilient:   decision: {incident.decision.get('reason')}")
    if path is not None:
        out.append(f"resilient:   details: {path}")
    return "\n".join(out)


def publish_incident(incident: Incident, run_dir: RunDir, store: SignedStore, emit: Emit) -> Path:
    """Write (or rewrite) the incident file and its run-wide copy in the store (incidents outlive launches;
    signed: they feed the failure rate that paces the run's saves)."""
    path = write_incident(run_dir.incidents, incident)
    try:
        store.put(keyspace.incident(incident.id), incident.store_record())
    except Exception as e:  # noqa: BLE001  whatever the store raises, the incident file is written
        emit(EventKind.STORE_UNREACHABLE, error=f"{type(e).__name__}: {e}")
    return path


def load_incidents(incidents_dir: Path) -> list[dict[str, Any]]:
    """Every incident of the run, oldest first."""
    found = []
    for path in sorted(incidents_dir.glob("*.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (json.JSONDecodeError, OSError):
            continue
    return sorted(found, key=lambda i: i.get("wall_time", 0))
