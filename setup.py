"""Packages and package data of resilient-train (the rest of the metadata is in pyproject.toml).

The operator assets live in the top-level ``dashboards/`` folder of the
repository (Grafana dashboards, Prometheus alert rules, runbooks, the
Alertmanager example): they are not code.  The wheel ships them as
``resilient/_dashboards`` through a package-dir mapping, which
``pyproject.toml`` cannot combine with package discovery; the sdist carries
``dashboards/`` as it is, so a wheel built from the sdist has them too.
``resilient.cli.dashboards_cmd.assets_dir`` finds them in either layout.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["resilient", "resilient.*"]), "resilient._dashboards"],
    package_dir={"resilient._dashboards": "dashboards"},
    package_data={"resilient": ["py.typed"], "resilient._dashboards": ["**/*"]},
)
