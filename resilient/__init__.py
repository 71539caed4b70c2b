"""resilient: a reliability and fault-tolerance runtime around PyTorch training loops.

The worker-side surface is small: :class:`Run`, :class:`ElasticLoader` and
:class:`CheckpointConfig`.  Importing the package starts no threads, reads
no environment variables, does not import :mod:`resilient.chaos`, and does
not import torch: the names below load their modules on first use, so light
processes (the CLI, the node agent) stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .core.lazy import lazy_getattr
from .core.version import VERSION as __version__

_EXPORTS = {
    "CheckpointConfig": "resilient.checkpoint.config",
    "ElasticLoader": "resilient.data.loader",
    "EventLog": "resilient.core.events",
    "Run": "resilient.run",
    "Stateful": "resilient.core.state",
    "CheckpointCorruptError": "resilient.core.errors",
    "CheckpointError": "resilient.core.errors",
    "CheckpointMismatchError": "resilient.core.errors",
    "ConfigError": "resilient.core.errors",
    "DataFetchError": "resilient.core.errors",
    "NoValidCheckpointError": "resilient.core.errors",
    "ResilientError": "resilient.core.errors",
    "ResumeDivergedError": "resilient.core.errors",
    "StorageError": "resilient.core.errors",
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
    "ResumeDivergedError",
    "Run",
    "Stateful",
    "StorageError",
    "__version__",
    "device_mesh",
]

if TYPE_CHECKING:
    from .checkpoint.config import CheckpointConfig
    from .core.errors import (
        CheckpointCorruptError,
        CheckpointError,
        CheckpointMismatchError,
        ConfigError,
        DataFetchError,
        NoValidCheckpointError,
        ResilientError,
        ResumeDivergedError,
        StorageError,
    )
    from .core.events import EventLog
    from .core.state import Stateful
    from .data.loader import ElasticLoader
    from .run import Run
    from .run.mesh import device_mesh


__getattr__ = lazy_getattr("resilient", _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
