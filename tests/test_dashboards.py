"""The operator assets in dashboards/: Grafana dashboards, alert rules, runbooks, Alertmanager and Prometheus configs.

Static checks run the real tools (promtool, amtool) and a real Prometheus as
the PromQL parser.  The live tests run ``resilient run --metrics-port 0``
under a real Prometheus (scrape and rule evaluation every second, ``for:``
cut to 1 s in its copy of the rules, see tests/prometheus_server.py):

* a short run with a crash and a restart: every dashboard expression returns
  data, and so does every operand of every alert condition and annotation
  (the conditions themselves are false on a healthy run, so their inner
  subexpressions are evaluated instead);
* a run made to stall (a hang the agent is told not to time out, and
  ``--stall-alert-after 3``): TrainingStalled fires in Prometheus and reaches
  the test's webhook through Alertmanager's on-call route, runbook attached.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
import zipfile
from datetime import datetime
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from resilient.cli import dashboards_cmd
from resilient.cli.dashboards_cmd import Expr, dashboard_exprs, load_dashboards, load_rules, metric_names, rule_exprs
from resilient.metrics import assets as metrics_assets
from resilient.metrics.catalogue import series_names

from .agent_helpers import events, start_agent, wait_for
from .prometheus_server import AM_EXAMPLE, PROM_EXAMPLE, REPO, RULES, binary

# Session fixtures (a real Prometheus, Alertmanager and the webhook receiver) come from conftest.py.

GRAFANA = REPO / "dashboards" / "grafana"
RUNBOOKS = REPO / "dashboards" / "runbooks"
ALERTS = {"TrainingStalled", "GoodputBelowObjective", "CheckpointStale", "CheckpointFailures", "RestartStorm",
          "HangDetected", "Straggler", "SilentSlowdown", "NodeQuarantined"}
RUNBOOK_SECTIONS = ("## What it means", "## How to confirm", "## What to do", "## When to escalate")
HANG_GUARD_S = 180.0
"""How long the stall test waits for its alert before it reports that none came (not a latency claim)."""


def rfc3339(stamp: str) -> Fraction:
    """Seconds since the epoch of an RFC 3339 time as Alertmanager writes it (nanoseconds kept)."""
    found = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", stamp)
    assert found, stamp
    whole = datetime.fromisoformat(found[1] + ("+00:00" if found[3] == "Z" else found[3]))
    return int(whole.timestamp()) + Fraction(found[2] or ".0")


# ---------------------------------------------------------------- expressions

def substitute(expr: str, run_id: str = ".*", node: str = ".*") -> str:
    """Grafana's template variables replaced as Grafana would (with fixed intervals)."""
    values = {"run_id": run_id, "node": node, "rank": ".*",
              "__rate_interval": "1m", "__interval": "15s", "__range": "1h", "__range_s": "3600",
              "__range_ms": "3600000", "__interval_ms": "15000"}

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        assert name in values, f"no test value for ${name} in {expr}"
        return values[name]

    return dashboards_cmd._VARIABLE.sub(one, expr)


def all_exprs() -> list[Expr]:
    found = [e for name, board in load_dashboards(GRAFANA).items() for e in dashboard_exprs(board, name)]
    return found + rule_exprs(load_rules(RULES), RULES.name)


_SET_OP = re.compile(r"\b(?:and|or|unless)\b\s*(?:(?:on|ignoring)\s*\([^()]*\))?")
_CMP_OP = re.compile(r"(?:==|!=|>=|<=|>|<)\s*(?:bool\b)?\s*(?:(?:on|ignoring)\s*\([^()]*\))?\s*"
                     r"(?:(?:group_left|group_right)\s*(?:\([^()]*\))?)?")


