"""resilient: a reliability and fault-tolerance runtime around PyTorch training loops.

The worker-side surface is small: :class:`Run`, :class:`ElasticLoader` and
:class:`CheckpointConfig`.  Importing the package starts no threads, reads
no environment variables, does not import :mod:`resilient.chaos`, and does
not import torch: the names below load their modules on first use, so light
processes (the CLI, the node agent) stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_getattr

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointConfig": "resilient.checkpoint.config",
    "ElasticLoader": "resilient.data.loader",
    "EventLog": "resilient.events",
    "Run": "resilient.run",
    "Stateful": "resilient.state",
    "CheckpointCorruptError": "resilient.errors",
    "CheckpointError": "resilient.errors",
    "CheckpointMismatchError": "resilient.errors",
    "ConfigError": "resilient.errors",
    "DataFetchError": "resilient.errors",
    "NoValidCheckpointError": "resilient.errors",
    "ResilientError": "resilient.errors",
    "StorageError": "resilient.errors",
    "device_mesh": "resilient.run.mesh",
}

__all__ = [
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "ConfigError",
    "DataFetchError",
    "ElasticLoader",
    "EventLog",
    "NoValidCheckpointError",
    "ResilientError",
    "Run",
    "Stateful",
    "StorageError",
    "__version__",
    "device_mesh",
]

if TYPE_CHECKING:
    from .checkpoint.config import CheckpointConfig
    from .data.loader import ElasticLoader
    from .errors import (
        CheckpointCorruptError,
        CheckpointError,
        CheckpointMismatchError,
        ConfigError,
        DataFetchError,
        NoValidCheckpointError,
        ResilientError,
        StorageError,
    )
    from .events import EventLog
    from .run.mesh import device_mesh
    from .run import Run
    from .state import Stateful


__getattr__ = lazy_getattr("resilient", _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
