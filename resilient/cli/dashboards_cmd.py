"""``resilient dashboards check|push``: the Grafana dashboards and alert rules in ``dashboards/``.

``check`` validates offline, without Grafana or Prometheus: every dashboard
parses as JSON, every PromQL expression (panel targets, annotations,
template variables, alert rules) names only metrics of
:mod:`resilient.metrics.catalogue`, and every ``$variable`` an expression or
title uses is a template variable of the dashboard or one of Grafana's
built-ins.  ``push`` uploads the dashboards through ``grafana-client``
(``pip install grafana-client``, or the ``resilient-train[grafana]`` extra),
imported only when pushing.

Both find the assets wherever they run from: :func:`~resilient.metrics.assets.assets_dir` is the
repository's ``dashboards/`` in a source checkout and the copy the wheel
installs as ``resilient/_dashboards`` otherwise (see setup.py).

The PromQL helpers here are deliberately small: they strip strings, label
matchers, ranges and label lists, and take the remaining identifiers that
are not functions or keywords as metric names.  The tests also run every
expression through a real Prometheus, which is the parser of record.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError
from ..metrics.assets import assets_dir

TOKEN_ENV = "GRAFANA_TOKEN"

GRAFANA_BUILTINS = frozenset({
    "__interval", "__interval_ms", "__rate_interval", "__rate_interval_ms", "__range", "__range_s",
    "__range_ms", "__from", "__to", "__dashboard", "__org", "__user", "__all", "__name", "timeFilter",
})
_KEYWORDS = frozenset({
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "inf", "nan", "start", "end",
})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(\s*\()?")
_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*(\w+)\s*\)\s*$", re.DOTALL)


def default_dir() -> Path:
    """The shipped Grafana dashboards."""
    return assets_dir() / "grafana"


def default_rules() -> Path:
    """The shipped Prometheus alert rules."""
    return assets_dir() / "prometheus" / "alerts.yml"


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (functions, keywords and label names excluded)."""
    text = _STRING.sub('""', expr)
    prev = None
    while prev != text:  # nested matchers cannot occur, but ranges inside subqueries can
        prev = text
        text = _BRACES.sub("{}", _BRACKETS.sub("[]", text))
    text = _LABEL_LIST.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def variables_used(text: str) -> set[str]:
    """Grafana variables referenced as ``$name``, ``${name}``, ``${name:fmt}`` or ``[[name]]``."""
    return {a or b or c for a, b, c in _VARIABLE.findall(text)}


@dataclass(frozen=True)
class Expr:
    """One PromQL expression and where it came from."""

    where: str
    expr: str
    kind: str
    """"panel", "annotation", "variable" (the selector of a label_values() query) or "rule"."""


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels") or [])  # collapsed rows hold their panels


def _variable_query(var: dict[str, Any]) -> str:
    q = var.get("query")
    return str(q.get("query", "")) if isinstance(q, dict) else str(q or "")


def dashboard_exprs(dashboard: dict[str, Any], name: str) -> list[Expr]:
    """Every PromQL expression of a dashboard: panel targets, annotations and label_values() selectors."""
    found = []
    for p in _panels(dashboard.get("panels") or []):
        for t in p.get("targets") or []:
            if t.get("expr"):
                found.append(Expr(f"{name}: panel {p.get('title')!r} target {t.get('refId')}", t["expr"], "panel"))
    for a in (dashboard.get("annotations") or {}).get("list") or []:
        if a.get("expr"):
            found.append(Expr(f"{name}: annotation {a.get('name')!r}", a["expr"], "annotation"))
    for v in (dashboard.get("templating") or {}).get("list") or []:
        if v.get("type") == "query" and (m := _LABEL_VALUES.match(_variable_query(v))):
            found.append(Expr(f"{name}: variable {v.get('name')!r}", m.group(1), "variable"))
    return found


def load_dashboards(directory: Path) -> dict[str, dict[str, Any]]:
    """The dashboard JSON files of ``directory`` (not its subdirectories), by file name."""
    files = sorted(directory.glob("*.json"))
    if not files:
        raise ConfigError(f"no dashboard JSON in {directory}: pass --dir DIR holding the *.json dashboards")
    boards = {}
    for path in files:
        try:
            boards[path.name] = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return boards


def load_rules(path: Path) -> list[dict[str, Any]]:
    """The alerting and recording rules of a Prometheus rule file, flattened."""
    try:
        import yaml
    except ImportError:
        raise ConfigError("checking alert rules needs PyYAML: pip install pyyaml (or 'resilient-train[grafana]'), "
                          "or pass --rules '' to check the dashboards only") from None
    doc = yaml.safe_load(path.read_text()) or {}
    return [rule for group in doc.get("groups") or [] for rule in group.get("rules") or []]


def rule_exprs(rules: list[dict[str, Any]], name: str) -> list[Expr]:
    return [Expr(f"{name}: {r.get('alert') or r.get('record')}", str(r["expr"]), "rule") for r in rules]


