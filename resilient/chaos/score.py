"""A drill's score: what was measured in its run, and a verdict per expectation with the margin.  Pure.

Measured from what the run left (the runner collects it,
:mod:`resilient.chaos.runner`): the agent's event log (the workers write
``fault_injected`` into it as a fault fires), the per-rank trace of
completed steps, the final digests of the faulted run and of the
reference, the ledger's goodput and the agent's exit status.

- **detect**: from the first fault's injection to the first detection after
  it (a worker failed, a hang, a straggler flag, a lost or unhealthy node, a
  slowdown, an incident or the ladder's decision).  A *latent* fault (a
  damaged checkpoint) does nothing until it is read, so the first other
  fault is the anchor; each latent fault is scored on its own: caught when
  a restore refused the damaged checkpoint (``checkpoint_quarantined`` or
  ``checkpoint_fallback`` after it), and how long after the damage;
- **resume**: from that detection to training going on (every member
  rejoined in process, or the restarted workers reported their restore);
- **rung**: the recovery ladder's first answer after the fault
  (``recovery_decided``), or ``restart`` when the policy restarted, or
  ``retry_in_place`` when the ranks retried a step whose gradients were not
  finite (``nonfinite_gradients``);
- **re-done steps**: steps some rank completed more than once;
- **equality**: the final parameters' and optimizer state's digests
  against the reference's;
- **alerts**: each alert that reached the drill's receiver firing
  (``alert_notified`` events, from :mod:`resilient.chaos.monitor`), and how
  long after the first fault.
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
FAULT_DETECTIONS: dict[str, tuple[str, ...]] = {"fill_disk": ("checkpoint_failed",),
                                                "s3_errors": ("checkpoint_store_retrying", "checkpoint_failed"),
                                                "s3_drop": ("checkpoint_store_retrying", "checkpoint_failed"),
                                                "s3_slow": ("checkpoint_store_retrying", "checkpoint_failed"),
                                                "store_outage": ("store_outage_start",),
                                                "nan": ("nonfinite_gradients",),
                                                "resubmit": ("checkpoint_fenced",)}
"""Faults whose detection is an event of their own: a full disk is noticed by the save that fails, a store in
trouble by its first request the client retries (or a save that fails), an etcd outage by the agents' losing it, a
resubmitted job by the first one's save the fence refuses."""
FAULT_RESUMES: dict[str, tuple[str, ...]] = {"store_outage": ("store_outage_end",)}
"""Faults that do not stop training, whose end is an event of its own: the agents have their store back."""
LATENT = ("corrupt_checkpoint", "truncate_checkpoint")
"""Faults that act only when what they damaged is read."""
CAUGHT = ("checkpoint_quarantined", "checkpoint_fallback")
"""Events that mean a restore refused a damaged checkpoint."""


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
    cgroups_left: int = 0
    """Cgroups, mounts and network namespaces the drill made that the teardown could not remove."""
    gameday: Mapping[str, Any] | None = None
    """A game day's Young/Daly comparison (:func:`resilient.chaos.gameday.predict`)."""
    commits: tuple[int, Sequence[str]] | None = None
    """(checkpoints committed at the end, the problems of those that do not verify); None: not checked."""


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
    latent: tuple[dict[str, Any], ...] = ()
    """Per latent fault: its kind, the checkpoint it damaged, and ``caught_s`` (None: never caught)."""
    alerts: tuple[tuple[str, float], ...] = ()
    """Each alert that reached a receiver firing, with the seconds from the first fault to its first notification."""


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
    injected = [e for e in events if e.get("kind") == "fault_injected"]
    latent_faults = [e for e in injected if (e.get("fault") or {}).get("kind") in LATENT]
    fault = next((e for e in injected if e not in latent_faults), injected[0] if injected else None)
    latent = []
    for e in latent_faults:
        caught = next((c for c in events if c.get("kind") in CAUGHT and float(c["time"]) >= float(e["time"])), None)
        latent.append({"kind": e["fault"]["kind"], "checkpoint": e.get("checkpoint"), "caught_by": None if caught is
                       None else caught["kind"], "caught_s": None if caught is None else
                       round(float(caught["time"]) - float(e["time"]), 3)})
    fault_at = float(fault["time"]) if fault is not None else None
    own = None if fault is None else FAULT_DETECTIONS.get(str((fault.get("fault") or {}).get("kind")))
    kinds: tuple[str, ...] = DETECTIONS if own is None else own
    detected = None if fault_at is None else next(
        (e for e in events if e.get("kind") in kinds and float(e["time"]) >= fault_at), None)
    detect_s = None if detected is None or fault_at is None else float(detected["time"]) - fault_at
    resume_s, rung = None, None
    if detected is not None:
        after = [e for e in events if float(e["time"]) >= float(detected["time"])]
        decided = next((e for e in after if e.get("kind") in ("recovery_decided", "restart")), None)
        if decided is not None:
            rung = "restart" if decided["kind"] == "restart" else str(decided.get("action"))
        elif detected.get("kind") == "nonfinite_gradients" and detected.get("retried"):
            rung = "retry_in_place"  # the rank's own answer: the step again, on the same batch
        generation = detected.get("generation")
        ends = FAULT_RESUMES.get(str((fault or {}).get("fault", {}).get("kind")), ("recovered_in_process",))
        resumed = next((e for e in after if e.get("kind") in ends
                        or (e.get("kind") == "restored" and generation is not None
                            and int(e.get("generation") or 0) > int(generation))), None)
        if resumed is not None:
            resume_s = float(resumed["time"]) - float(detected["time"])
    alerted: dict[str, float] = {}
    for e in events:
        if e.get("kind") == "alert_notified" and e.get("status") == "firing" and fault_at is not None:
            alerted.setdefault(str(e["alertname"]), round(float(e["time"]) - fault_at, 3))
    done = Counter((int(t["rank"]), int(t["step"])) for t in obs.trace)
    redone = len({step for (_, step), n in done.items() if n > 1})
    equal = None
    if obs.final is not None and obs.reference is not None:
        equal = all(obs.final.get(k) == obs.reference.get(k) for k in ("params", "optimizer", "step", "samples"))
    return Measured(fault_at=fault_at, detect_s=detect_s, resume_s=resume_s, rung=rung, redone_steps=redone,
                    equal=equal, goodput=obs.goodput, exit_code=obs.exit_code,
                    detected_by=None if detected is None else str(detected["kind"]), latent=tuple(latent),
                    alerts=tuple(sorted(alerted.items())))


