"""resilient: a reliability and fault-tolerance runtime around PyTorch training loops.

The worker-side surface is small: :class:`Run`, :class:`ElasticLoader` and
:class:`CheckpointConfig`.  Importing the package starts no threads, reads
no environment variables and does not import :mod:`resilient.chaos`.
"""

__version__ = "0.1.0"

from .checkpoint.config import CheckpointConfig  # noqa: E402
from .data.loader import ElasticLoader  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
    NoValidCheckpointError,
    ResilientError,
    StorageError,
)
from .events import EventLog  # noqa: E402
from .run import Run  # noqa: E402
from .state import Stateful  # noqa: E402

__all__ = [
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "ConfigError",
    "ElasticLoader",
    "EventLog",
    "NoValidCheckpointError",
    "ResilientError",
    "Run",
    "Stateful",
    "StorageError",
    "__version__",
]