def _split(expr: str, op: re.Pattern[str]) -> list[str]:
    """``expr`` split where ``op`` occurs outside parentheses, braces, brackets and strings."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(expr):
        c = expr[i]
        if c in "\"'`":
            end = i + 1
            while end < len(expr) and expr[end] != c:
                end += 2 if expr[end] == "\\" else 1
            i = end + 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and (m := op.match(expr, i)):
            parts.append(expr[start:i])
            start = i = m.end()
            continue
        i += 1
    return [*parts, expr[start:]]


def condition_operands(expr: str) -> list[str]:
    """The operands of a condition's set operators and comparisons that read metrics.

    ``A > B and C > 3600`` gives ``[A, B, C]``: on a healthy run the condition is
    empty, but each of these must return data for the condition to mean anything.
    """
    operands = [o.strip() for part in _split(expr, _SET_OP) for o in _split(part, _CMP_OP)]
    return [o for o in operands if metric_names(o)]


def test_condition_operands_split_at_top_level_only():
    expr = ('max by (run_id) (x{a!="b", c=~">"}) == 0 and max by (run_id) (max_over_time(x[6h])) > 0 '
            'unless on(run_id) y > bool on(run_id) group_left() 1.3 * z')
    assert condition_operands(expr) == ['max by (run_id) (x{a!="b", c=~">"})',
                                        "max by (run_id) (max_over_time(x[6h]))", "y", "1.3 * z"]


# ---------------------------------------------------------------- (1) the tools accept the files

def _tool(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def test_promtool_accepts_the_alert_rules():
    proc = _tool(binary("promtool"), "check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout


def test_promtool_accepts_the_example_prometheus_config(tmp_path):
    config = yaml.safe_load(PROM_EXAMPLE.read_text())
    assert config["rule_files"] == ["alerts.yml"]  # relative to the config file, as deployed
    config["rule_files"] = [str(RULES)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = _tool(binary("promtool"), "check", "config", str(tmp_path / "prometheus.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 1 rule files found" in proc.stdout


def test_the_example_alertmanager_config_is_valid(tmp_path):
    proc = _tool(binary("amtool"), "check-config", str(AM_EXAMPLE))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 inhibit rules" in proc.stdout and "2 receivers" in proc.stdout
    doc = yaml.safe_load(AM_EXAMPLE.read_text())
    hang = [r for r in doc["inhibit_rules"] if r["source_matchers"] == ['alertname="HangDetected"']]
    assert hang and hang[0]["target_matchers"] == ['alertname="TrainingStalled"'] and hang[0]["equal"] == ["run_id"]


# ---------------------------------------------------------------- dashboards: structure and `dashboards check`

def test_dashboards_are_grafana_json_with_datasource_run_and_node_variables():
    boards = load_dashboards(GRAFANA)
    assert set(boards) == {"goodput-overview.json", "reliability.json"}
    assert len({b["uid"] for b in boards.values()}) == 2
    for name, board in boards.items():
        assert 36 <= board["schemaVersion"] <= 41, name
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        assert variables["run_id"]["query"]["query"] == "label_values(resilient_agent_info, run_id)"
        assert variables["node"]["query"]["query"] == 'label_values(resilient_agent_info{run_id=~"$run_id"}, node)'
        panels = [p for p in board["panels"] if p["type"] != "row"]
        assert len(panels) >= 10, name
        for p in panels:
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"] and all('run_id=~"$run_id"' in t["expr"] for t in p["targets"]), p["title"]
            assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        assert [a["name"] for a in board["annotations"]["list"][1:]] == ["Incidents", "Restarts"]


def _check(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    dashboards_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["dashboards", *argv])
    return int(args.handler(args))


def test_dashboards_check_passes_and_names_unknown_metrics_and_variables(tmp_path, capsys):
    assert _check(["check", "--dir", str(GRAFANA), "--rules", str(RULES)]) == 0
    assert "ok: 2 dashboards" in capsys.readouterr().out

    board = json.loads((GRAFANA / "reliability.json").read_text())
    board["panels"][1]["targets"][0]["expr"] = 'rate(resilient_made_up_total{run_id=~"$run_id", x="$nope"}[5m])'
    (tmp_path / "bad.json").write_text(json.dumps(board))
    assert _check(["check", "--dir", str(tmp_path), "--rules", ""]) == 1
    out = capsys.readouterr().out
    assert "metric 'resilient_made_up_total' is not in resilient/metrics/catalogue.py" in out
    assert "variable $nope is used but not defined" in out


def test_assets_are_found_in_a_checkout_and_in_an_installed_layout(tmp_path):
    assert metrics_assets.assets_dir() == REPO / "dashboards"  # this checkout (PYTHONPATH)
    installed = tmp_path / "site-packages" / "resilient"
    for sub in ("grafana", "prometheus"):
        (installed / "_dashboards" / sub).mkdir(parents=True)
    assert metrics_assets.assets_dir(installed) == installed / "_dashboards"
    checkout = tmp_path / "checkout"
    for sub in ("grafana", "prometheus"):
        (checkout / "dashboards" / sub).mkdir(parents=True)
    (checkout / "resilient").mkdir()
    assert metrics_assets.assets_dir(checkout / "resilient") == checkout / "dashboards"
    with pytest.raises(metrics_assets.ConfigError, match=r"not installed .* pass --dir DIR"):
        metrics_assets.assets_dir(tmp_path / "elsewhere" / "resilient")


def _build_wheel(out: Path) -> Path:
    """A wheel of this checkout, built from a copy (the build must not write into the repository)."""
    src = out / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("resilient", "dashboards"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out / "wheel"), str(src)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [wheel] = (out / "wheel").glob("resilient_train-*.whl")
    return wheel


def test_the_wheel_ships_the_assets_and_the_cli_finds_them_from_any_directory(tmp_path):
    wheel = _build_wheel(tmp_path)
    shipped = {p.relative_to(REPO / "dashboards").as_posix() for p in (REPO / "dashboards").rglob("*")
               if p.is_file()}
    assert {"grafana/reliability.json", "prometheus/alerts.yml", "runbooks/TrainingStalled.md",
            "alertmanager/alertmanager.example.yml", "README.md"} <= shipped
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert {f"resilient/_dashboards/{name}" for name in shipped} <= names
        assert "resilient/py.typed" in names and "resilient/cli/dashboards_cmd.py" in names
        assert not [n for n in names if n.startswith("dashboards/")], "assets belong inside the package"
        # py-spy 0.3.14 cannot read Python 3.12+, and 0.4 cannot read some builds before it: one per Python.
        [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [line for line in z.read(metadata).decode().splitlines() if line.startswith("Requires-Dist: py-spy")]
        for extra in ("hang", "dev"):
            assert f'Requires-Dist: py-spy==0.3.14; python_version < "3.12" and extra == "{extra}"' in requires
            assert f'Requires-Dist: py-spy>=0.4; python_version >= "3.12" and extra == "{extra}"' in requires
        # A pure-Python wheel installs by unpacking it: run the CLI from it, in an unrelated directory.
        z.extractall(tmp_path / "site")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([sys.executable, "-m", "resilient", "dashboards", "check"], cwd=elsewhere,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "site")}, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    installed = tmp_path / "site" / "resilient" / "_dashboards"
    assert f"ok: 2 dashboards in {installed / 'grafana'} and {installed / 'prometheus' / 'alerts.yml'}" in proc.stdout


class _FakeGrafana:
    """Just enough of Grafana's HTTP API for grafana-client's folder and dashboard calls (no Grafana here)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                outer.requests.append(("GET", self.path, self.headers.get("Authorization", ""), None))
                self._reply([{"id": 1, "uid": "other", "title": "other"}])

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(("POST", self.path, self.headers.get("Authorization", ""), body))
                if self.path == "/api/folders":
                    self._reply({"id": 2, "uid": "fold-uid", "title": body["title"]})
                else:
                    self._reply({"status": "success", "uid": body["dashboard"]["uid"],
                                 "url": f"/d/{body['dashboard']['uid']}/x"})

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_push_creates_the_folder_and_uploads_every_dashboard_through_grafana_client(capsys):
    fake = _FakeGrafana()
    try:
        assert _check(["push", "--url", fake.url, "--token", "tok123", "--folder", "ml", "--dir", str(GRAFANA)]) == 0
    finally:
        fake.server.shutdown()
    posts = [r for r in fake.requests if r[0] == "POST"]
    assert posts[0][1:] == ("/api/folders", "Bearer tok123", posts[0][3]) and posts[0][3]["title"] == "ml"
    uploads = {r[3]["dashboard"]["uid"]: r[3] for r in posts[1:]}
    assert set(uploads) == {"resilient-goodput", "resilient-reliability"}
    assert all(u["folderUid"] == "fold-uid" and u["overwrite"] is True for u in uploads.values())
    assert f"{fake.url}/d/resilient-goodput/x" in capsys.readouterr().out


