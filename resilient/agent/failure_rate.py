"""The failure rate the agent gives its workers, from which their Runs compute the durable save interval.

``resilient run --mtbf SECONDS`` gives it; ``--mtbf auto`` estimates it
before each generation from the run's history: the failures that restarted
workers (an exit, a signal, a hang, a lost node; those recovered in process
cost no durable progress and are left out), counted from the run-wide
incident copies in the store and the run directory's incident files (the
store's outlive launches across machines, the files on one machine), over
the wall time the node's goodput ledger has covered since the run's first
launch.  Pure: the agent reads the records and the exposure.  See
:mod:`resilient.checkpoint.cadence` for the interval itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..checkpoint.cadence import estimate_mtbf

RESTARTING_FAILURES = frozenset({"exit", "signal", "hang", "node_lost"})
"""Incident kinds that stop workers (an ``unhealthy`` node stops before any; a slowdown stops nothing)."""


def count_failures(records: Iterable[Mapping[str, Any]]) -> int:
    """Distinct incidents (by id) that restarted workers rather than recovering in process."""
    seen: set[str] = set()
    for r in records:
        if r.get("failure") in RESTARTING_FAILURES and not r.get("recovered") and r.get("id") is not None:
            seen.add(str(r["id"]))
    return len(seen)


def failure_rate_env(*, mtbf_s: float | None, from_history: bool, records: Iterable[Mapping[str, Any]],
                     exposure_s: float) -> dict[str, str]:
    """The workers' ``RESILIENT_MTBF`` and ``RESILIENT_MTBF_SOURCE``; empty without ``--mtbf``."""
    if mtbf_s is not None:
        return {"RESILIENT_MTBF": repr(float(mtbf_s)), "RESILIENT_MTBF_SOURCE": "--mtbf"}
    if not from_history:
        return {}
    estimate, how = estimate_mtbf(count_failures(records), exposure_s)
    return {"RESILIENT_MTBF": repr(estimate) if estimate is not None else "0",
            "RESILIENT_MTBF_SOURCE": f"--mtbf auto: {how}"}
