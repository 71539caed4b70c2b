"""A resumed run is checked, not assumed: where the restored state stood, compared at the first step after it.

A checkpoint (durable or in the memory tier) is taken at a step boundary,
and holds each rank's random streams there (torch's CPU and CUDA
generators, Python's and numpy's global ones, the generators given to
``Run(generators=...)``) and its data position (the loader's cursor).
Restored, they are the *expected* streams at that step's start; the first
step boundary after the restore compares the process's streams and cursor
with them (:func:`verify`).  Anything drawn or read in between (a batch the
script fetched before its loop, an evaluation, a seed set again after
``Run()``) moved them, and the run would continue from another place than
the run that saved: a ``resume_diverged`` event names what moved and the
likely cause, and :class:`~resilient.core.errors.ResumeDivergedError`
stops the run (exit 79: a restart would diverge the same way), unless the
run accepts it (``Run(resume_check="accept")``, ``resilient run
--resume-check accept``), which the agent's ledger records.

**Prefetching.**  A script that fetches the next step's batch inside the
current step (to overlap it with the backward pass) draws for a step that
no checkpoint holds yet: the streams saved at the boundary are already
past the prefetched batch.  :func:`prefetch` (``run.prefetch(fn, ...)``)
notes the streams and the cursor before and after each fetch; a
checkpoint taken before the batch is used holds both (``PREFETCH`` in the
rank's payload), a restore puts back the *before* state, and the resumed
script's own fetch before its loop draws the same batch again.  Its
result is checked against the *after* state, then the saved boundary
state is put back, so the first step starts exactly where the saving run
was.  Under ``run.attempt()`` a step that fetched ahead cannot be retried
in place (the next batch is the script's own, which no rewind reaches):
the first such fetch makes the run recover by restart, and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from ..core.errors import ConfigError, ResumeDivergedError
from ..core.events import EventKind
from ..core.state import capture_rng, restore_rng
from .integration import decline
from .streams import Expected, Fetched, Streams, generator_states, moved, set_generator_states

if TYPE_CHECKING:
    from .state import RunState

T = TypeVar("T")

PREFETCH = "prefetch"
"""The key of a rank payload's prefetch record: the streams and cursor before and after the newest fetch."""
CHECKS = ("stop", "accept")
"""``Run(resume_check=...)``: a diverged resume stops the run (exit 79), or is recorded and accepted."""


# ----------------------------------------------------------------- streams
def streams_now(state: RunState) -> Streams:
    """This process's streams and the loader's cursor now."""
    return Streams(rng=capture_rng(), generators=generator_states(state.generators),
                   consumed=state.data.consumed if state.data is not None else None)


def put_back(state: RunState, streams: Streams) -> None:
    """Set the process's streams and the loader's cursor to ``streams``."""
    restore_rng(streams.rng)
    set_generator_states(state.generators, streams.generators, "the saved streams")
    if state.data is not None and streams.consumed is not None:
        state.data.rewind(streams.consumed)


