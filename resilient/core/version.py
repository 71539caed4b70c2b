"""The package's version, defined here so that any module can name it without importing the package's face.

:mod:`resilient` exports it as ``resilient.__version__``.
"""

VERSION = "0.1.0"
"""The version of resilient-train (``pyproject.toml`` has the same)."""
