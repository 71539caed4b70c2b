"""Prometheus and Alertmanager for a drill, on free loopback ports, so a drill can score which alerts fired.

:class:`Monitoring` starts, for one drill's faulted run:

- a **receiver** in this process (an HTTP server on 127.0.0.1) that records
  every notification Alertmanager posts, with the time it arrived;
- **Alertmanager** (Debian's ``prometheus-alertmanager``, or
  ``alertmanager``) with the shipped example configuration
  (``dashboards/alertmanager/alertmanager.example.yml``): its routes,
  matchers and inhibit rules as they are, its webhook receivers pointed at
  the receiver, group waits and intervals cut to 1 s, no clustering;
- **Prometheus** scraping the drill's agents every second and evaluating a
  copy of the shipped alert rules (``dashboards/prometheus/alerts.yml``)
  every second, with every ``for:`` cut to ``for_s`` (expressions, labels
  and annotations unchanged: a drill lasts a minute, the rules' production
  ``for:`` would outlast it; None keeps them, as ``resilient local-cluster``
  does unless told).

:func:`unavailable` says why this machine cannot (a binary or pyyaml
missing, naming what to install); a drill that needs monitoring is then
skipped with that reason.  :meth:`Monitoring.close` stops both servers and
the receiver; their data directories are under the drill's output.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

BINARIES = {"prometheus": (("prometheus",), "prometheus"),
            "alertmanager": (("prometheus-alertmanager", "alertmanager"), "prometheus-alertmanager")}
STARTUP_S = 30.0


UNPACKED = Path(__file__).resolve().parent.parent.parent / ".servers" / "usr" / "bin"
"""Where ``scripts/setup.sh`` unpacks Debian's server packages in a source checkout (not installed system-wide)."""


def _binary(name: str) -> str | None:
    """The server's binary: on PATH, else unpacked in this checkout's ``.servers/`` (see :data:`UNPACKED`)."""
    names, _ = BINARIES[name]
    found = next((path for n in names if (path := shutil.which(n))), None)
    return found or next((str(UNPACKED / n) for n in names if (UNPACKED / n).is_file()), None)


def unavailable() -> str | None:
    """Why Prometheus and Alertmanager cannot run here (None: they can)."""
    for name, (_, package) in BINARIES.items():
        if _binary(name) is None:
            return f"{name} is not installed (Debian: apt-get install {package})"
    try:
        import yaml  # noqa: F401
    except ImportError:
        return "monitoring drills need pyyaml to adapt the rule and Alertmanager files: pip install pyyaml"
    return None


