"""The agent's control socket and run token, with real unix sockets, and `resilient stop` against it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path

import pytest

from resilient.agent.control import ControlError, ControlServer, call
from resilient.agent.rundir import RunDir, check_private_dir, read_token
from resilient.cli.main import main
from resilient.core.errors import ConfigError
from resilient.core.supervised import ThreadReports


@pytest.fixture
def served(tmp_path):
    run_dir = RunDir(tmp_path / "run", "n0")
    token = run_dir.create()
    stops: list[str] = []
    server = ControlServer(run_dir.socket_path("control.sock"), token, lambda: {"node": "n0", "phase": "running"},
                           stops.append)
    yield run_dir, token, server, stops
    server.close()


def test_token_and_socket_are_private(served):
    run_dir, token, server, _ = served
    assert stat.S_IMODE(run_dir.token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(server.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(run_dir.root.stat().st_mode) == 0o700
    assert read_token(run_dir.token_file) == token and len(token) == 64
    assert run_dir.create() == token, "a second agent of the run reuses the token"


def test_status_needs_no_token_but_stop_does(served):
    _, token, server, stops = served
    assert call(server.path, {"op": "status"}) == {"ok": True, "status": {"node": "n0", "phase": "running"}}
    refused = call(server.path, {"op": "stop", "token": "0" * 64})
    assert refused["ok"] is False and "token" in refused["error"]
    assert call(server.path, {"op": "stop"})["ok"] is False
    assert stops == []
    assert call(server.path, {"op": "stop", "token": token, "reason": "maintenance"})["ok"] is True
    assert stops == ["maintenance"]
    assert "unknown op" in call(server.path, {"op": "reboot", "token": token})["error"]


def test_readable_token_is_refused(tmp_path):
    path = tmp_path / "token"
    path.write_text("a" * 64)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_token(path)


def test_resilient_stop_sends_the_token_to_every_live_agent(served, capsys):
    run_dir, _, server, stops = served
    status = {"node": "n0", "phase": "running", "control_socket": str(server.path)}
    run_dir.status_file.write_text(json.dumps(status))
    assert main(["stop", "--run-dir", str(run_dir.root), "--reason", "drain n0"]) == 0
    assert stops == ["drain n0"]
    assert '"ok": true' in capsys.readouterr().out


def test_no_agent_listening_is_a_clear_error(tmp_path):
    with pytest.raises(ControlError, match="no agent is listening"):
        call(tmp_path / "nothing.sock", {"op": "status"})


def test_a_bug_answering_a_request_is_reported_and_the_socket_still_serves(tmp_path):
    """An error the server did not expect (here the status callback's) is answered, reported with its traceback
    through the agent's thread reports, and the serving thread starts again: ``resilient status`` and
    ``resilient stop`` keep working."""
    run_dir = RunDir(tmp_path / "run", "n0")
    token = run_dir.create()
    answers = iter([KeyError("ranks"), {"node": "n0"}])
    crashes: list[tuple[str, str, str]] = []

    def status():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    server = ControlServer(run_dir.socket_path("control.sock"), token, status, lambda reason: None,
                           threads=ThreadReports(lambda *crash: crashes.append(crash)))
    try:
        first = call(server.path, {"op": "status"})
        assert first == {"ok": False, "error": "the agent could not answer: KeyError: 'ranks'"}
        deadline = time.monotonic() + 10
        while not crashes and time.monotonic() < deadline:  # reported just after the answer went out
            time.sleep(0.01)
        assert [(name, error) for name, error, _ in crashes] == [("control", "KeyError: 'ranks'")]
        assert "raise answer" in crashes[0][2], "the traceback is in the report"
        while True:  # the thread starts again after a short pause; until then a connection waits in the backlog
            second = call(server.path, {"op": "status"})
            if second.get("ok") or time.monotonic() > deadline:
                break
        assert second == {"ok": True, "status": {"node": "n0"}}
    finally:
        server.close()


NOBODY = 65534
"""A second local user (``nobody``) who plays the other user on a shared host."""


def _start_as_nobody(work, *args) -> int:  # type: ignore[no-untyped-def]
    """Run ``work(*args)`` in a forked child as ``nobody``; its pid.  It exits 0 when ``work`` returned True (it did
    what it tried), 2 when False, 1 when it raised."""
    pid = os.fork()
    if pid == 0:  # the child: stdlib only, and never back into pytest
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = 0 if work(*args) else 2
        finally:
            os._exit(code)
    return pid


def _as_nobody(work, *args) -> int:  # type: ignore[no-untyped-def]
    """Run ``work(*args)`` as ``nobody`` to its end: its exit status (see :func:`_start_as_nobody`)."""
    return os.waitstatus_to_exitcode(os.waitpid(_start_as_nobody(work, *args), 0)[1])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_a_long_run_directory_s_sockets_go_to_a_private_directory_no_other_user_can_have_made(tmp_path):
    """The socket directory used to be /tmp/resilient-<hash of the node directory>, made with exist_ok: another
    user who made it first (mode 0777) could put a socket of theirs at control.sock.  Now it is made fresh, with a
    random name, private to the agent's user; and a directory that is not the user's own is refused."""
    run_dir = RunDir(tmp_path / ("x" * 100) / "run", "n0")
    token = run_dir.create()
    old = f"/tmp/resilient-{hashlib.sha256(os.fsencode(run_dir.node_dir.resolve())).hexdigest()[:16]}"

    def squat(directory: str) -> bool:
        os.mkdir(directory)
        os.chmod(directory, 0o777)
        return True

    assert _as_nobody(squat, old) == 0
    try:
        server = ControlServer(run_dir.socket_path("control.sock"), token, lambda: {"node": "n0"}, lambda _: None)
        try:
            home = server.path.parent
            st = os.lstat(home)
            assert str(home) != old and (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700) and stat.S_ISDIR(st.st_mode)

            def swap(target: str) -> bool:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.bind(f"{old}/evil.sock")
                try:
                    os.rename(f"{old}/evil.sock", target)
                except PermissionError:
                    return False
                return True

            assert _as_nobody(swap, str(server.path)) == 2, "another user replaced the agent's control socket"
            assert call(server.path, {"op": "status"})["ok"] is True
        finally:
            server.close()
        run_dir.remove_socket_dir()
        assert not home.exists()
    finally:
        shutil.rmtree(old, ignore_errors=True)

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match="open to other users"):
        check_private_dir(shared)
    os.chown(shared, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"belongs to uid {NOBODY}"):
        check_private_dir(shared)
    (tmp_path / "link").symlink_to(shared)
    with pytest.raises(ConfigError, match="symbolic link"):
        check_private_dir(tmp_path / "link")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_resilient_stop_sends_nothing_to_a_socket_another_user_serves(tmp_path, capsys):
    """status.json names a control socket that another user's process serves: `resilient stop` connects, asks the
    kernel who serves it, and sends nothing (the run token stays home)."""
    run_dir = RunDir(tmp_path / "run", "n0")
    token = run_dir.create()
    theirs = tempfile.mkdtemp()
    os.chown(theirs, NOBODY, NOBODY)
    path = f"{theirs}/control.sock"
    got_r, got_w = os.pipe()
    ready_r, ready_w = os.pipe()

    def listen() -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(path)
            os.chmod(path, 0o777)
            s.listen(1)
            os.write(ready_w, b"1")
            s.settimeout(20)
            conn, _ = s.accept()
            with conn:
                conn.settimeout(2)
                try:
                    received = conn.recv(65536)
                except TimeoutError:
                    received = b""
            os.write(got_w, received or b"-")
        return True

    pid = _start_as_nobody(listen)
    try:
        assert os.read(ready_r, 1) == b"1"
        run_dir.status_file.write_text(json.dumps({"node": "n0", "phase": "running", "control_socket": path}))
        assert main(["stop", "--run-dir", str(run_dir.root), "--reason", "drain"]) == 1
        err = capsys.readouterr().err
        assert f"is served by uid {NOBODY}, not by the run's user (0)" in err and "nothing was sent" in err
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        received = os.read(got_r, 65536)
        assert received == b"-" and token.encode() not in received
    finally:
        for fd in (got_r, got_w, ready_r, ready_w):
            os.close(fd)
        shutil.rmtree(theirs, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_a_memory_tier_directory_another_user_made_first_is_refused(tmp_path):
    """The memory tier's directory has a name a later agent of the run must find again, so it is known in advance:
    another user who made it first (to read the weights the ranks put there) gets a refusal, not the weights."""
    from resilient.agent.memory_tier import NodeMemory, directory_for

    shm = Path(tempfile.mkdtemp())
    os.chmod(shm, 0o1777)  # as /dev/shm: anyone may create, only the owner may remove
    try:
        run_dir = tmp_path / "run"
        target = directory_for(shm, "r", "n0", run_dir)

        def make(path: str) -> bool:
            os.mkdir(path)
            os.chmod(path, 0o777)
            return True

        assert _as_nobody(make, str(target)) == 0
        with pytest.raises(ConfigError, match=f"memory tier directory {target} belongs to uid {NOBODY}"):
            NodeMemory(shm, run_id="r", node_id="n0", run_dir=run_dir, limit=1 << 20, every=None,
                       emit=lambda *a, **k: None)
        shutil.rmtree(target)
        NodeMemory(shm, run_id="r", node_id="n0", run_dir=run_dir, limit=1 << 20, every=None, emit=lambda *a, **k: None)
        assert os.lstat(target).st_uid == 0 and stat.S_IMODE(os.lstat(target).st_mode) == 0o700
    finally:
        shutil.rmtree(shm, ignore_errors=True)