def judge(drill: Drill, obs: Observed) -> tuple[Measured, list[Verdict]]:
    """Every expectation of ``drill`` against what ``obs`` shows."""
    m = measure(obs)
    if obs.skipped is not None:
        return m, []  # nothing ran: nothing to judge (the record says why)
    e = drill.expect
    out = [Verdict("exit code", str(e.exit_code), "killed at the timeout" if m.exit_code is None else str(m.exit_code),
                   m.exit_code == e.exit_code)]
    out.append(Verdict("teardown", "no process left", f"{obs.left_behind} left", obs.left_behind == 0))
    if obs.commits is not None:
        n, bad = obs.commits
        out.append(Verdict("committed checkpoints verify", "all", f"{n - len(bad)} of {n}" +
                           (f" ({'; '.join(bad)[:300]})" if bad else ""), not bad))
    if drill.all_host_faults or drill.topology.network != "loopback":
        out.append(Verdict("teardown of cgroups, mounts and namespaces", "none left", f"{obs.cgroups_left} left",
                           obs.cgroups_left == 0))
    if m.fault_at is None:
        out.append(Verdict("fault injected", "yes", "no fault_injected event", False,
                           "the schedule never struck: check its steps, ranks and attempts"))
    for lf in m.latent:
        got = "never" if lf["caught_s"] is None else f"{lf['caught_by']} {lf['caught_s']:.2f} s after the damage"
        out.append(Verdict(f"{lf['kind']} of {lf['checkpoint']} caught", "refused by a restore", got,
                           lf["caught_s"] is not None,
                           "" if lf["caught_s"] is not None else "a restore used the damaged checkpoint or none ran"))
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
    day = drill.gameday
    if day is not None and day.max_error is not None:
        g = obs.gameday or {}
        err = g.get("relative_error")
        got = "no prediction (a run without a ledger, or no fault struck)" if err is None else (
            f"measured {g['measured_goodput']:.3f} against predicted {g['predicted_goodput']:.3f} ({err:+.1%})")
        ok = err is not None and g.get("faults", 0) > 0 and abs(err) <= day.max_error
        margin = "" if err is None else (f"{abs(err) - day.max_error:.1%} beyond" if not ok else
                                         f"{day.max_error - abs(err):.1%} to spare")
        out.append(Verdict("goodput against Young/Daly", f"within {day.max_error:.0%}", got, ok, margin))
    alerted = dict(m.alerts)
    for name in e.alerts:
        got = "never notified" if name not in alerted else f"notified {alerted[name]:.2f} s after the fault"
        ok = name in alerted and (e.alerted_within_s is None or alerted[name] <= e.alerted_within_s)
        wanted = "fires" + ("" if e.alerted_within_s is None else f" within {e.alerted_within_s:g} s")
        margin = "" if name not in alerted or e.alerted_within_s is None else (
            f"{alerted[name] - e.alerted_within_s:.2f} s late" if not ok else
            f"{e.alerted_within_s - alerted[name]:.2f} s to spare")
        out.append(Verdict(f"alert {name}", wanted, got, ok, margin))
    for name in e.no_alerts:
        got = "never notified" if name not in alerted else f"notified {alerted[name]:.2f} s after the fault"
        out.append(Verdict(f"alert {name}", "does not fire", got, name not in alerted))
    return m, out


def _within(what: str, limit: float, got: float | None) -> Verdict:
    if got is None:
        return Verdict(f"{what} within", f"{limit:g} s", "never", False, "not seen at all")
    return Verdict(f"{what} within", f"{limit:g} s", f"{got:.2f} s", got <= limit,
                   f"{got - limit:.2f} s late" if got > limit else f"{limit - got:.2f} s to spare")


def to_json(drill: Drill, obs: Observed, m: Measured, verdicts: Sequence[Verdict]) -> dict[str, Any]:
    """The drill's record (``resilient drill compare`` reads two of them)."""
    return {"drill": drill.name, "file": str(drill.path), "seed": drill.seed, "skipped": obs.skipped,
            "faults": [f.to_dict() for f in drill.plan().faults]
            + [{**hf.to_dict(), "source": "host", "description": hf.describe()} for hf in drill.all_host_faults],
            "measured": asdict(m),
            "verdicts": [asdict(v) for v in verdicts], "gameday": None if obs.gameday is None else dict(obs.gameday),
            "passed": obs.skipped is None and all(v.ok for v in verdicts)}
