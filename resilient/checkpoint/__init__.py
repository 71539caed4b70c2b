"""Checkpoints that commit atomically through verified manifests.

Submodules load on first use (see :mod:`resilient`), so listing or
verifying checkpoints from the CLI does not pay for what it does not use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.lazy import lazy_getattr

_EXPORTS = {
    "CheckpointConfig": "resilient.checkpoint.config",
    "CheckpointManager": "resilient.checkpoint.manager",
    "Fence": "resilient.checkpoint.fence",
    "Restored": "resilient.checkpoint.restore",
    "SaveResult": "resilient.checkpoint.manager",
    "Manifest": "resilient.checkpoint.manifest",
    "parse_manifest": "resilient.checkpoint.manifest",
    "LocalStorage": "resilient.checkpoint.storage",
    "Storage": "resilient.checkpoint.storage",
    "open_storage": "resilient.checkpoint.locations",
}

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "Fence",
    "LocalStorage",
    "Manifest",
    "Restored",
    "SaveResult",
    "Storage",
    "open_storage",
    "parse_manifest",
]

if TYPE_CHECKING:
    from .config import CheckpointConfig
    from .fence import Fence
    from .locations import open_storage
    from .manager import CheckpointManager, SaveResult
    from .manifest import Manifest, parse_manifest
    from .restore import Restored
    from .storage import LocalStorage, Storage


__getattr__ = lazy_getattr("resilient.checkpoint", _EXPORTS, globals())
