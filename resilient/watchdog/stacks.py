"""Read the Python stacks of a worker process, from inside or from outside.

A running worker dumps every thread's stack itself when it receives the
signal its ``resilient.Run`` registered with ``faulthandler`` (this works
even while the main thread is blocked in C code, because faulthandler
writes from the signal handler).  A *stopped* process cannot run a handler,
so its stack is read from outside with ``py-spy dump`` when py-spy is
installed; without py-spy the process is continued just long enough to dump,
and the record says so.  Every capture records the process state first.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .procfs import frozen_by_cgroup, read_stat


@dataclass(frozen=True)
class StackCapture:
    """One process's stacks and how they were obtained."""

    pid: int
    state: str
    """Process state when the capture started, e.g. "stopped" or "sleeping"."""
    method: str
    """"faulthandler", "py-spy", "faulthandler after SIGCONT" or "none"."""
    text: str
    note: str = ""


def process_state(pid: int, proc_root: str = "/proc") -> str:
    """The kernel's state of ``pid`` in words ("gone" when it no longer exists)."""
    try:
        st = read_stat(pid, Path(proc_root))
    except (OSError, ValueError, IndexError):
        return "gone"
    if st is None:
        return "gone"
    if st.state not in ("Z", "X") and frozen_by_cgroup(pid, Path(proc_root)):
        return "frozen"
    return st.state_word


def find_py_spy() -> str | None:
    """py-spy installed for this interpreter (next to it, its scripts directory, the user's) or on PATH.

    The interpreter's own copy comes first: ``resilient-train[hang]`` picks
    the py-spy release that can read this Python version, and another one
    found earlier on PATH may not.
    """
    places = [Path(sys.executable).with_name("py-spy"), Path(sysconfig.get_path("scripts")) / "py-spy"]
    try:  # pip install --user puts scripts here, which is often not on PATH
        places.append(Path(sysconfig.get_path("scripts", sysconfig.get_preferred_scheme("user"))) / "py-spy")
    except (KeyError, ValueError):
        pass
    for place in places:
        if place.is_file() and os.access(place, os.X_OK):
            return str(place)
    return shutil.which("py-spy")


def dump_with_py_spy(pid: int, py_spy: str, timeout_s: float = 15.0, *, nonblocking: bool = False) -> tuple[str, str]:
    """Return (stack text, note); text is empty when py-spy failed, and the note says why.

    ``nonblocking``: read the memory without pausing the process (for one that cannot be paused: frozen)."""
    try:
        out = subprocess.run([py_spy, "dump", "--pid", str(pid), *(["--nonblocking"] if nonblocking else [])],
                             capture_output=True, text=True,
                             timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return "", f"py-spy dump timed out after {timeout_s:.0f} s"
    if out.returncode != 0:
        return "", f"py-spy dump failed ({out.returncode}): {out.stderr.strip()[-300:]}"
    return out.stdout, ""


def dump_with_signal(pid: int, stack_file: Path, signum: int, wait_s: float = 2.0,
                     clock: Callable[[], float] = time.monotonic) -> str:
    """Ask the worker to append its stacks to ``stack_file``; return what it appended."""
    try:
        start = stack_file.stat().st_size
    except FileNotFoundError:
        start = 0
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return ""
    deadline = clock() + wait_s
    last_size, stable_since = start, clock()
    while clock() < deadline:
        time.sleep(0.02)
        try:
            size = stack_file.stat().st_size
        except FileNotFoundError:
            continue
        if size != last_size:
            last_size, stable_since = size, clock()
        elif size > start and clock() - stable_since > 0.1:
            break  # the dump grew and then stopped growing: complete
    try:
        with open(stack_file, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def capture(pid: int, stack_file: Path, signum: int, py_spy: str | None) -> StackCapture:
    """Capture ``pid``'s stacks by the best means its state allows."""
    state = process_state(pid)
    if state == "gone":
        return StackCapture(pid, state, "none", "", "the process had already exited")
    if state == "stopped":
        note = ""
        if py_spy is not None:
            text, note = dump_with_py_spy(pid, py_spy)
            if text:
                return StackCapture(pid, state, "py-spy", text)
        else:
            note = "py-spy is not installed (pip install 'resilient-train[hang]')"
        # Last resort: let it run for the moment it takes to dump, then stop it again.
        os.kill(pid, signal.SIGCONT)
        text = dump_with_signal(pid, stack_file, signum)
        os.kill(pid, signal.SIGSTOP)
        return StackCapture(pid, state, "faulthandler after SIGCONT", text, note)
    if state == "frozen":
        # A frozen process cannot run a signal handler, and py-spy's default attach would wait for the thaw:
        # read its memory without stopping it, or say that nothing can be had.
        if py_spy is None:
            return StackCapture(pid, state, "none", "", "the process is frozen (its cgroup's freezer) and py-spy is "
                                                       "not installed (pip install 'resilient-train[hang]')")
        text, note = dump_with_py_spy(pid, py_spy, nonblocking=True)
        return StackCapture(pid, state, "py-spy" if text else "none", text, note)
    text = dump_with_signal(pid, stack_file, signum)
    if not text and py_spy is not None:
        text, note = dump_with_py_spy(pid, py_spy)
        return StackCapture(pid, state, "py-spy" if text else "none", text, note or "no faulthandler dump arrived")
    return StackCapture(pid, state, "faulthandler" if text else "none", text,
                        "" if text else "no faulthandler dump arrived (was the Run created yet?)")
