"""The ``resilient`` command line (``resilient.cli.main:main``).

This package is the only place that reads environment variables; the
library below it takes every setting as an explicit argument.
"""
