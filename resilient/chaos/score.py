"""A drill's score: what was measured in its run, and a verdict per expectation with the margin.  Pure.

Measured from what the run left (the runner collects it,
:mod:`resilient.chaos.runner`): the agent's event log (the workers write
``fault_injected`` into it as a fault fires), the per-rank trace of
completed steps, the final digests of the faulted run and of the
reference, the ledger's goodput and the agent's exit status.

- **detect**: from the first fault's injection to the first detection after
  it (a worker failed, a hang, a straggler flag, a lost or unhealthy node, a
  slowdown, an incident or the ladder's decision);
- **resume**: from that detection to training going on (every member
  rejoined in process, or the restarted workers reported their restore);
- **rung**: the recovery ladder's first answer after the fault
  (``recovery_decided``), or ``restart`` when the policy restarted;
- **re-done steps**: steps some rank completed more than once;
- **equality**: the final parameters' and optimizer state's digests
  against the reference's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .drill import Drill

DETECTIONS = ("worker_failed", "hang_detected", "straggler_flagged", "node_lost", "node_unhealthy",
              "slowdown_began", "incident", "recovery_decided")
"""Events that mean the agent noticed a fault (an in-process rung records its incident and decision at once)."""


@dataclass(frozen=True)
class Observed:
    """What a drill's run left behind."""

    events: Sequence[Mapping[str, Any]]
    trace: Sequence[Mapping[str, Any]]
    final: Mapping[str, Any] | None
    reference: Mapping[str, Any] | None
    goodput: float | None
    exit_code: int | None
    """None: the run did not end within the drill's timeout (it was killed)."""
    skipped: str | None = None
    """Why the drill could not run on this machine (nothing else is then measured)."""
    left_behind: int = 0
    """Processes of the run still alive after its agent ended (killed by the teardown)."""


@dataclass(frozen=True)
class Measured:
    fault_at: float | None
    detect_s: float | None
    resume_s: float | None
    rung: str | None
    redone_steps: int
    equal: bool | None
    goodput: float | None
    exit_code: int | None
    detected_by: str | None


@dataclass(frozen=True)
class Verdict:
    expectation: str
    wanted: str
    got: str
    ok: bool
    margin: str = ""
    """How far off a failed expectation is (or how much room a passed one had)."""


def measure(obs: Observed) -> Measured:
    events = sorted(obs.events, key=lambda e: float(e.get("time", 0.0)))
    fault = next((e for e in events if e.get("kind") == "fault_injected"), None)
    fault_at = float(fault["time"]) if fault is not None else None
    detected = None if fault_at is None else next(
        (e for e in events if e.get("kind") in DETECTIONS and float(e["time"]) >= fault_at), None)
    detect_s = None if detected is None or fault_at is None else float(detected["time"]) - fault_at
    resume_s, rung = None, None
    if detected is not None:
        after = [e for e in events if float(e["time"]) >= float(detected["time"])]
        decided = next((e for e in after if e.get("kind") in ("recovery_decided", "restart")), None)
        if decided is not None:
            rung = "restart" if decided["kind"] == "restart" else str(decided.get("action"))
        generation = detected.get("generation")
        resumed = next((e for e in after if e.get("kind") == "recovered_in_process"
                        or (e.get("kind") == "restored" and generation is not None
                            and int(e.get("generation") or 0) > int(generation))), None)
        if resumed is not None:
            resume_s = float(resumed["time"]) - float(detected["time"])
    done = Counter((int(t["rank"]), int(t["step"])) for t in obs.trace)
    redone = len({step for (_, step), n in done.items() if n > 1})
    equal = None
    if obs.final is not None and obs.reference is not None:
        equal = all(obs.final.get(k) == obs.reference.get(k) for k in ("params", "optimizer", "step", "samples"))
    return Measured(fault_at=fault_at, detect_s=detect_s, resume_s=resume_s, rung=rung, redone_steps=redone,
                    equal=equal, goodput=obs.goodput, exit_code=obs.exit_code,
                    detected_by=None if detected is None else str(detected["kind"]))


def judge(drill: Drill, obs: Observed) -> tuple[Measured, list[Verdict]]:
    """Every expectation of ``drill`` against what ``obs`` shows."""
    m = measure(obs)
    e = drill.expect
    out = [Verdict("exit code", str(e.exit_code), "killed at the timeout" if m.exit_code is None else str(m.exit_code),
                   m.exit_code == e.exit_code)]
    out.append(Verdict("teardown", "no process left", f"{obs.left_behind} left", obs.left_behind == 0))
    if m.fault_at is None:
        out.append(Verdict("fault injected", "yes", "no fault_injected event", False,
                           "the schedule never struck: check its steps, ranks and attempts"))
    if e.detected_within_s is not None:
        out.append(_within("detected", e.detected_within_s, m.detect_s))
    if e.resumed_within_s is not None:
        out.append(_within("resumed", e.resumed_within_s, m.resume_s))
    if e.max_redone_steps is not None:
        over = m.redone_steps - e.max_redone_steps
        out.append(Verdict("re-done steps", f"<= {e.max_redone_steps}", str(m.redone_steps), over <= 0,
                           f"{over} too many" if over > 0 else f"{-over} to spare"))
    if e.rung is not None:
        out.append(Verdict("rung", e.rung, m.rung or "none", m.rung == e.rung))
    if e.equal == "bitwise":
        got = {None: "no final state to compare", True: "bitwise equal", False: "differs"}[m.equal]
        out.append(Verdict("equal to the reference", "bitwise", got, m.equal is True))
    if e.min_goodput is not None:
        got = "unknown" if m.goodput is None else f"{m.goodput:.3f}"
        ok = m.goodput is not None and m.goodput >= e.min_goodput
        margin = "" if m.goodput is None else f"{m.goodput - e.min_goodput:+.3f}"
        out.append(Verdict("goodput", f">= {e.min_goodput:g}", got, ok, margin))
    kinds = Counter(str(ev.get("kind")) for ev in obs.events)
    for kind in e.events:
        out.append(Verdict(f"event {kind}", "occurs", f"{kinds[kind]} times", kinds[kind] > 0))
    for kind in e.no_events:
        out.append(Verdict(f"event {kind}", "does not occur", f"{kinds[kind]} times", kinds[kind] == 0))
    return m, out


def _within(what: str, limit: float, got: float | None) -> Verdict:
    if got is None:
        return Verdict(f"{what} within", f"{limit:g} s", "never", False, "not seen at all")
    return Verdict(f"{what} within", f"{limit:g} s", f"{got:.2f} s", got <= limit,
                   f"{got - limit:.2f} s late" if got > limit else f"{limit - got:.2f} s to spare")


def to_json(drill: Drill, obs: Observed, m: Measured, verdicts: Sequence[Verdict]) -> dict[str, Any]:
    """The drill's record (``resilient drill compare`` reads two of them)."""
    return {"drill": drill.name, "file": str(drill.path), "seed": drill.seed, "skipped": obs.skipped,
            "faults": [f.to_dict() for f in drill.plan().faults], "measured": asdict(m),
            "verdicts": [asdict(v) for v in verdicts], "passed": obs.skipped is None and all(v.ok for v in verdicts)}
