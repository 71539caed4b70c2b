"""Checkpoint settings, validated where they are made."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from ..core.errors import ConfigError
from .digest import CHOICES, DEFAULT_CHUNK_BYTES, BlockSpec, algorithm_named
from .pacing import WHEN_BUSY, WhenBusy


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and how often to checkpoint."""

    dir: str | os.PathLike[str]
    """Local directory or ``s3://bucket/prefix``."""
    every_steps: int | None = 100
    """Save after every N completed optimizer updates; None saves only on request."""
    keep: int = 3
    """Committed checkpoints to keep (newest first); at least 1."""
    permanent_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of this, forever."""
    async_save: bool = True
    """Write in the background; the step loop pays only for a host-memory snapshot."""
    when_busy: WhenBusy = "defer"
    """A scheduled save due while the previous one is still written: "defer" it to the first step with a free
    writer, snapshot into a "second_buffer" and queue it (else defer), or "wait" (stalls the loop)."""
    save_on_finish: bool = True
    """Commit a final checkpoint when ``Run.steps()`` runs out."""
    endpoint_url: str | None = None
    """S3-compatible endpoint (MinIO, moto, ...); None uses AWS."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Digest block size: each block's digest is in the manifest, and a reader verifies blocks as they land."""
    digest: str = "xxh3-128"
    """How files are digested: "xxh3-128" catches corruption at memory speed; "sha256" also gives tamper
    evidence where the manifest is kept or signed elsewhere, at about a seventh of the speed."""
    timeout_s: float = 600.0
    """Longest wait for peers during a commit or restore before it fails."""
    mtbf_s: float | None = None
    """The run's mean time between failures, in seconds: with it the interval between scheduled saves is
    computed from their measured cost (Young/Daly, :mod:`.cadence`), ``every_steps`` the longest.  None: every
    ``every_steps`` steps, unless the agent gives a rate (``resilient run --mtbf``)."""
    elastic: bool = False
    """Allow restoring a checkpoint written by a different number of ranks (see docs/design/limits.md)."""

    def __post_init__(self) -> None:
        if not os.fspath(self.dir):
            raise ConfigError("CheckpointConfig.dir is empty: give a directory or s3://bucket/prefix")
        if self.every_steps is not None and self.every_steps < 1:
            raise ConfigError(f"CheckpointConfig.every_steps={self.every_steps} must be >= 1 (or None)")
        if self.keep < 1:
            raise ConfigError(f"CheckpointConfig.keep={self.keep} must be >= 1: the newest commit is always kept")
        if self.permanent_every is not None and self.permanent_every < 1:
            raise ConfigError(f"CheckpointConfig.permanent_every={self.permanent_every} must be >= 1 (or None)")
        if self.chunk_bytes < 4096:
            raise ConfigError(f"CheckpointConfig.chunk_bytes={self.chunk_bytes} must be at least 4096")
        if self.digest not in CHOICES:
            raise ConfigError(f"CheckpointConfig.digest={self.digest!r} must be one of {', '.join(CHOICES)}")
        if self.when_busy not in WHEN_BUSY:
            raise ConfigError(f"CheckpointConfig.when_busy={self.when_busy!r} must be one of {', '.join(WHEN_BUSY)}")
        if self.when_busy == "second_buffer" and not self.async_save:
            warnings.warn("CheckpointConfig(when_busy='second_buffer') has no effect with async_save=False: every "
                          "save is written before the loop goes on, so the writer is never busy", stacklevel=3)
        if self.mtbf_s is not None and not self.mtbf_s > 0:  # also refuses NaN
            raise ConfigError(f"CheckpointConfig.mtbf_s={self.mtbf_s!r} must be a number of seconds > 0 (or None)")
        if self.mtbf_s is not None and self.every_steps is None:
            warnings.warn("CheckpointConfig(mtbf_s=...) has no effect with every_steps=None: nothing is scheduled, "
                          "so there is no interval to compute", stacklevel=3)
        if self.timeout_s <= 0:
            raise ConfigError(f"CheckpointConfig.timeout_s={self.timeout_s} must be positive")

    @property
    def spec(self) -> BlockSpec:
        """How saves digest their files."""
        return BlockSpec(algorithm_named(self.digest), self.chunk_bytes)