def dashboards_dir() -> Path:
    """The shipped dashboards folder (the repository's, or the wheel's ``resilient/_dashboards``)."""
    from ..metrics.assets import assets_dir

    return assets_dir()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Receiver:
    """Records Alertmanager's notifications: one entry per alert per notification, with its arrival time."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
                now = time.time()
                with outer._lock:
                    for alert in body.get("alerts", []):
                        labels = alert.get("labels", {})
                        outer.received.append({"time": now, "receiver": self.path.rsplit("/", 1)[-1],
                                               "alertname": labels.get("alertname"), "status": alert.get("status"),
                                               "labels": labels})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="drill-alerts", daemon=True)
        self._thread.start()

    def notifications(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.received)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class ServerProcess:
    """A server process with its log, ready once ``ready`` answers 200; ``stop()`` terminates it and waits."""

    def __init__(self, cmd: list[str], log: Path, ready: str) -> None:
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + STARTUP_S
        while not self._ready(ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{Path(cmd[0]).name} did not start ({log}):\n{log.read_text()[-2000:]}")
            time.sleep(0.2)

    @staticmethod
    def _ready(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return bool(r.status == 200)
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        stop_process(self.proc)


def firing(prometheus_url: str) -> list[str]:
    """Names of the alerts the Prometheus at ``prometheus_url`` has firing now ([] when it does not answer)."""
    try:
        with urllib.request.urlopen(f"{prometheus_url}/api/v1/alerts", timeout=5) as r:
            body = json.load(r)
    except (OSError, ValueError):
        return []
    return sorted({a["labels"]["alertname"] for a in body["data"]["alerts"] if a.get("state") == "firing"})


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM ``proc`` and wait for it; SIGKILL it when it has not ended within 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def rules_copy(src: Path, dst: Path, for_s: float | None) -> Path:
    """The rule file with every ``for:`` cut to ``for_s`` (None: kept); nothing else changed."""
    import yaml

    doc = yaml.safe_load(src.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "for" in rule and for_s is not None:
                rule["for"] = f"{for_s:g}s"
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dst


def alertmanager_copy(src: Path, dst: Path, receiver_url: str) -> Path:
    """The Alertmanager configuration with its webhooks pointed at ``receiver_url`` and 1 s group timing."""
    import yaml

    doc = yaml.safe_load(src.read_text())
    for receiver in doc["receivers"]:
        for hook in receiver.get("webhook_configs") or []:
            hook["url"] = receiver_url + "/" + urllib.parse.urlsplit(hook["url"]).path.strip("/")
        for key in [k for k in receiver if k.endswith("_configs") and k != "webhook_configs"]:
            del receiver[key]  # pagers and chat: a drill's alerts stop at the receiver
            receiver.setdefault("webhook_configs", []).append({"url": f"{receiver_url}/{receiver['name']}",
                                                               "send_resolved": True})

    def fast(route: dict[str, Any], top: bool) -> None:
        for key in ("group_wait", "group_interval"):
            if key in route or top:
                route[key] = "1s"
        for child in route.get("routes") or []:
            fast(child, False)

    fast(doc["route"], True)
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dst


class Monitoring:
    """Alertmanager, Prometheus and the receiver for one drill (see the module's docstring)."""

    def __init__(self, root: Path, *, for_s: float | None = 1.0, dashboards: Path | None = None) -> None:
        board = dashboards or dashboards_dir()
        root.mkdir(parents=True, exist_ok=True)
        self.receiver = Receiver()
        self._servers: list[ServerProcess] = []
        try:
            am_port = free_port()
            self.alertmanager_url = f"http://127.0.0.1:{am_port}"
            am = alertmanager_copy(board / "alertmanager" / "alertmanager.example.yml", root / "alertmanager.yml",
                                   self.receiver.url)
            am_exe = _binary("alertmanager")
            assert am_exe is not None
            self._servers.append(ServerProcess(
                [am_exe, f"--config.file={am}", f"--storage.path={root / 'alertmanager-data'}",
                 f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address=", "--log.level=warn"],
                root / "alertmanager.log", f"http://127.0.0.1:{am_port}/-/ready"))
            self.targets = root / "targets.json"
            self.targets.write_text("[]")
            self._named: dict[str, str] = {}
            rules = rules_copy(board / "prometheus" / "alerts.yml", root / "alerts.yml", for_s)
            import yaml

            config = {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
                "rule_files": [str(rules)],
                "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
                "scrape_configs": [{"job_name": "resilient", "honor_labels": True,
                                    "file_sd_configs": [{"files": [str(self.targets)], "refresh_interval": "1s"}]}],
            }
            (root / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            prom_exe = _binary("prometheus")
            assert prom_exe is not None
            self._servers.append(ServerProcess(
                [prom_exe, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'prometheus-data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                root / "prometheus.log", f"{self.url}/-/ready"))
        except BaseException:
            self.close()
            raise

    def scrape(self, name: str, hostport: str) -> None:
        """Scrape ``hostport`` (an agent's metrics server) from now on, labelled ``target=name``."""
        self._named[name] = hostport
        groups = [{"targets": [hp], "labels": {"target": n}} for n, hp in sorted(self._named.items())]
        tmp = self.targets.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.targets)

    def firing(self) -> list[str]:
        """Names of the alerts Prometheus has firing now."""
        return firing(self.url)

    def notifications(self) -> list[dict[str, Any]]:
        return self.receiver.notifications()

    def close(self) -> None:
        for server in reversed(self._servers):
            server.stop()
        self._servers.clear()
        self.receiver.close()

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self._servers if s.proc.poll() is None]
