"""Moving a sharded model (FSDP2, DTensor, HSDP) onto a re-formed process group without rebuilding it.

A sharded model reaches its process groups through three kinds of objects:

* the :class:`~torch.distributed.device_mesh.DeviceMesh` its DTensors point
  to (parameters, optimizer state, FSDP's sharding specs): each mesh keeps
  the *names* of its dimensions' groups, and the root mesh a registry of the
  group objects;
* FSDP2's mesh infos (one per parameter group and per parameter, and their
  post-forward twins), which hold the shard and replicate group objects
  themselves;
* the root FSDP modules' per-iteration state (in-flight all-gathers and
  reduce-scatters), which a failed step leaves behind.

:func:`survey` finds them once and says where identical copies of each
shard live (the *replica groups*: ranks whose mesh coordinates differ only
on a dimension every DTensor replicates, HSDP's first dimension; none for
pure FSDP).  :func:`release` drops every reference to the old groups, so
that destroying them closes this rank's connections at once (what makes
the other survivors' collectives fail promptly; see
:mod:`resilient.elastic.reform`).  :func:`rebind`, run on every rank of the
new group at the same point, creates the mesh's groups anew, in the order
``init_device_mesh`` creates them (a spare that calls
:func:`resilient.device_mesh` creates the same ones), and points the old
mesh objects and mesh infos at them.  The ranks keep their numbers, so
every coordinate, shard and DTensor spec stays valid.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..core import compat
from ..core.errors import ResilientError

_GROUP_FIELDS = ("shard_process_group", "replicate_process_group")


class ShardRecoveryUnsupported(ResilientError):
    """This sharded model cannot be moved to a new group in process; the message says why (restart instead)."""


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """The meshes and FSDP objects of one sharded model, and where its shards are replicated."""

    root: Any
    """The one root DeviceMesh every DTensor lives on."""
    meshes: tuple[Any, ...]
    """Every mesh object reachable from the model and optimizer (the root, FSDP's slices of it)."""
    infos: tuple[Any, ...]
    """FSDP2 mesh infos holding group objects."""
    modules: tuple[Any, ...]
    """The model's FSDP modules (the roots among them are reset after a failed step)."""
    replica_dim: int | None
    """The mesh dimension every DTensor replicates (HSDP's replicate dimension); None: no replica."""
    replicas: tuple[tuple[int, ...], ...]
    """Ranks holding identical shards, one tuple per shard (a single rank each without a replica)."""

    def peers_of(self, rank: int) -> tuple[int, ...]:
        return next(group for group in self.replicas if rank in group)


def survey(model: torch.nn.Module, optimizer: Any) -> ShardLayout:
    """The layout of ``model``'s sharded state; raises :class:`ShardRecoveryUnsupported` naming what stands in
    the way of moving it to a new group in process."""
    from torch.distributed.tensor import DTensor, Replicate

    unavailable = compat.missing("fsdp_rebind")
    if unavailable:
        raise ShardRecoveryUnsupported(unavailable)
    tensors: list[Any] = [p for p in model.parameters() if isinstance(p, DTensor)]
    tensors += [b for b in model.buffers() if isinstance(b, DTensor)]
    for state in (optimizer.state.values() if optimizer is not None else ()):
        tensors += [v for v in state.values() if isinstance(v, DTensor)]
    if not tensors:
        raise ShardRecoveryUnsupported("the model has no DTensor parameters")
    meshes: dict[int, Any] = {}
    for t in tensors:
        meshes.setdefault(id(t.device_mesh), t.device_mesh)
    modules, infos = _fsdp_objects(model)
    for info in infos:
        for mesh in (info.mesh, getattr(info, "spmd_mesh", None)):
            if mesh is not None:
                meshes.setdefault(id(mesh), mesh)
        if getattr(info, "reduce_scatter_process_group", None) is not None:
            raise ShardRecoveryUnsupported("set_separate_reduce_scatter_group() gave FSDP a group of its own, which "
                                           "in-process recovery does not re-create")
    for module in modules:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                for mesh in (getattr(param, "_spmd_mesh", None), getattr(param, "_shard_mesh", None),
                             getattr(getattr(param, "_sharding_spec", None), "mesh", None)):
                    if mesh is not None:
                        meshes.setdefault(id(mesh), mesh)
            if type(group._all_gather_comm).__name__ != "DefaultAllGather" or \
                    type(group._reduce_scatter_comm).__name__ != "DefaultReduceScatter":
                raise ShardRecoveryUnsupported("FSDP communicates through a custom or process-group allocator, which "
                                               "in-process recovery does not re-create")
    roots: dict[int, Any] = {id(m._get_root_mesh()): m._get_root_mesh() for m in meshes.values()}
    root = tensors[0].device_mesh._get_root_mesh()
    # Equal meshes may be distinct objects (torch caches mesh slices by equality): all are rebound alike.
    if any(other != root for other in roots.values()):
        raise ShardRecoveryUnsupported(f"the model's DTensors live on {len(roots)} unrelated device meshes; "
                                       "in-process recovery moves one mesh (and its slices)")
    for other in roots.values():
        if getattr(other, "_flatten_mapping", None):
            raise ShardRecoveryUnsupported("the device mesh has flattened dimensions, which in-process recovery "
                                           "does not re-create")
    for mesh in meshes.values():
        if len(mesh._dim_group_names) > len(set(mesh._get_root_mesh()._dim_group_names) & set(mesh._dim_group_names)):
            raise ShardRecoveryUnsupported("a mesh holds groups that are not its root mesh's dimensions")
    if any(t.device_mesh is not root for t in tensors):
        raise ShardRecoveryUnsupported("some DTensors live on a slice of the device mesh, not on the mesh itself")
    replicated = [d for d in range(root.ndim) if all(isinstance(t.placements[d], Replicate) for t in tensors)]
    if len(replicated) > 1:
        raise ShardRecoveryUnsupported(f"every DTensor is replicated on mesh dimensions {replicated}; in-process "
                                       "recovery supports one replicate dimension (HSDP)")
    grid = root.mesh
    if replicated:
        dim = replicated[0]
        replicas = tuple(tuple(int(r) for r in row) for row in grid.movedim(dim, -1).reshape(-1, grid.shape[dim]))
    else:
        replicas = tuple((int(r),) for r in grid.reshape(-1))
    meshes.update(roots)
    try:  # what release() and rebind() set must exist, or setting it would leave the real groups alive
        for mesh in meshes.values():
            compat.require_attributes(mesh, ("_pg_registry", "_dim_group_names"), "fsdp_rebind")
        for info in infos:
            compat.require_attributes(info, ("mesh",), "fsdp_rebind")
    except compat.CompatError as e:
        raise ShardRecoveryUnsupported(str(e)) from None
    return ShardLayout(root=root, meshes=tuple(meshes.values()), infos=tuple(infos), modules=tuple(modules),
                       replica_dim=replicated[0] if replicated else None, replicas=tuple(sorted(replicas)))


def _fsdp_objects(model: torch.nn.Module) -> tuple[list[Any], list[Any]]:
    """The model's FSDP modules and every distinct mesh info they hold."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    infos: dict[int, Any] = {}
    for module in modules:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            holders: Iterable[Any] = (group, *group.fsdp_params)
            for holder in holders:
                for name in ("mesh_info", "post_forward_mesh_info"):
                    info = getattr(holder, name, None)
                    if info is not None:
                        infos.setdefault(id(info), info)
    return modules, list(infos.values())


def reset_iteration(layout: ShardLayout) -> None:
    """Put FSDP back to a clean step boundary after a failed step (in-flight collectives, unsharded parameters)."""
    for module in layout.modules:
        if module._get_fsdp_state()._is_root:
            module.reset_iter_state()


def release(layout: ShardLayout) -> None:
    """Drop every reference this model holds to its process groups (before they are destroyed)."""
    for info in layout.infos:
        for name in _GROUP_FIELDS:
            if hasattr(info, name):
                setattr(info, name, None)
    for mesh in layout.meshes:
        mesh._pg_registry = {}


def rebind(layout: ShardLayout) -> None:
    """Create the mesh's groups on the new default group and point the model's meshes and FSDP at them.

    Collective over the new group: every rank calls it at the same point (a spare instead creates its mesh
    with the same shape, which creates the same groups in the same order).
    """
    from torch.distributed.device_mesh import DeviceMesh

    root = layout.root
    fresh = DeviceMesh(root.device_type, root.mesh, mesh_dim_names=root.mesh_dim_names)
    renamed = {id(mesh): dict(zip(mesh._dim_group_names, fresh._dim_group_names))
               for mesh in layout.meshes if mesh._get_root_mesh() is mesh}
    for mesh in layout.meshes:
        names = renamed[id(mesh._get_root_mesh())]
        mesh._dim_group_names = [names[name] for name in mesh._dim_group_names]
    for mesh in layout.meshes:
        if mesh._get_root_mesh() is mesh:
            mesh._pg_registry = dict(fresh._pg_registry)
    for info in layout.infos:
        if hasattr(info, "shard_process_group"):
            info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
        if hasattr(info, "replicate_process_group"):
            info.replicate_process_group = info.mesh.get_group(info.replicate_mesh_dim)


def replica_group(layout: ShardLayout) -> Any:
    """This rank's replica group (the mesh's replicate dimension) once rebound; None without replicas."""
    return None if layout.replica_dim is None else layout.root.get_group(layout.replica_dim)
