"""The fork server: workers forked from a process that has imported torch see what a fresh interpreter shows them.

One real server per module (it imports torch once), real forked processes compared with the same script started
the plain way; the agent's workers forked from it, and started the plain way with ``--no-fork-server``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilient.agent.forking import Forked, Spawner, unforkable
from resilient.agent.launcher import PLAIN, Worker, WorkerSpec, why_not_renice

from .agent_helpers import events, run_agent
from .helpers import REPO

SHOW = """\
import atexit, json, os, random, signal, sys, threading, time
import numpy, torch
seen = {"argv": sys.argv, "path0": sys.path[0], "name": __name__, "rank": os.environ.get("RANK"),
        "own_session": os.getsid(0) == os.getpid(), "ppid": os.getppid(), "stdin": sys.stdin.read(),
        "threads": torch.get_num_threads(), "random": random.random(), "numpy": float(numpy.random.random()),
        "main_file": sys.modules["__main__"].__file__, "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "signals": [str(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)]}
print(json.dumps(seen))
what = sys.argv[1] if len(sys.argv) > 1 else ""
if what == "wait":  # unbuffered: the line above is out before the process goes on
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
if what == "threads":  # a second thread, then the line that says it runs
    threading.Thread(target=lambda: [time.sleep(0.01) for _ in iter(lambda: os.path.exists(sys.argv[2]), True)],
                     daemon=True).start()
    print("threads", flush=True)
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
if what == "raise":
    raise RuntimeError("raised by the script")
if what == "exit":
    atexit.register(lambda: print("atexit ran", flush=True))
    def late():
        time.sleep(0.3)
        print("thread joined", flush=True)
    threading.Thread(target=late).start()  # not a daemon: the interpreter waits for it
    sys.exit(3)
if what == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fork") / "show.py"
    path.write_text(SHOW)
    return path


@pytest.fixture(scope="module")
def server_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}


@pytest.fixture(scope="module")
def spawner(server_env) -> Iterator[tuple[Spawner, list[str]]]:
    told: list[str] = []
    s = Spawner(enabled=True, base_env=server_env, unavailable=told.append)
    s.start(None)
    yield s, told
    s.close()


def _run(spawner: Spawner, argv: list[str], env: dict[str, str]) -> tuple[int, str, object]:
    proc = spawner.popen(argv, env, None)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    return proc.wait(timeout=60), out, proc


def test_a_forked_worker_sees_what_a_fresh_interpreter_shows_it(spawner, script, server_env, tmp_path):
    s, told = spawner
    env = {**server_env, "RANK": "3", "OMP_NUM_THREADS": "1"}  # the workers' threads, not the server's
    argv = [sys.executable, "-u", str(script), "plain"]
    fresh = json.loads(subprocess.run(argv, env=env, capture_output=True, text=True, check=True,  # as the agent
                                      stdin=subprocess.DEVNULL, start_new_session=True).stdout)  # starts them
    code, out, proc = _run(s, argv, env)
    forked = json.loads(out)
    assert code == 0 and isinstance(proc, Forked) and told == [], (code, out, told)
    for key in ("argv", "path0", "name", "rank", "own_session", "stdin", "threads", "main_file", "signals"):
        assert forked[key] == fresh[key], (key, forked[key], fresh[key])
    assert forked["ppid"] == s.server_pid and forked["threads"] == 1
    # Each fork draws its own random numbers, as separate interpreters would.
    again = json.loads(_run(s, argv, env)[1])
    assert (again["random"], again["numpy"]) != (forked["random"], forked["numpy"])

    # -u: what the worker prints reaches the agent at once, not at exit.
    flag = tmp_path / "go"
    proc = s.popen([sys.executable, "-u", str(script), "wait", str(flag)], env, None)
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["argv"][1] == "wait"
    assert proc.poll() is None
    flag.touch()
    assert proc.wait(timeout=60) == 0


def test_a_module_runs_as_python_minus_m_runs_it(spawner, server_env, tmp_path):
    s, told = spawner
    argv = [sys.executable, "-u", "-m", "json.tool", "--help"]
    fresh = subprocess.run(argv, env=server_env, capture_output=True, text=True, check=True, cwd=tmp_path)
    before = os.getcwd()
    os.chdir(tmp_path)  # the agent's working directory is the workers'
    try:
        code, out, proc = _run(s, argv, server_env)
    finally:
        os.chdir(before)
    assert (code, out) == (0, fresh.stdout) and isinstance(proc, Forked) and told == []


def test_exits_are_reported_as_python_ends_them(spawner, script, server_env):
    s, _ = spawner
    code, out, _ = _run(s, [sys.executable, "-u", str(script), "exit"], server_env)
    assert code == 3 and out.splitlines()[1:] == ["thread joined", "atexit ran"], out
    code, out, _ = _run(s, [sys.executable, "-u", str(script), "raise"], server_env)
    # The traceback starts at the script, as a fresh interpreter's would: nothing of the server above it.
    assert code == 1 and "Traceback (most recent call last):\n  File \"" + str(script) in out, out
    assert "forkserver" not in out and out.rstrip().endswith("RuntimeError: raised by the script"), out
    code, _, _ = _run(s, [sys.executable, "-u", str(script), "kill"], server_env)
    assert code == -signal.SIGKILL


