"""``resilient.device_mesh``: the device mesh of a sharded script, for a member and for a spare alike.

A sharded script (FSDP2, HSDP) needs its device mesh, and so a process
group, before it can shard the model, build the optimizer and create the
:class:`~resilient.run.Run`.  A spare has no group until the agent promotes
it, so ``init_device_mesh`` cannot work there.  :func:`device_mesh` takes
the same arguments and:

* in a member (or under ``torchrun``, or alone): creates the default group
  from torch's variables when none exists (gloo without CUDA), then the
  mesh, exactly as ``init_device_mesh``;
* in a spare (``RESILIENT_ROLE=spare``): tells the agent it is warm, waits
  until an assignment makes it a member, forms that generation's group, and
  only then creates the mesh.  Its groups are created in the order the
  survivors re-create theirs (:func:`resilient.elastic.mesh_rebind.rebind`),
  so the script then shards a model that lives in the new group.  The Run it
  creates next takes the joined group over (:func:`take_joined`): it skips
  restoring a checkpoint and takes its shards from a replica instead
  (:mod:`resilient.elastic.shard_sync`).

Everything a spare does before its promotion (imports, building the model
on the CPU, loading data) is done while it waits.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigError
from ..worker.env import WorkerEnv

if TYPE_CHECKING:
    from torch.distributed import Store
    from torch.distributed.device_mesh import DeviceMesh

    from ..core.events import EventLog
    from ..elastic.reform import Assignment
    from ..worker.hooks import WorkerHooks


@dataclass(frozen=True)
class Joined:
    """A spare's promotion, done before its Run existed: the Run takes it over."""

    hooks: WorkerHooks
    assignment: Assignment
    store: Store
    """A client of this node's agent store."""
    form_s: float
    """Seconds from the assignment to the formed group."""


_joined: Joined | None = None


def device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """``init_device_mesh(device_type, mesh_shape, mesh_dim_names=...)``; in a spare, after its promotion."""
    global _joined
    from torch.distributed.device_mesh import init_device_mesh

    from .ddp import init_default_group

    env = WorkerEnv.from_environ(os.environ)
    if env is not None and env.role == "spare":
        if _joined is not None:
            raise ConfigError("resilient.device_mesh() was called twice in a spare; create the mesh once and "
                              "slice it (mesh['name']) for the other dimensions")
        _joined = _join_as_spare(env)
    else:
        init_default_group(True)
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    return init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=names)


def take_joined() -> Joined | None:
    """The promotion :func:`device_mesh` waited for in this spare (once), for its Run to finish joining."""
    global _joined
    joined, _joined = _joined, None
    return joined


def worker_hooks(env: WorkerEnv | None, events: EventLog, joined: Joined | None) -> WorkerHooks | None:
    """A Run's worker hooks: those of the spare's promotion if it joined early, else new ones, installed."""
    if joined is not None:
        joined.hooks.events = events
        return joined.hooks
    if env is None:
        return None
    from ..worker.hooks import WorkerHooks

    hooks = WorkerHooks(env, events=events)
    hooks.install()
    return hooks


def _join_as_spare(env: WorkerEnv) -> Joined:
    from ..elastic.reform import abort_key, connect_store, reform, wait_until_assigned
    from ..worker.hooks import WorkerHooks

    assert env.recovery_store is not None and env.worker_id is not None
    hooks = WorkerHooks(env)
    hooks.install()  # the error file and stack dumps cover the wait too
    if env.promoted is None:  # a spare promoted before its script started said ready then
        hooks.recovery({"event": "ready", "worker": env.worker_id, "role": "spare", "step": 0, "world_size": None,
                        "global_batch": None, "micro_batch": None, "batch_rule": None})
    try:
        host, port = env.recovery_store
        store = connect_store(host, port, env.recovery_timeout_s)
        assignment = wait_until_assigned(store, env.worker_id, env.generation, env.recovery_timeout_s)
        started = time.monotonic()
        group_store: Any = store
        if (assignment.store_host, assignment.store_port) != env.recovery_store:
            group_store = connect_store(assignment.store_host, assignment.store_port, env.recovery_timeout_s)
        from torch.distributed.constants import default_pg_timeout

        # Formed under the recovery's deadline, then torch's default collective timeout, as a group Run makes.
        reform(assignment, timeout_s=env.recovery_timeout_s, store=group_store, collective_timeout=default_pg_timeout,
               aborted=lambda: store.check([abort_key(assignment.generation)]))
    except Exception as err:
        error = f"{type(err).__qualname__}: {err}"[:1000]
        hooks.recovery({"event": "gave_up", "worker": env.worker_id, "generation": env.generation, "error": error})
        raise
    return Joined(hooks=hooks, assignment=assignment, store=store, form_s=time.monotonic() - started)
