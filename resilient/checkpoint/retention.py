"""Which committed checkpoints to keep: a pure policy."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .manifest import step_of


@dataclass(frozen=True)
class RetentionDecision:
    keep: tuple[str, ...]
    delete: tuple[str, ...]
    reason: str


def decide_retention(
    committed: Sequence[str], *, keep: int, permanent_every: int | None, newest_verified: str | None,
    pinned: Collection[str] = (),
) -> RetentionDecision:
    """Keep the newest ``keep``, every ``permanent_every``-th step, the newest verified one, and the ``pinned``
    (an incident's bundle holds them until it is released)."""
    assert keep >= 1
    ordered = sorted(committed, key=lambda n: step_of(n) or 0)
    recent = set(ordered[-keep:])
    kept, deleted = [], []
    for name in ordered:
        step = step_of(name) or 0
        permanent = permanent_every is not None and step % permanent_every == 0
        if name in recent or permanent or name == newest_verified or name in pinned:
            kept.append(name)
        else:
            deleted.append(name)
    reason = (
        f"keep newest {keep}"
        + (f", every step multiple of {permanent_every}" if permanent_every else "")
        + (f", newest verified {newest_verified}" if newest_verified else "")
        + (f", pinned {', '.join(sorted(set(pinned) & set(committed)))}" if set(pinned) & set(committed) else "")
        + f"; deleting {len(deleted)}"
    )
    return RetentionDecision(keep=tuple(kept), delete=tuple(deleted), reason=reason)