def test_what_a_fork_cannot_reproduce_starts_the_plain_way_and_says_why_once(script, server_env):
    base = dict(server_env)
    assert unforkable(["/usr/bin/env", "python3", "x.py"], base, base) is not None
    assert "-X" in (unforkable([sys.executable, "-X", "dev", "x.py"], base, base) or "")
    assert "PYTHONHASHSEED" in (unforkable([sys.executable, "x.py"], {**base, "PYTHONHASHSEED": "1"}, base) or "")
    assert unforkable([sys.executable, "-u", "-B", "x.py"], {**base, "OMP_NUM_THREADS": "1"}, base) is None
    told: list[str] = []
    s = Spawner(enabled=True, base_env=base, unavailable=told.append)
    s.start(None)
    try:
        odd = s.popen([sys.executable, "-X", "dev", str(script)], base, None)
        assert odd.wait(timeout=60) == 0 and not isinstance(odd, Forked)
        also = s.popen([sys.executable, "-X", "dev", str(script)], base, None)
        assert also.wait(timeout=60) == 0
        assert len(told) == 1 and "-X" in told[0], told
        assert isinstance(s.popen([sys.executable, "-u", str(script)], base, None), Forked)
    finally:
        s.close()


def test_a_server_with_a_thread_alive_refuses_and_workers_start_the_plain_way(script, server_env, tmp_path):
    (tmp_path / "threaded.py").write_text("import threading, time\n"
                                          "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    env = {**server_env, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}
    told: list[str] = []
    s = Spawner(enabled=True, base_env=env, preload=["threaded"], unavailable=told.append)
    s.start(None)
    try:
        proc = s.popen([sys.executable, "-u", str(script)], env, None)
        assert proc.wait(timeout=60) == 0 and not isinstance(proc, Forked)
        assert len(told) == 1 and "1 Python threads besides its main one (Thread-1" in told[0], told
    finally:
        s.close()


def test_workers_die_with_their_server_and_the_next_start_the_plain_way(script, server_env, tmp_path):
    told: list[str] = []
    s = Spawner(enabled=True, base_env=server_env, unavailable=told.append)
    s.start(None)
    try:
        flag = tmp_path / "never"
        proc = s.popen([sys.executable, "-u", str(script), "wait", str(flag)], server_env, None)
        assert proc.stdout is not None and proc.stdout.readline()
        assert s.server_pid is not None
        # A scheduler's SIGTERM to every process of the job leaves the server be (its workers get their own).
        os.kill(s.server_pid, signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None and os.path.exists(f"/proc/{s.server_pid}")
        os.kill(s.server_pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{proc.pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{proc.pid}"), "the worker outlived its fork server"
        later = s.popen([sys.executable, "-u", str(script)], server_env, None)
        assert later.wait(timeout=60) == 0 and not isinstance(later, Forked)
        assert len(told) == 1 and "fork server ended" in told[0], told
    finally:
        s.close()


PARENT = """\
import json, os, sys
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"ppid": os.getppid()}, f)
"""


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "no-fork-server"])
def test_the_agent_forks_its_workers_from_its_server_unless_told_not_to(tmp_path, fork):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    out = tmp_path / "out"
    out.mkdir()
    run_dir = tmp_path / "run"
    flags = ("--nproc-per-node", "2", *(() if fork else ("--no-fork-server",)))
    result = run_agent(run_dir, *flags, script=script, script_args=(str(out),), timeout=120)
    assert result.returncode == 0, result.stderr
    agent = json.loads(next(run_dir.glob("nodes/*/pids.json")).read_text())["agent"]["pid"]
    parents = {json.loads((out / f"rank{r}.json").read_text())["ppid"] for r in (0, 1)}
    told = events(run_dir, "fork_server_unavailable")
    if fork:
        assert told == [] and len(parents) == 1 and parents != {agent}, (parents, agent, told)
    else:
        assert parents == {agent} and told == [], (parents, agent)


def _niceness(pid: int) -> set[int]:
    """The niceness of every thread of ``pid`` (field 19 of each task's stat)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.add(int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]))
    return found


@pytest.mark.parametrize("how", ["forked", "plain"])
def test_a_spare_starts_at_a_lower_priority_and_promotion_gives_every_thread_the_workers_back(
        spawner, script, server_env, tmp_path, how):
    assert why_not_renice() is None, "the tests run as root"
    s = spawner[0] if how == "forked" else PLAIN
    flag = tmp_path / "go"
    spec = WorkerSpec(local_rank=0, rank=-1, argv=(sys.executable, "-u", str(script), "threads", str(flag)),
                      env=server_env, log_file=tmp_path / "spare.log", echo=False, worker_id="s0", nice=7)
    worker = Worker(spec, time.monotonic, sys.stdout, None, None, s)
    try:
        assert isinstance(worker.proc, Forked) == (how == "forked")
        deadline = time.monotonic() + 60
        while "threads" not in spec.log_file.read_text():
            assert worker.exit is None and time.monotonic() < deadline, spec.log_file.read_text()
            time.sleep(0.05)
        assert json.loads(spec.log_file.read_text().splitlines()[0])["nice"] == 7
        assert len(list(Path(f"/proc/{worker.pid}/task").iterdir())) >= 2 and _niceness(worker.pid) == {7}
        assert worker.reprioritise(0) is None
        assert _niceness(worker.pid) == {0}
    finally:
        flag.touch()
        assert worker.proc.wait(timeout=60) == 0
        worker.finish()
