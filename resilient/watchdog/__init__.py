"""Hang, straggler and silent-slowdown detection: pure scoring plus thin mechanisms.

Nothing is imported here eagerly; import the submodule you need, e.g.
:mod:`resilient.watchdog.sections` for per-section hang timeouts.
"""
