"""Checkpoints that commit atomically through verified manifests."""

from .config import CheckpointConfig
from .manager import CheckpointManager, Restored, SaveResult
from .manifest import Manifest, parse_manifest
from .storage import LocalStorage, Storage, open_storage

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "LocalStorage",
    "Manifest",
    "Restored",
    "SaveResult",
    "Storage",
    "open_storage",
    "parse_manifest",
]
