"""The one exception hierarchy of resilient.

Every error a user can meet derives from :class:`ResilientError`, so a caller
can catch the whole family; each message names what is wrong and how to fix
it.  Builtin names (``TimeoutError`` and friends) are never shadowed.
"""

from __future__ import annotations


class ResilientError(Exception):
    """Base class of every error raised by resilient."""


class ConfigError(ResilientError, ValueError):
    """A setting given by the user is invalid; the message says which and why."""


class CheckpointError(ResilientError):
    """Base class of checkpoint failures."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint failed verification (schema, paths, sizes or digests)."""

    def __init__(self, checkpoint: str, file: str | None, problem: str) -> None:
        self.checkpoint = checkpoint
        self.file = file
        self.problem = problem
        where = f"{checkpoint}/{file}" if file else checkpoint
        super().__init__(f"checkpoint {where} failed verification: {problem}")


class CheckpointMismatchError(CheckpointError):
    """A valid checkpoint does not fit the job that tries to restore it."""


class NoValidCheckpointError(CheckpointError):
    """Committed checkpoints exist but none of them passed verification."""


class CommitConflictError(CheckpointError):
    """Another writer already committed a checkpoint under the same name."""


class StorageError(CheckpointError):
    """The storage backend failed (I/O error, full disk, S3 error or timeout)."""


class SerializationError(CheckpointError, TypeError):
    """Training state holds an object that cannot be saved without pickle."""


class FencedError(ResilientError):
    """A newer generation of the same launch holds the checkpoint fence: this process is stale.

    Raised at start, when claiming the fence; a save that finds the fence
    moved is refused with an event instead (it never raises into training).
    """

    def __init__(self, message: str, *, holder_launch: str | None = None, holder_generation: int | None = None) -> None:
        self.holder_launch = holder_launch
        self.holder_generation = holder_generation
        super().__init__(message)


class DataFetchError(ResilientError):
    """Reading a sample (``dataset[index]``) or collating a batch raised; the message names which."""

    def __init__(self, message: str, *, position: int, index: int | None, cause_type: str, cause: str) -> None:
        self.position = position
        """Global stream position of the sample (of the batch's first sample for a collate failure)."""
        self.index = index
        """Dataset index of the sample; None when ``collate_fn`` failed."""
        self.cause_type = cause_type
        self.cause = cause
        super().__init__(message)


class NonFiniteGradientsError(ResilientError):
    """A gradient held NaN or Inf when the optimizer was about to apply it; the update was not applied."""

    def __init__(self, message: str, *, step: int, rank: int, params: tuple[str, ...] = (),
                 own_nonfinite: bool | None = None) -> None:
        self.step = step
        self.rank = rank
        self.params = params
        """Names of (the first few) parameters whose gradient was not finite on this rank."""
        self.own_nonfinite = own_nonfinite
        """Whether this rank's own backward made a non-finite gradient, before the ranks' gradients were
        averaged (True: its samples are the cause; False: another rank's are); None when not looked at."""
        super().__init__(message)


class PersistentNonFiniteError(NonFiniteGradientsError):
    """Every try of the same step, on the same batch, gave non-finite gradients: the data or the model diverges,
    and a restart would replay the same (an exit code the agent does not restart)."""


class ResumeDivergedError(ResilientError):
    """The first step after a restore found the random streams or the data position elsewhere than the run that
    saved had them there: continuing would be another run (an exit code the agent does not restart)."""

    def __init__(self, message: str, *, step: int, moved: tuple[str, ...]) -> None:
        self.step = step
        self.moved = moved
        """What differs: ``torch``, ``cuda``, ``python``, ``numpy``, ``generator NAME``, ``data``."""
        super().__init__(message)
