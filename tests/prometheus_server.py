"""Real Prometheus and Alertmanager for the tests, on free loopback ports, plus a webhook receiver.

* ``webhook``: a small HTTP server thread that records every Alertmanager
  notification (path and JSON body);
* ``alertmanager``: Debian's ``prometheus-alertmanager`` running the example
  config ``dashboards/alertmanager/alertmanager.example.yml`` with its
  receivers' webhook URLs pointed at ``webhook`` and group waits and
  intervals cut to 1 s (routes, matchers and inhibit rules unchanged), no
  clustering;
* ``prometheus``: Debian's ``prometheus`` with scrape and evaluation
  interval 1 s, a test copy of ``dashboards/prometheus/alerts.yml`` whose
  ``for:`` durations are cut to 1 s (expressions, labels and annotations
  are unchanged), alerts sent to ``alertmanager``, and scrape targets the
  test sets at run time (file service discovery: ``prometheus.set_targets``).

All three are session-scoped.  A missing binary fails the run, naming the
Debian package to install.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from resilient.chaos.monitor import ServerProcess as _Process
from resilient.chaos.monitor import alertmanager_copy, rules_copy

from .servers import server_binary

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "dashboards" / "prometheus" / "alerts.yml"
AM_EXAMPLE = REPO / "dashboards" / "alertmanager" / "alertmanager.example.yml"
PROM_EXAMPLE = REPO / "dashboards" / "prometheus" / "prometheus.example.yml"
BINARIES = {  # our name -> (Debian's binary, its package)
    "prometheus": ("prometheus", "prometheus"),
    "promtool": ("promtool", "prometheus"),
    "alertmanager": ("prometheus-alertmanager", "prometheus-alertmanager"),
    "amtool": ("amtool", "prometheus-alertmanager"),
}
TEST_FOR_S = 1.0


def binary(name: str) -> str:
    """Path of a Prometheus-suite binary; fails the test naming the fix when it is missing."""
    exe, package = BINARIES[name]
    return server_binary(exe, package)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, data: dict[str, str] | None = None, timeout: float = 10) -> tuple[int, Any]:
    """GET (or form POST) ``url``; returns (HTTP status, decoded JSON body) for any status."""
    body = urllib.parse.urlencode(data).encode() if data is not None else None
    try:
        with urllib.request.urlopen(url, data=body, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class Webhook:
    """Records the JSON bodies Alertmanager posts; ``wait_for`` blocks until one matches."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict[str, Any]]] = []
        self._cond = threading.Condition()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
                with outer._cond:
                    outer.received.append((self.path, body))
                    outer._cond.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="webhook", daemon=True)
        self._thread.start()

    def wait_for(self, predicate: Callable[[str, dict[str, Any], dict[str, Any]], bool], timeout: float,
                 what: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """The first (path, notification, alert) with ``predicate(path, notification, alert)`` true."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for path, body in self.received:
                    for alert in body.get("alerts", []):
                        if predicate(path, body, alert):
                            return path, body, alert
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; "
                                         f"received {json.dumps(self.received)[:3000]}")
                self._cond.wait(left)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class Alertmanager(_Process):
    def __init__(self, root: Path, webhook: Webhook) -> None:
        exe = binary("alertmanager")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = root / "alertmanager.yml"
        alertmanager_copy(AM_EXAMPLE, self.config, webhook.url)  # the drills' adaptation of the shipped config
        cmd = [exe, f"--config.file={self.config}", f"--storage.path={root / 'data'}",
               f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=", "--log.level=warn"]
        super().__init__(cmd, root / "alertmanager.log", f"{self.url}/-/ready")

    def alerts(self) -> list[dict[str, Any]]:
        status, body = http_json(f"{self.url}/api/v2/alerts")
        assert status == 200, body
        return list(body)


class Prometheus(_Process):
    def __init__(self, root: Path, alertmanager: Alertmanager) -> None:
        exe = binary("prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.rules = rules_copy(RULES, root / "alerts.yml", TEST_FOR_S)
        self.targets_file = root / "targets" / "resilient.json"
        self.targets_file.parent.mkdir()
        self._targets: dict[str, str] = {}
        self.set_targets({})
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(self.rules)],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{alertmanager.port}"]}]}]},
            "scrape_configs": [{
                "job_name": "resilient", "honor_labels": True,
                "file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": "1s"}],
            }],
        }
        self.config = root / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))
        cmd = [exe, f"--config.file={self.config}", f"--storage.tsdb.path={root / 'data'}",
               f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        super().__init__(cmd, root / "prometheus.log", f"{self.url}/-/ready")

    def set_targets(self, targets: dict[str, str]) -> None:
        """Scrape exactly ``targets`` (name -> ``host:port``); the name becomes the ``target`` label."""
        self._targets = dict(targets)
        groups = [{"targets": [hostport], "labels": {"target": name}} for name, hostport in sorted(targets.items())]
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        os.replace(tmp, self.targets_file)

    def add_target(self, name: str, hostport: str) -> None:
        self.set_targets({**self._targets, name: hostport})

    def remove_target(self, name: str) -> None:
        self.set_targets({k: v for k, v in self._targets.items() if k != name})

    def query(self, expr: str, at: float | None = None) -> tuple[int, Any]:
        """Instant query: (HTTP status, body); a PromQL parse error is status 400."""
        data = {"query": expr, **({"time": repr(at)} if at is not None else {})}
        return http_json(f"{self.url}/api/v1/query", data)

    def result(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        status, body = self.query(expr, at)
        assert status == 200, f"{expr}: HTTP {status}: {body}"
        return list(body["data"]["result"])

    def target_up(self, hostport: str) -> bool:
        status, body = http_json(f"{self.url}/api/v1/targets?state=active")
        return status == 200 and any(t["scrapeUrl"].split("/")[2] == hostport and t["health"] == "up"
                                     for t in body["data"]["activeTargets"])

    def alerts(self) -> list[dict[str, Any]]:
        status, body = http_json(f"{self.url}/api/v1/alerts")
        assert status == 200, body
        return list(body["data"]["alerts"])


@pytest.fixture(scope="session")
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    yield hook
    hook.close()


@pytest.fixture(scope="session")
def alertmanager(tmp_path_factory: pytest.TempPathFactory, webhook: Webhook) -> Iterator[Alertmanager]:
    am = Alertmanager(tmp_path_factory.mktemp("alertmanager"), webhook)
    yield am
    am.stop()


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory: pytest.TempPathFactory, alertmanager: Alertmanager) -> Iterator[Prometheus]:
    root = tmp_path_factory.mktemp("prometheus")
    prom = Prometheus(root, alertmanager)
    yield prom
    prom.stop()
    shutil.rmtree(root / "data", ignore_errors=True)