def check_dashboard(dashboard: dict[str, Any], name: str, known: frozenset[str]) -> list[str]:
    """Problems of one dashboard: unknown metrics, undefined variables, missing uid/title/datasource variable."""
    problems = [f"{name}: missing {key!r}" for key in ("uid", "title") if not dashboard.get(key)]
    variables = [v for v in (dashboard.get("templating") or {}).get("list") or []]
    defined = {str(v.get("name")) for v in variables}
    if not any(v.get("type") == "datasource" and v.get("query") == "prometheus" for v in variables):
        problems.append(f"{name}: no 'datasource' template variable of type prometheus")
    for e in dashboard_exprs(dashboard, name):
        for metric in sorted(metric_names(e.expr) - known):
            problems.append(f"{e.where}: metric {metric!r} is not in resilient/metrics/catalogue.py")
    texts = [json.dumps(p.get("targets") or []) + json.dumps(p.get("datasource")) + str(p.get("title"))
             for p in _panels(dashboard.get("panels") or [])]
    texts += [json.dumps((dashboard.get("annotations") or {}).get("list") or [])]
    texts += [_variable_query(v) + json.dumps(v.get("datasource")) for v in variables]
    for text in texts:
        for var in sorted(variables_used(text) - defined - GRAFANA_BUILTINS):
            problems.append(f"{name}: variable ${var} is used but not defined in templating")
    return problems


def check(directory: Path, rules_path: Path | None) -> list[str]:
    """Every problem found in the dashboards of ``directory`` and the rule file (empty: all good)."""
    from ..metrics.catalogue import series_names

    known = series_names()
    problems = []
    for name, board in load_dashboards(directory).items():
        problems += check_dashboard(board, name, known)
    if rules_path is not None:
        for e in rule_exprs(load_rules(rules_path), rules_path.name):
            for metric in sorted(metric_names(e.expr) - known):
                problems.append(f"{e.where}: metric {metric!r} is not in resilient/metrics/catalogue.py")
    return problems


def push(directory: Path, *, url: str, token: str, folder: str) -> list[str]:
    """Create ``folder`` if needed and upload (overwrite) every dashboard; returns their Grafana URLs."""
    try:
        from grafana_client import GrafanaApi
        from grafana_client.client import GrafanaException
    except ImportError:
        raise ConfigError("`resilient dashboards push` needs grafana-client: pip install grafana-client "
                          "(or the extra: pip install 'resilient-train[grafana]')") from None
    boards = load_dashboards(directory)
    api = GrafanaApi.from_url(url, credential=token)
    try:
        existing = [f for f in api.folder.get_all_folders() if f.get("title") == folder]
        folder_uid = existing[0]["uid"] if existing else api.folder.create_folder(folder)["uid"]
        urls = []
        for board in boards.values():
            board = {**board, "id": None}  # Grafana matches on uid; a foreign numeric id would be refused
            reply = api.dashboard.update_dashboard({
                "dashboard": board, "folderUid": folder_uid, "overwrite": True,
                "message": "resilient dashboards push",
            })
            urls.append(url.rstrip("/") + str(reply.get("url", f"/d/{board['uid']}")))
    except GrafanaException as e:
        raise ConfigError(f"Grafana at {url} refused the upload: {e}; check --url and that the token "
                          "(a service account token with the Editor role) is valid") from None
    except OSError as e:
        raise ConfigError(f"cannot reach Grafana at {url}: {e}") from None
    return urls


def add_parser(commands: Any) -> None:
    p = commands.add_parser("dashboards", help="check or upload the Grafana dashboards in dashboards/")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    c = actions.add_parser("check", help="validate dashboards and alert rules offline (metrics, variables)")
    c.add_argument("--dir", type=Path, help="dashboard JSON directory (default: the dashboards shipped with "
                   "resilient, dashboards/grafana in the repository)")
    c.add_argument("--rules", type=Path, help="Prometheus rule file to check too (default: the shipped "
                   "dashboards/prometheus/alerts.yml; '' to skip)")
    c.set_defaults(handler=cmd_check)
    u = actions.add_parser("push", help="upload the dashboards to Grafana through grafana-client")
    u.add_argument("--url", required=True, help="Grafana base URL, e.g. https://grafana.example.com")
    u.add_argument("--token", help=f"Grafana service account token (default: ${TOKEN_ENV})")
    u.add_argument("--folder", default="resilient", help="Grafana folder to put them in (default resilient)")
    u.add_argument("--dir", type=Path, help="dashboard JSON directory (default: the dashboards shipped with "
                   "resilient)")
    u.set_defaults(handler=cmd_push)


def cmd_check(args: argparse.Namespace) -> int:
    directory = args.dir if args.dir is not None else default_dir()
    if args.rules is None:
        rules: Path | None = default_rules()
    else:  # '' (parsed as Path('.')) skips the rules
        rules = args.rules if str(args.rules) not in ("", ".") else None
    if rules is not None and not rules.is_file():
        raise ConfigError(f"no rule file at {rules}: pass --rules FILE, or --rules '' to check dashboards only")
    problems = check(directory, rules)
    for problem in problems:
        print(problem)
    if problems:
        return 1
    print(f"ok: {len(load_dashboards(directory))} dashboards in {directory}" + (f" and {rules}" if rules else ""))
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get(TOKEN_ENV)
    if not token:
        raise ConfigError(f"no Grafana token: pass --token TOKEN or set ${TOKEN_ENV}")
    directory = args.dir if args.dir is not None else default_dir()
    for url in push(directory, url=args.url, token=token, folder=args.folder):
        print(url)
    return 0
