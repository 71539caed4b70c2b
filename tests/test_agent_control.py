"""The agent's control socket and run token, with real unix sockets, and `resilient stop` against it."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from resilient.agent.control import ControlError, ControlServer, call
from resilient.agent.rundir import RunDir, read_token
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
