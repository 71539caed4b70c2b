"""Goodput ledger, MFU, the metric-name catalogue and the Prometheus exporter.

Nothing heavy is imported here: the names below load their modules on first
use, and none of these modules imports torch, prometheus_client or
matplotlib at import time (:func:`count_flops` imports torch when called).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.lazy import lazy_getattr

_EXPORTS = {
    "Account": "resilient.metrics.ledger_state",
    "Bucket": "resilient.metrics.timeline",
    "IncidentCost": "resilient.metrics.ledger_state",
    "Ledger": "resilient.metrics.ledger",
    "LedgerConfig": "resilient.metrics.ledger_state",
    "WindowAccount": "resilient.metrics.ledger_state",
    "Peak": "resilient.metrics.mfu",
    "count_flops": "resilient.metrics.mfu",
    "mfu": "resilient.metrics.mfu",
    "resolve_peak": "resilient.metrics.mfu",
    "transformer_flops": "resilient.metrics.mfu",
}

__all__ = [
    "Account",
    "Bucket",
    "IncidentCost",
    "Ledger",
    "LedgerConfig",
    "Peak",
    "WindowAccount",
    "count_flops",
    "mfu",
    "resolve_peak",
    "transformer_flops",
]

if TYPE_CHECKING:
    from .ledger import Ledger
    from .ledger_state import Account, IncidentCost, LedgerConfig, WindowAccount
    from .mfu import Peak, count_flops, mfu, resolve_peak, transformer_flops
    from .timeline import Bucket

__getattr__ = lazy_getattr("resilient.metrics", _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