# ----------------------------------------------------------------- prefetch
def prefetch(state: RunState, fetch: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    """``run.prefetch(fetch, *args, **kwargs)``: call ``fetch`` and note the streams around it (see the module)."""
    if not callable(fetch):
        raise ConfigError(f"run.prefetch({fetch!r}, ...): the first argument is the function that fetches a batch")
    if state.attempt.start is not None and state.inproc is not None:
        decline(state, "the script fetches its next batch inside the step (run.prefetch), which a retried step or "
                "a replacement rank cannot have: recovery is by restart, which gives the prefetched batch back "
                "exactly")
    before = streams_now(state)
    result = fetch(*args, **kwargs)
    after = streams_now(state)
    for_step = state.step + 1 if state.in_body else state.step
    state.resume.fetched = Fetched(for_step, before, after)
    expected = state.resume.expected
    if expected is not None and expected.refetch is not None and for_step == expected.step:
        _refetched(state, expected, after)
    return result


def saved_prefetch(state: RunState) -> dict[str, Any] | None:
    """The prefetch record a checkpoint taken now holds: the newest fetch, when it fetched this step's batch."""
    fetched = state.resume.fetched
    return fetched.to_payload() if fetched is not None and fetched.for_step == state.step else None


# ----------------------------------------------------------------- the check
def restore(state: RunState, step: int, source: str, rank_state: Mapping[str, Any]) -> None:
    """After a restore put the rank's streams back: expect them at the first step, and where the saving run had
    fetched this step's batch ahead, rewind to before that fetch so that the script fetches it again."""
    at_boundary = Streams(rng=dict(rank_state["rng"]), generators=dict(rank_state.get("generators") or {}),
                          consumed=state.data.consumed if state.data is not None else None)
    fetched = rank_state.get(PREFETCH)
    if fetched is not None and int(fetched["for_step"]) == step:
        before, after = Streams.from_payload(fetched["before"]), Streams.from_payload(fetched["after"])
        put_back(state, before)
        state.resume.expected = Expected(step, source, at_boundary, refetch=(before, after))
    else:
        state.resume.expected = Expected(step, source, at_boundary)


def _refetched(state: RunState, expected: Expected, after: Streams) -> None:
    """The resumed script fetched the prefetched batch again: it must have drawn what the saving run drew; then
    the streams go on from where the saving run's boundary had them."""
    assert expected.refetch is not None
    _, wanted = expected.refetch
    expected.refetch = None
    drift = moved(wanted, after)
    if drift:
        _diverged(state, expected, drift, (
            "the batch fetched again after the restore drew other numbers, or read other samples, than the one the "
            "saving run fetched ahead of this step: the fetch before the loop must be the one in the step (the "
            "same function and arguments, through run.prefetch)"))
        return
    put_back(state, expected.streams)


def verify(state: RunState) -> None:
    """At the first step boundary after a restore: the streams and cursor are where the saving run had them."""
    expected, state.resume.expected = state.resume.expected, None
    assert expected is not None
    now = streams_now(state)
    if expected.refetch is not None:  # fetched ahead before the checkpoint, not through run.prefetch since
        before, after = expected.refetch
        drift = moved(after, now)
        if not drift:  # fetched again the script's own way, from the same streams
            put_back(state, expected.streams)
            return
        cause = ("the saving run had fetched this step's batch ahead (run.prefetch), and the resumed script did "
                 "not fetch it again before its first step: fetch it before the loop through run.prefetch, as in "
                 "the step") if not moved(before, now) else \
                ("the saving run had fetched this step's batch ahead (run.prefetch); what the resumed script did "
                 "before its first step drew other numbers than that fetch: fetch it before the loop through "
                 "run.prefetch, with the same function and arguments as in the step")
        _diverged(state, expected, drift, cause)
        return
    drift = moved(expected.streams, now)
    if drift:
        _diverged(state, expected, drift, likely_cause(drift))


def likely_cause(drift: list[str]) -> str:
    """Why the streams or the cursor moved between a restore and the first step, as far as can be told."""
    streams = [d for d in drift if d != "data"]
    parts = []
    if streams:
        parts.append("random numbers were drawn between the restore (in Run()) and the first step: a batch "
                     "prefetched outside run.steps()? Fetch it through run.prefetch(fn, ...), whose checkpoint gives "
                     "it back, or draw it inside the step. A DataLoader's iter() draws its seeds from torch's generator: "
                     "create the iterator inside `with torch.random.fork_rng():`. An evaluation before the loop, or "
                     "a seed set again after Run(), moves them too")
    if "data" in drift:
        parts.append("the loader was read between the restore and the first step: a batch taken with next(run.data) "
                     "before the loop? Take it through run.prefetch(next, run.data), or inside the step")
    return "; ".join(parts)


def _diverged(state: RunState, expected: Expected, drift: list[str], cause: str) -> None:
    accepted = state.resume.mode == "accept"
    message = (f"the run resumed from {expected.source} is not where the run that saved it was at step "
               f"{expected.step}: {', '.join(_names(drift))} moved between the restore and the first step. Likely "
               f"cause: {cause}")
    state.events.emit(EventKind.RESUME_DIVERGED, step=expected.step, rank=state.rank, checkpoint=expected.source,
                      moved=drift, cause=cause, accepted=accepted)
    if state.hooks is not None:
        state.hooks.notice({"kind": EventKind.RESUME_DIVERGED.value, "step": expected.step,
                            "checkpoint": expected.source, "moved": drift, "accepted": accepted,
                            "message": message[:1000]})
    if not accepted:
        raise ResumeDivergedError(
            f"{message}. The run stops rather than continue as another run (a restart would resume the same way); "
            "fix the script, or accept the difference with Run(resume_check='accept') or resilient run "
            "--resume-check accept (recorded)", step=expected.step, moved=tuple(drift))


def _names(drift: list[str]) -> list[str]:
    words = {"torch": "torch's generator", "cuda": "the CUDA generators", "python": "Python's random",
             "numpy": "numpy's global generator", "data": "the data position"}
    return [words.get(d, d) for d in drift]


def replaced(state: RunState) -> None:
    """The state restored was replaced (by a peer's, in-process): the first step has nothing to be checked against."""
    state.resume.expected = None


def configure(state: RunState, mode: object) -> None:
    """``Run(resume_check=...)`` (or the agent's ``--resume-check``) checked and kept."""
    if mode not in CHECKS:
        raise ConfigError(f"Run(resume_check={mode!r}) must be one of {', '.join(map(repr, CHECKS))}")
    state.resume.mode = str(mode)
