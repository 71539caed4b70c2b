"""Which rank caused a hang, from the evidence the agent collected.

When one rank stops making progress, its peers soon block in a collective
waiting for it, so several ranks overrun together.  The culprit is, in
order of the strength of the evidence:

1. a process the kernel reports as stopped (SIGSTOP, a debugger), or whose
   cgroup is frozen (a paused container or VM slice);
2. a rank whose stacks show it is *not* waiting inside a collective, while
   others are (they wait for someone, it does not);
3. the rank that has been in its current section longest: the first to get
   stuck, the others blocked on it afterwards.

Pure: the agent gathers the evidence (see :mod:`resilient.watchdog.stacks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Frames that show a thread waiting for its peers rather than being stuck itself.
_COLLECTIVE_MARKERS = (
    "torch/distributed/",
    "torch/nn/parallel/distributed.py",
    "torch/autograd/",  # DDP's all-reduce runs inside backward()
    "torch/_tensor.py\", line",  # faulthandler form of tensor.backward()
    "resilient/checkpoint/coordinator.py",
)


@dataclass(frozen=True)
class Suspect:
    """What the agent knows about one overrunning rank."""

    rank: int
    section: str
    step: int
    in_section_s: float
    state: str
    stacks: str


@dataclass(frozen=True)
class Attribution:
    rank: int
    reason: str


def waits_in_collective(stacks: str) -> bool:
    """Whether the main thread's innermost frames are inside a collective or DDP backward."""
    main = _main_thread(stacks)
    head = main[:4]  # innermost frames come first (faulthandler: "most recent call first")
    return any(marker in line for line in head for marker in _COLLECTIVE_MARKERS)


def _main_thread(stacks: str) -> list[str]:
    """Frame lines of the thread dumped as current or main, innermost first."""
    lines = stacks.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Current thread") or "\"MainThread\"" in line:
            frames = []
            for frame in lines[i + 1:]:
                if not frame.startswith(" "):
                    break
                frames.append(frame.strip())
            return frames
    return [line.strip() for line in lines if line.startswith(" ")]


def attribute_hang(suspects: Sequence[Suspect]) -> Attribution:
    """Name the rank that most likely caused the hang, with the evidence used."""
    assert suspects, "attribute_hang needs at least one suspect"
    stopped = [s for s in suspects if s.state in ("stopped", "frozen")]
    if stopped:
        s = min(stopped, key=lambda s: s.rank)
        how = "stopped (SIGSTOP or a debugger)" if s.state == "stopped" else "frozen (its cgroup's freezer)"
        return Attribution(s.rank, f"rank {s.rank}'s process is {how}")
    waiting = {s.rank for s in suspects if s.stacks and waits_in_collective(s.stacks)}
    with_stacks = [s for s in suspects if s.stacks]
    not_waiting = [s for s in with_stacks if s.rank not in waiting]
    if waiting and not_waiting:
        s = max(not_waiting, key=lambda s: (s.in_section_s, -s.rank))
        others = ", ".join(str(r) for r in sorted(waiting))
        return Attribution(s.rank, f"rank {s.rank} is not in a collective while rank(s) {others} wait in one")
    s = max(suspects, key=lambda s: (s.in_section_s, -s.rank))
    return Attribution(s.rank, f"rank {s.rank} has been in section '{s.section}' the longest "
                               f"({s.in_section_s:.1f} s): the first to stop progressing")