def test_push_without_grafana_client_names_what_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "grafana_client", None)
    with pytest.raises(dashboards_cmd.ConfigError, match=r"pip install grafana-client .*resilient-train\[grafana\]"):
        dashboards_cmd.push(GRAFANA, url="http://127.0.0.1:9", token="t", folder="f")


# ---------------------------------------------------------------- (2) every expression: catalogue names, parses

def test_every_expression_names_only_catalogue_metrics():
    known = series_names()
    exprs = all_exprs()
    assert len(exprs) > 60
    for e in exprs:
        used = metric_names(e.expr)
        assert used, f"{e.where}: reads no metric: {e.expr}"
        assert used <= known, f"{e.where}: {sorted(used - known)} not in the catalogue"


def test_every_expression_parses_in_prometheus(prometheus):
    for e in all_exprs():
        expr = substitute(e.expr, run_id="some-run", node="n0")
        status, body = prometheus.query(expr)
        assert status == 200, f"{e.where}: Prometheus refused {expr!r}: {body}"


# ---------------------------------------------------------------- (3) alerts and runbooks

def test_every_alert_has_severity_summary_description_and_a_runbook():
    rules = load_rules(RULES)
    assert {r["alert"] for r in rules} == ALERTS
    for r in rules:
        name = r["alert"]
        assert r["labels"]["severity"] in ("critical", "warning"), name
        ann = r["annotations"]
        assert ann["summary"] and ann["description"], name
        assert ann["runbook_url"] == f"dashboards/runbooks/{name}.md", name
        text = (REPO / ann["runbook_url"]).read_text()
        assert text.startswith(f"# {name}\n"), name
        positions = [text.find(s) for s in RUNBOOK_SECTIONS]
        assert -1 not in positions and positions == sorted(positions), f"{name}: sections {RUNBOOK_SECTIONS}"
        confirm = text[positions[1]:positions[2]]
        assert "```promql" in confirm and "resilient status --run-dir" in confirm, name
    assert {p.stem for p in RUNBOOKS.glob("*.md")} == ALERTS


