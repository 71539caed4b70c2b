"""What ``/proc/<pid>/stat`` says about a process: one reader for the watchdog and the agent's sweep."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STATES = {"R": "running", "S": "sleeping", "D": "disk sleep", "Z": "zombie", "T": "stopped", "t": "tracing stop",
          "X": "dead", "I": "idle", "P": "parked", "W": "paging"}
"""The process states of ``/proc/<pid>/stat``, named as ``/proc/<pid>/status`` names them."""

@dataclass(frozen=True)
class ProcStat:
    """What ``/proc/<pid>/stat`` says about one process."""

    pid: int
    state: str
    """One letter (see :data:`STATES`)."""
    pgid: int
    start_ticks: int
    ppid: int = 0

    @property
    def state_name(self) -> str:
        return f"{self.state} ({STATES.get(self.state, 'unknown')})"

    @property
    def state_word(self) -> str:
        """The state in words, e.g. "stopped"."""
        return STATES.get(self.state, self.state)


def read_stat(pid: int, proc_root: Path = Path("/proc")) -> ProcStat | None:
    """The process ``pid`` as ``/proc`` shows it, or None when there is no such process."""
    try:
        text = (proc_root / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces and ')': split after the last one.
    rest = text[text.rindex(")") + 2:].split()
    return ProcStat(pid=pid, state=rest[0], pgid=int(rest[2]), start_ticks=int(rest[19]), ppid=int(rest[1]))


def frozen_by_cgroup(pid: int, proc_root: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> bool:
    """Whether ``pid``'s cgroup is frozen: the v1 freezer's ``freezer.state`` (FROZEN or FREEZING), or cgroup v2's
    ``cgroup.events`` saying ``frozen 1``.  A frozen process runs nothing, not even a signal handler."""
    try:
        lines = (proc_root / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        try:
            if "freezer" in controllers.split(","):
                state = (cgroup_root / "freezer" / path.lstrip("/") / "freezer.state").read_text().strip()
                if state in ("FROZEN", "FREEZING"):
                    return True
            elif controllers == "":
                events = (cgroup_root / path.lstrip("/") / "cgroup.events").read_text().split("\n")
                if "frozen 1" in events:
                    return True
        except OSError:
            continue
    return False
