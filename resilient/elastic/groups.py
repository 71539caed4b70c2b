"""The process groups of a worker, as in-process recovery must see them: whose they are, their timeout.

A re-formation destroys every group of the old generation and makes the
default group and the groups it knows again (:mod:`resilient.elastic.reform`).
What it cannot know it cannot re-create: a group the script made itself
(``dist.new_group``, a ``DeviceMesh`` of a DDP script) would keep the old
generation's connections, and whether a peer's death then reaches the
others would depend on who still holds a reference.  So the groups in
torch's registry are compared with the ones the Run owns
(:func:`foreign_groups`), and a run with foreign groups recovers by
restart; a script makes its groups recoverable by creating them in
``Run(groups=fn)``, which the Run calls again after every re-formation.

A re-formed group is formed under the recovery's own deadline, then given
the script's collective timeout back (:func:`collective_timeout`,
:func:`set_collective_timeout`): a long evaluation behind a barrier that
worked before a recovery keeps working after it.

:func:`restart_only` says, at the Run's start, why a run cannot recover in
process at all (CUDA state, NCCL, a torch without the private APIs this
needs), so the agent can say so at once and start no spare for nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..core import compat


def registered() -> list[Any]:
    """Every process group torch knows in this process (empty without one, or when the registry is gone)."""
    if compat.missing("group_registry") or not (dist.is_available() and dist.is_initialized()):
        return []
    return list(dist.distributed_c10d._world.pg_map)


def describe(group: Any) -> str:
    """A group in words: its name and ranks, as torch's registry has them."""
    world = dist.distributed_c10d._world
    ranks = sorted(world.pg_group_ranks.get(group, {}))
    name = world.pg_names.get(group, "?")
    return f"group {name!r} of ranks {ranks}"


def foreign_groups(owned: Iterable[Any]) -> list[str]:
    """The registered groups not in ``owned`` (the Run's own and those ``Run(groups=fn)`` made), described."""
    mine = {id(group) for group in owned if group is not None}
    return [describe(group) for group in registered() if id(group) not in mine]


def made_by(make: Any) -> tuple[Any, list[Any]]:
    """Call ``make()`` and return what it returned with the groups it registered meanwhile."""
    before = {id(group) for group in registered()}
    value = make()
    return value, [group for group in registered() if id(group) not in before]


def collective_timeout(group: Any = None) -> timedelta | None:
    """The collective timeout of ``group`` (the default group); None without one or without the private API."""
    if compat.missing("group_timeout") or not (dist.is_available() and dist.is_initialized()):
        return None
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = group._get_backend(torch.device("cpu"))
    options = getattr(backend, "options", None)
    found = getattr(options, "_timeout", None)
    return found if isinstance(found, timedelta) else None


def set_collective_timeout(timeout: timedelta, group: Any = None) -> None:
    """Give ``group`` (the default group) this collective timeout."""
    dist.distributed_c10d._set_pg_timeout(timeout, group)


def restart_only(model: torch.nn.Module) -> str | None:
    """Why this worker's run cannot recover in process at all (its recovery is by restart), or None."""
    devices = sorted({t.device.type for t in (*model.parameters(), *model.buffers())} - {"cpu"})
    if devices:
        return (f"this run's model is on {', '.join(devices)}: in-process recovery re-forms gloo groups and sends "
                "CPU state between ranks (NCCL is not supported yet), so recovery for this run is by restart "
                "from the newest commit")
    if dist.is_available() and dist.is_initialized() and str(dist.get_backend()).lower() == "nccl":
        return ("this run's process group is NCCL only: in-process recovery re-forms gloo groups (NCCL is not "
                "supported yet), so recovery for this run is by restart from the newest commit")
    for feature in ("group_timeout", "group_registry"):
        reason = compat.missing(feature)
        if reason:
            return f"{reason}; without it in-process recovery is declined (recovery is by restart)"
    return None
