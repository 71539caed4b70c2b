"""Where the operator assets are: the Grafana dashboards, Prometheus alert rules, Alertmanager example and
runbooks (``dashboards/`` in a checkout, ``resilient/_dashboards`` in a wheel).  Read by the dashboards and
deploy commands, and by the drills that run Prometheus with the shipped rules."""

from __future__ import annotations

from pathlib import Path

from ..core.errors import ConfigError


def assets_dir(package_dir: Path | None = None) -> Path:
    """The operator assets folder (``grafana/``, ``prometheus/``, ``runbooks/``, ...), from any directory.

    ``package_dir`` is the ``resilient`` package folder (default: this
    installation's).  An installed wheel has the assets at
    ``resilient/_dashboards``; a source checkout (also an editable install)
    at ``dashboards/`` next to the package.  The path is derived from the
    package's own location, never from the current directory or an import
    of the assets, so it is always the copy that belongs to this code.
    """
    package = package_dir if package_dir is not None else Path(__file__).resolve().parent.parent
    candidates = (package / "_dashboards", package.parent / "dashboards")
    for candidate in candidates:
        if (candidate / "grafana").is_dir() and (candidate / "prometheus").is_dir():
            return candidate
    raise ConfigError(f"the dashboards and alert rules are not installed (looked in {candidates[0]} and "
                      f"{candidates[1]}); reinstall resilient-train, or pass --dir DIR (and --rules FILE)")
