"""Which errors mean a collective failed because a peer died or stopped answering.

One classification for both sides: the worker's ``run.attempt()`` survives such an error (the group is
re-formed and the step retried), and the agent never names one as the first failure of an incident while
another failure is at hand (:mod:`resilient.agent.consequences`).  Pure, torch-free, read from an error
record (``exc_type``, ``message``) as the worker's error file holds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

COLLECTIVE_ERROR_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")
"""torch.distributed's error types for a failed backend, connection or store: a peer is gone or unreachable."""
COLLECTIVE_ERROR_TEXT = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "nccl communicator was aborted",
    "ncclremoteerror", "remote process exited", "socket timeout", "timed out waiting", "timeout waiting for",
)
"""Phrases gloo, NCCL and the c10d store use when a peer died or stopped answering (matched lowercased)."""


def is_collective_error(error: Mapping[str, Any] | None) -> bool:
    """Whether ``error`` (an error file's record) is what a lost or stuck peer makes a survivor raise."""
    if not error:
        return False
    kind = str(error.get("exc_type") or "").rsplit(".", 1)[-1]
    text = str(error.get("message") or "").lower()
    return kind in COLLECTIVE_ERROR_TYPES or any(p in text for p in COLLECTIVE_ERROR_TEXT)


def caused_by_peer(error: Mapping[str, Any] | None) -> bool:
    """Whether ``error`` (an error file's record) is what another rank made this one raise: a collective error,
    or non-finite gradients that this rank's own backward did not make (they came in the all-reduce)."""
    return is_collective_error(error) or bool(error and error.get("own_nonfinite") is False)