# ---------------------------------------------------------------- (4) live: a real run under a real Prometheus

def _plan(path: Path, *faults: dict[str, Any]) -> Path:
    path.write_text(json.dumps({"version": 1, "seed": 0, "faults": list(faults)}))
    return path


def _metrics_hostport(run_dir: Path, proc: subprocess.Popen[bytes], log: Path) -> str:
    """host:port of the agent's /metrics, from its ``metrics_listening`` event."""

    def listening() -> Any:
        assert proc.poll() is None, f"agent exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            found = events(run_dir, "metrics_listening")
        except FileNotFoundError:
            return None
        return found[0] if found else None

    event = wait_for(listening, 60, "the agent's metrics_listening event")
    return f"127.0.0.1:{event['port']}"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def live_run(prometheus, tmp_path_factory):
    """Two ranks, rank 1 killed at step 8 (a restart from step 5), then training on; scraped every second."""
    d = tmp_path_factory.mktemp("live")
    run_id = f"dash-{uuid.uuid4().hex[:8]}"
    plan = _plan(d / "plan.json", {"kind": "kill", "rank": 1, "step": 8, "attempt": 0, "section": "step"})
    proc = start_agent(d / "run", "--nproc-per-node", "2", "--node-id", "n0", "--run-id", run_id,
                       "--metrics-port", "0", "--fault-plan", str(plan), "--preempt-grace", "10",
                       "--flops-per-step", "1e6", "--peak-tflops", "1",
                       script_args=("--steps", "3000", "--every", "5", "--dir", str(d / "ckpt"),
                                    "--trace", str(d / "trace"), "--step-sleep", "0.05"),
                       log=d / "agent.log")
    try:
        hostport = _metrics_hostport(d / "run", proc, d / "agent.log")
        prometheus.add_target(run_id, hostport)
        sel = f'run_id="{run_id}"'
        wait_for(lambda: prometheus.result(f"sum(resilient_restarts_total{{{sel}}}) >= 1")
                 and prometheus.result(f"resilient_committed_step{{{sel}}} >= 20"), 90,
                 f"a restart and step 20 committed, scraped (agent log {d / 'agent.log'})", interval=0.5)
        yield run_id
    finally:
        prometheus.remove_target(run_id)
        _stop(proc)


