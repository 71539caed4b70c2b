"""Launches: each submission of a run id gets its own launch, agreed on through the store.

A run id names a training run across requeues; a *launch* is one submission
of it (one Slurm job, one Kubernetes restart).  Stop requests, verdicts and
restart records live under ``launch/<launch id>/``, the rendezvous in a space
of the launch's own (:mod:`.keyspace`), so a verdict or a closed rendezvous of
an earlier launch cannot end the next one.
What outlives a launch is explicit: the generation counter, incidents,
checkpoints, the token fingerprint, and the restart budget when the user
asks for a run-wide one.

Agents agree on the launch without a side channel.  The record ``launch``
(signed, see :mod:`.proof`) holds ``{id, state, reason}``:

* absent (or without a valid proof): the first agent creates it (CAS);
* ``state == "running"`` and no verdict under it: join it;
* ended (``state == "ended"``, written by an agent of that launch when the
  run succeeded, was preempted or got a verdict; or a verdict under it): the
  first agent of the new submission starts a new launch by CAS, the others
  see the new record and join;
* an explicit launch id (``--launch-id``; on Slurm the CLI derives one from
  ``SLURM_JOB_ID`` and ``SLURM_RESTART_COUNT``) joins the launch of that id
  or replaces whatever launch is there: the scheduler knows best that the
  old submission is gone (killed without a chance to mark its end).

:func:`decide_launch` is the pure rule; :func:`begin_launch` and
:func:`end_launch` carry it out with compare-and-swap.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from ..core.errors import ConfigError
from .keyspace import LAUNCH, LaunchKeys
from .proof import SignedStore

_LAUNCH_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")

LaunchAction = Literal["create", "join", "replace"]


@dataclass(frozen=True)
class LaunchRecord:
    """The launch record as read from the store."""

    id: str
    state: str
    """"running" or "ended"."""
    reason: str = ""


@dataclass(frozen=True)
class LaunchDecision:
    """Which launch this agent belongs to, and why."""

    action: LaunchAction
    launch_id: str
    reason: str


def check_launch_id(launch_id: str) -> str:
    """``launch_id`` if it is a valid key component, else a ConfigError naming the rule."""
    if not _LAUNCH_ID.match(launch_id):
        raise ConfigError(f"launch id {launch_id!r} must be 1-63 letters, digits, '.', '_' or '-'")
    return launch_id


def new_launch_id() -> str:
    """A fresh launch id: random, so two submissions never pick the same one."""
    return secrets.token_hex(6)


def decide_launch(current: LaunchRecord | None, verdict: bool, requested: str | None, fresh: str) -> LaunchDecision:
    """Join the current launch or start one; ``verdict``: a verified verdict exists under ``current``."""
    if requested is not None:
        if current is not None and current.id == requested:
            return LaunchDecision("join", requested, f"launch {requested} is the one requested")
        were = "no launch" if current is None else f"launch {current.id} ({current.state})"
        return LaunchDecision("create" if current is None else "replace", requested,
                              f"launch {requested} requested explicitly; the store had {were}")
    if current is None:
        return LaunchDecision("create", fresh, "first launch of this run id")
    if current.state == "ended" or verdict:
        why = f"it ended: {current.reason}" if current.state == "ended" else "it has a verdict"
        return LaunchDecision("replace", fresh, f"resubmission: launch {current.id} is over ({why})")
    return LaunchDecision("join", current.id, f"launch {current.id} is running")


def record_of(value: dict[str, Any] | None) -> LaunchRecord | None:
    """The launch record in a verified value of the launch key (None when absent or not one)."""
    if value is None or not isinstance(value.get("id"), str):
        return None
    return LaunchRecord(value["id"], str(value.get("state", "running")), str(value.get("reason", "")))


def _read(signed: SignedStore) -> tuple[int, LaunchRecord | None]:
    entry, value = signed.get_entry(LAUNCH)
    return (0 if entry is None else entry.mod_revision), record_of(value)


def current_launch(signed: SignedStore) -> LaunchRecord | None:
    """The run's current launch record (verified), or None when there is none."""
    return _read(signed)[1]


def begin_launch(signed: SignedStore, requested: str | None = None, *, max_tries: int = 100) -> LaunchDecision:
    """Agree on this agent's launch through the store; compare-and-swap so concurrent starters agree."""
    for _ in range(max_tries):
        revision, current = _read(signed)
        verdict = current is not None and signed.get(LaunchKeys(current.id).verdict()) is not None
        decision = decide_launch(current, verdict, requested, new_launch_id())
        if decision.action == "join":
            return decision
        record = {"id": decision.launch_id, "state": "running", "reason": decision.reason}
        ok, _ = signed.compare_and_swap(LAUNCH, revision, record)
        if ok:
            return decision
    raise AssertionError(f"the launch record kept changing for {max_tries} tries")


def end_launch(signed: SignedStore, launch_id: str, reason: str, *, max_tries: int = 100) -> bool:
    """Mark ``launch_id`` ended (if it is still the current launch); ``True`` when this call marked it."""
    for _ in range(max_tries):
        revision, current = _read(signed)
        if current is None or current.id != launch_id or current.state == "ended":
            return False
        ok, _ = signed.compare_and_swap(LAUNCH, revision, {"id": launch_id, "state": "ended", "reason": reason})
        if ok:
            return True
    return False
