"""A rank's step time by section over one window of steps: what the detectors score.

Every rank splits each step's wall time into sections (``Run`` measures
them: :mod:`resilient.run.timing`) and, every ``window`` steps, reports per
section the median seconds per step over the window.  A section that does
not occur on most steps (a checkpoint every 50 steps) has a median of zero;
its mean per step is reported instead, so its cost still shows.

Sections the runtime measures:

- ``data``: waiting for the loader's next batch;
- ``compute``: the rest of the step's own work (forward, backward, the
  user's code), i.e. the step less the parts below;
- ``comm``: waiting for gradient communication (the part of DDP's
  all-reduce that the backward pass did not hide);
- ``optimizer``: ``optimizer.step()``;
- ``checkpoint``: the loop's stall for a checkpoint;
- any name the user passes to ``run.section(...)`` inside a step.

Communication is a victim's signal, not a culprit's: ranks that wait for a
slow peer spend *longer* in it, the slow peer shorter.  It is scored for
job-wide slowdowns (the network) and never to name a straggler.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

DATA = "data"
COMPUTE = "compute"
COMM = "comm"
OPTIMIZER = "optimizer"
CHECKPOINT = "checkpoint"
MEASURED = (DATA, COMPUTE, COMM, OPTIMIZER, CHECKPOINT)
"""The sections the runtime measures in every step, in the order a step goes through them."""
NOT_A_CULPRIT = frozenset({COMM})
"""Sections never used to name a straggler (waiting there is what a slow peer causes)."""
CPU_WAIT = "cpu_wait"
"""Not a section: the name under which a rank's wait for a CPU (its training thread runnable but not running,
whatever section it was in) is scored against its peers' (:mod:`resilient.watchdog.straggler`)."""


@dataclass(frozen=True)
class RankWindow:
    """One rank's timing over one window of steps."""

    rank: int
    window: int
    """Window index: the window covers steps ``[window * size, (window + 1) * size)``."""
    steps: int
    """Steps measured in the window (fewer than the size where a run began or resumed mid-window)."""
    step_s: float
    """Median wall seconds per step."""
    sections: Mapping[str, float]
    """Seconds per step by section (median over the window's steps; the mean where the median is zero)."""
    node: str = ""
    remaining: int | None = None
    """Steps still to do after this window (from ``Run.steps(total)``); None when the script did not say."""
    world: int | None = None
    """Ranks in the rank's process group when the window ended (None from a runtime that did not say)."""
    cpu_wait: float | None = None
    """Seconds per step the rank's training thread was runnable but waiting for a CPU (None: not measured)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sections", MappingProxyType(dict(self.sections)))


def parse_window(rank: int, node: str, payload: Mapping[str, Any]) -> RankWindow:
    """A heartbeat's ``timing`` report as a :class:`RankWindow`; ValueError naming the bad field."""
    try:
        window, steps, step_s = int(payload["w"]), int(payload["n"]), float(payload["step"])
        raw = payload["s"]
        if not isinstance(raw, Mapping):
            raise TypeError("'s' is not a mapping")
        sections = {str(k): float(v) for k, v in raw.items()}
        remaining = None if payload.get("left") is None else int(payload["left"])
        world = None if payload.get("world") is None else int(payload["world"])
        cpu_wait = None if payload.get("cpu") is None else float(payload["cpu"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"timing report of rank {rank} is malformed ({type(e).__name__}: {e})") from e
    values = [step_s, *sections.values(), *([] if cpu_wait is None else [cpu_wait])]
    if window < 0 or steps < 1 or (world is not None and world < 1) or \
            not all(math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"timing report of rank {rank} has a negative or non-finite number: {dict(payload)}")
    return RankWindow(rank=rank, window=window, steps=steps, step_s=step_s, sections=sections, node=node,
                      remaining=remaining, world=world, cpu_wait=cpu_wait)


def window_payload(w: RankWindow) -> dict[str, Any]:
    """The report :func:`parse_window` reads, for ``w`` (how an agent passes its ranks' windows to its peers)."""
    payload: dict[str, Any] = {"w": w.window, "n": w.steps, "step": w.step_s, "s": dict(w.sections)}
    if w.remaining is not None:
        payload["left"] = w.remaining
    if w.world is not None:
        payload["world"] = w.world
    if w.cpu_wait is not None:
        payload["cpu"] = w.cpu_wait
    return payload
