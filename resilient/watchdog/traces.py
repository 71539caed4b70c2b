"""Synthetic timing traces built from real noise: how the detectors are tested, benchmarked and tuned.

A trace is a list of windows, each ``{rank: RankWindow}``.  :func:`healthy`
draws one from recorded healthy windows (``tests/data/step_noise.json``,
written by ``benchmarks/record_step_noise.py``): consecutive real windows
from a seeded starting point, wrapping around at the end of the recording,
with the recorded ranks assigned to the trace's ranks in a seeded order.
The noise keeps its bursts, its drifts and its correlation across ranks; the
only seam is the wrap (one per pass over the recording).  Slowdowns are then added with the effect they
have on a synchronous data-parallel job:

- :func:`with_straggler`: one rank's section takes ``factor`` times longer;
  its peers wait the difference in ``comm``, and every rank's step grows by it;
- :func:`with_job_slowdown`: a section grows on every rank by ``fraction``
  of the step (data wait: the input pipeline; comm: the network).

:func:`replay` runs detectors over a trace and reports when (in steps
after the onset) each change was seen.  Pure and seeded: the same inputs
give the same trace.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .slowdown import SlowdownDetector
from .straggler import StragglerDetector
from .timing import COMM, RankWindow, parse_window

Trace = list[dict[int, RankWindow]]


def load_noise(path: str | Path) -> list[list[dict[str, Any]]]:
    """The recorded windows of a noise file: a list of windows, each the ranks' reports in rank order."""
    record = json.loads(Path(path).read_text())
    windows = record["windows"]
    if not windows or not all(len(ws) == len(windows[0]) for ws in windows):
        raise ValueError(f"{path}: no windows, or windows with different numbers of ranks")
    return windows


def healthy(noise: Sequence[Sequence[Mapping[str, Any]]], windows: int, *, seed: int) -> Trace:
    """``windows`` consecutive healthy windows of ``noise`` from a seeded start, ranks in a seeded order."""
    rng = random.Random(seed)
    ranks = list(range(len(noise[0])))
    rng.shuffle(ranks)
    start = rng.randrange(len(noise))
    out: Trace = []
    for index in range(windows):
        ws = noise[(start + index) % len(noise)]
        out.append({r: parse_window(r, f"n{r}", {**ws[recorded], "w": index}) for r, recorded in enumerate(ranks)})
    return out


def _scaled(w: RankWindow, sections: Mapping[str, float], step_s: float) -> RankWindow:
    return RankWindow(rank=w.rank, window=w.window, steps=w.steps, step_s=step_s, sections=sections, node=w.node)


def with_straggler(trace: Trace, rank: int, factor: float, *, start: int, section: str = "compute") -> Trace:
    """``rank``'s ``section`` ``factor`` times longer from window ``start`` on; its peers wait for it."""
    out: Trace = []
    for ws in trace:
        if ws[rank].window < start:
            out.append(dict(ws))
            continue
        extra = ws[rank].sections.get(section, 0.0) * (factor - 1.0)
        new = {}
        for r, w in ws.items():
            sections = dict(w.sections)
            if r == rank:
                sections[section] = sections.get(section, 0.0) + extra
            else:
                sections[COMM] = sections.get(COMM, 0.0) + extra
            new[r] = _scaled(w, sections, w.step_s + extra)
        out.append(new)
    return out


def with_job_slowdown(trace: Trace, section: str, fraction: float, *, start: int) -> Trace:
    """Every rank's ``section`` longer by ``fraction`` of its step from window ``start`` on."""
    out: Trace = []
    for ws in trace:
        new = {}
        for r, w in ws.items():
            if w.window < start:
                new[r] = w
                continue
            extra = w.step_s * fraction
            sections = dict(w.sections)
            sections[section] = sections.get(section, 0.0) + extra
            new[r] = _scaled(w, sections, w.step_s + extra)
        out.append(new)
    return out


@dataclass(frozen=True)
class Seen:
    """A detector's change on a trace: what, on which rank and section, and when."""

    detector: str
    """"straggler" or "slowdown"."""
    kind: str
    window: int
    rank: int | None
    section: str | None
    steps_after_onset: int | None
    """Steps from the onset to the end of the window where it was seen (None for a trace without onset)."""


def replay(trace: Trace, *, onset: int | None = None, straggler: StragglerDetector | None = None,
           slowdown: SlowdownDetector | None = None) -> list[Seen]:
    """Every change ``straggler`` and ``slowdown`` report over ``trace`` (``onset``: the window a fault began)."""
    seen: list[Seen] = []
    for ws in trace:
        window = max(w.window for w in ws.values())
        steps = max(w.steps for w in ws.values())
        after = None if onset is None else (window + 1 - onset) * steps
        if straggler is not None:
            seen.extend(Seen("straggler", c.kind, window, c.rank, c.section, after) for c in straggler.observe(ws))
        if slowdown is not None:
            for s in slowdown.observe(ws):
                a = s.attribution
                seen.append(Seen("slowdown", s.kind, window, None if a is None else a.rank,
                                 None if a is None else a.section, after))
    return seen
