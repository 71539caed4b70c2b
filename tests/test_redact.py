"""Secrets kept out of what a run writes down: flag values, launch records, incident bundles, workers' environment."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from resilient.agent.config import AgentConfig
from resilient.agent.incident_bundle import _redact
from resilient.agent.launch_record import read_launch_record, read_secrets, write_launch_record
from resilient.agent.rundir import RunDir
from resilient.core.redact import REDACTED, redact_argv, scrub, secret_name, secret_values

from .agent_helpers import run_agent

ARGV = ["train.py", "--api-token", "tok-123456", "--db-password=pw-abcdef", "--keep", "2", "--token-file",
        "/secrets/token", "--aws-secret-access-key", "AKIA0000", "--key-path", "/k", "--lr", "0.1"]


def test_secret_flags_are_named_by_their_words_and_places_are_not_secrets() -> None:
    assert [n for n in ("--api-token", "--db-password", "--aws-secret-access-key", "--passwd", "--credentials",
                        "--token-file", "--key-path", "--secret-dir", "--keep", "--lr")
            if secret_name(n)] == ["--api-token", "--db-password", "--aws-secret-access-key", "--passwd",
                                   "--credentials"]
    assert redact_argv(ARGV) == ["train.py", "--api-token", REDACTED, f"--db-password={REDACTED}", "--keep", "2",
                                 "--token-file", "/secrets/token", "--aws-secret-access-key", REDACTED, "--key-path",
                                 "/k", "--lr", "0.1"]
    assert secret_values(ARGV) == ["tok-123456", "pw-abcdef", "AKIA0000"]
    assert secret_values(["--api-token", "--verbose"]) == [], "a flag without a value hides nothing"
    assert scrub(b"x tok-123456 y tok-123456-long", ["tok-123456", "tok-123456-long", "ab"]) == \
        f"x {REDACTED} y {REDACTED}".encode()


def test_the_launch_record_keeps_no_secret_value_and_the_values_stay_private(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = RunDir(tmp_path / "run", "n0")
    run_dir.create()
    monkeypatch.setattr(sys, "argv", ["resilient", "run", "--token-file", "/secrets/token", "--", *ARGV])
    config = AgentConfig(run_id="r", node_id="n0", run_dir=run_dir.root, entrypoint=("python", *ARGV))
    assert write_launch_record(run_dir, config) is not None
    text = (run_dir.node_dir / "launch.json").read_text()
    for value in ("tok-123456", "pw-abcdef", "AKIA0000"):
        assert value not in text
    record = read_launch_record(run_dir.root, "n0")
    assert record is not None and REDACTED in record["argv"] and "/secrets/token" in record["argv"]
    secrets = run_dir.node_dir / "secrets.json"
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    assert sorted(read_secrets(run_dir.root, "n0")) == ["AKIA0000", "pw-abcdef", "tok-123456"]


def test_a_bundle_scrubs_the_token_from_whichever_file_the_password_and_secret_flag_values(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = RunDir(tmp_path / "run", "n0")
    own = run_dir.create()
    elsewhere = tmp_path / "token-elsewhere"
    elsewhere.write_text("t" * 64)
    (run_dir.node_dir / "secrets.json").write_text(json.dumps(["tok-123456"]))
    monkeypatch.setenv("RESILIENT_ETCD_PASSWORD", "etcd-pass-9")
    log = f"token {own} and {'t' * 64}; password etcd-pass-9; flag tok-123456".encode()
    members = {"ranks/n0/rank0.log": log, "script/train.py": b"API = 'tok-123456'\n"}
    _redact(members, run_dir.root, {"settings": {"token_file": str(elsewhere)}})
    assert members["ranks/n0/rank0.log"] == \
        f"token <run token> and <run token>; password {REDACTED}; flag {REDACTED}".encode()
    assert members["script/train.py"] == b"API = 'tok-123456'\n", "the script travels as it is (its SHA-256 is checked)"


def test_workers_never_see_the_etcd_password(tmp_path: Path) -> None:
    script = tmp_path / "env.py"
    out = tmp_path / "env.json"
    script.write_text(f"import json, os\nopen({str(out)!r}, 'w').write(json.dumps(dict(os.environ)))\n")
    proc = run_agent(tmp_path / "run", script=script, env={"RESILIENT_ETCD_PASSWORD": "etcd-pass-9"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(out.read_text())
    assert "RESILIENT_ETCD_PASSWORD" not in seen and "etcd-pass-9" not in json.dumps(seen)
    assert seen.get("RANK") == "0", "the file is the worker's environment"
    assert os.environ.get("RESILIENT_ETCD_PASSWORD") is None