# Alone: it asserts that no alert fires on a healthy run, Straggler included, with `for:` cut to 1 s.  Beside
# another test file's processes on 2 cores (an FSDP test) one rank's compute ran 8% slow for 15 steps with no
# run-queue wait to explain it, and the detector flagged it: true of that host, not of a healthy run.
@pytest.mark.serial
def test_every_dashboard_and_rule_expression_returns_data_from_a_real_run(prometheus, live_run):
    """Panels must return data on a healthy run with one past incident.

    Alert rules and annotations are conditions that are empty while nothing is
    wrong (the run is training again): for those, each operand of their
    comparisons and set operators is evaluated instead and must return data.
    """
    to_check: list[tuple[str, str]] = []
    for e in all_exprs():
        expr = substitute(e.expr, run_id=live_run, node="n0")
        if e.kind in ("panel", "variable"):
            to_check.append((e.where, expr))
        else:
            operands = condition_operands(expr)
            assert operands, f"{e.where}: no operand reads a metric: {expr}"
            to_check += [(f"{e.where} (operand)", o) for o in operands]
    # Rule operands do not select the run: restrict them to this run's series by joining on run_id.
    scoped = [(w, x if 'run_id=~"' in x else f'({x}) and on(run_id) resilient_agent_info{{run_id="{live_run}"}}')
              for w, x in to_check]

    def empty() -> list[str]:
        return [f"{w}: {x}" for w, x in scoped if not prometheus.result(x)]

    missing = empty()
    deadline = time.monotonic() + 20  # rates need two scrapes in their window after the restart
    while missing and time.monotonic() < deadline:
        time.sleep(1)
        missing = empty()
    assert not missing, "expressions without data:\n" + "\n".join(missing)
    assert len(scoped) > 70
    # The run really had an incident and a restart, seen through the dashboards' own queries.
    restarts = prometheus.result(f'sum(resilient_restarts_total{{run_id="{live_run}"}})')
    assert float(restarts[0]["value"][1]) >= 1
    # No false alarm on a healthy run with one restart (for: is 1 s here), Straggler and SilentSlowdown
    # included: their detectors take their thresholds from the run's own noise.
    firing = [a["labels"] for a in prometheus.alerts()
              if a["labels"].get("run_id") == live_run and a["state"] == "firing"]
    assert not firing, firing


def test_a_stalled_run_fires_training_stalled_and_the_webhook_receives_it(prometheus, alertmanager, webhook,
                                                                       tmp_path):
    run_id = f"stall-{uuid.uuid4().hex[:8]}"
    plan = _plan(tmp_path / "plan.json", {"kind": "hang", "rank": 0, "step": 6, "attempt": 0, "section": "step"})
    started = time.monotonic()
    proc = start_agent(tmp_path / "run", "--nproc-per-node", "1", "--node-id", "n0", "--run-id", run_id,
                       "--metrics-port", "0", "--fault-plan", str(plan), "--stall-alert-after", "3",
                       "--section-timeout", "step=100000", "--preempt-grace", "1",
                       script_args=("--steps", "50", "--every", "2", "--dir", str(tmp_path / "ckpt"),
                                    "--trace", str(tmp_path / "trace"), "--step-sleep", "0.05"),
                       log=tmp_path / "agent.log")
    try:
        prometheus.add_target(run_id, _metrics_hostport(tmp_path / "run", proc, tmp_path / "agent.log"))
        path, note, alert = webhook.wait_for(
            lambda path, note, alert: alert["labels"].get("alertname") == "TrainingStalled"
            and alert["labels"].get("run_id") == run_id and alert["status"] == "firing",
            timeout=HANG_GUARD_S,
            what=f"TrainingStalled for {run_id} at the webhook (agent log {tmp_path / 'agent.log'})")
        received = time.monotonic() - started
        [last_progress] = prometheus.result(f'resilient_last_progress_timestamp_seconds{{run_id="{run_id}"}}')
        [threshold] = prometheus.result(f'resilient_stall_threshold_seconds{{run_id="{run_id}"}}')
        stalled_for = time.time() - float(last_progress["value"][1])
        print(f"TrainingStalled reached the webhook {received:.1f} s after launch, "
              f"{stalled_for:.1f} s after the last new step")
        # It began at an evaluation that saw no new step for longer than the threshold (the run is hung: the
        # last step is the same one now).
        assert float(threshold["value"][1]) == 3.0
        assert rfc3339(alert["startsAt"]) > Fraction(float(last_progress["value"][1])) + 3, (alert, last_progress)
        assert path == "/resilient/oncall" and note["receiver"] == "resilient-oncall"  # critical route
        assert alert["labels"]["severity"] == "critical" and alert["labels"]["node"] == "n0"
        assert alert["annotations"]["runbook_url"] == "dashboards/runbooks/TrainingStalled.md"
        assert run_id in alert["annotations"]["summary"]
        assert any(a["labels"]["alertname"] == "TrainingStalled" and a["labels"].get("run_id") == run_id
                   and a["state"] == "firing" for a in prometheus.alerts())
        assert proc.poll() is None  # the agent did not restart or stop the hung run
        assert not events(tmp_path / "run", "hang_detected")
    finally:
        prometheus.remove_target(run_id)
        _stop(proc)
