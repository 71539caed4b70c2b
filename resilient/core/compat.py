"""The private torch APIs resilient relies on, each probed once, the first time its feature is asked for.

A few features need torch internals that no public API offers (the list is
:data:`FEATURES`).  Each is probed here, by the shape resilient uses: the
attribute exists, is callable, or is a slot of its class.  A probe that
fails turns its feature off with the reason (fail closed), never a silent
``getattr(..., None)`` that leaves, say, a stale process group behind:

- the callers ask :func:`missing` (None: available) and take the path
  that does not need the feature, or decline what cannot work without it;
- the Run reports the features it uses that are off once, at its
  creation, in a ``torch_features_off`` event.

Probes run on first use rather than at import: the sharded features' probes
import FSDP (about 0.9 s here), which a run without a sharded model never
needs.

:func:`probe_all` runs the probes again (tests break an API on purpose and
check that its feature turns off).  Attributes that only instances carry
(a device mesh's group registry) are checked where an instance exists, by
:func:`require_attributes`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .errors import ResilientError

FEATURES: Mapping[str, str] = {
    "ddp_bucket_layout": "a rebuilt DDP wrapper starts in the bucket layout of the one it replaces (a recovered "
                         "run with more than two ranks sums its gradients in the uninterrupted run's order)",
    "group_timeout": "a re-formed process group keeps the script's collective timeout",
    "group_registry": "the process groups a script made itself are found before a recovery relies on them",
    "fsdp_rebind": "in-process recovery of FSDP2 / HSDP state (its meshes moved to the re-formed group)",
    "fsdp_comm_timing": "FSDP2's all-gathers and reduce-scatters timed as communication (a rank waiting for a "
                        "slow peer is told from the straggler)",
    "dtensor_chunks": "sharded (DTensor) checkpoints: each rank's chunk of a tensor",
    "fused_check": "the non-finite gradient check in one fused kernel (without it: one pass per tensor)",
    "late_nonfinite": "the non-finite gradient check without a host sync per step (nonfinite_verdict='late': "
                      "the update skipped on the device, the verdict read a step later)",
}
"""Every feature that rests on a private torch API, and what it does for the user."""


class CompatError(ResilientError):
    """A feature this torch version cannot support (a private API it needs is gone or changed)."""


def _attr(owner: Any, path: str) -> Any:
    obj = owner
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def _callable(owner: Any, label: str, path: str) -> str | None:
    try:
        found = _attr(owner, path)
    except (AttributeError, ImportError) as e:
        return f"{label}.{path} is gone ({e})"
    return None if callable(found) else f"{label}.{path} is no longer callable ({type(found).__qualname__})"


def _ddp_bucket_layout() -> list[str | None]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    reducer = getattr(getattr(torch._C, "_distributed_c10d", None), "Reducer", None)
    return [
        _callable(dist, "torch.distributed", "_compute_bucket_assignment_by_size"),
        _callable(DistributedDataParallel, "DistributedDataParallel", "_build_params_for_reducer"),
        "torch._C._distributed_c10d.Reducer is gone" if reducer is None else
        _callable(reducer, "Reducer", "_get_zeros_like_grad_buckets"),
    ]


def _group_timeout() -> list[str | None]:
    import torch.distributed as dist

    gloo = getattr(dist, "ProcessGroupGloo", None)
    return [
        _callable(dist.ProcessGroup, "ProcessGroup", "_get_backend"),
        _callable(dist.distributed_c10d, "torch.distributed.distributed_c10d", "_set_pg_timeout"),
        "torch.distributed.ProcessGroupGloo is gone" if gloo is None else
        None if isinstance(getattr(gloo, "options", None), property) else "ProcessGroupGloo.options is not a property",
    ]


def _group_registry() -> list[str | None]:
    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    if world is None:
        return ["torch.distributed.distributed_c10d._world is gone"]
    try:
        groups = world.pg_map
    except AttributeError as e:
        return [f"torch.distributed.distributed_c10d._world.pg_map is gone ({e})"]
    return [None if isinstance(groups, Mapping) else f"_world.pg_map is a {type(groups).__qualname__}, not a mapping"]


def _fsdp_rebind() -> list[str | None]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

    return [
        _callable(FSDPModule, "FSDPModule", "_get_fsdp_state"),
        _callable(FSDPModule, "FSDPModule", "reset_iter_state"),
        _callable(DeviceMesh, "DeviceMesh", "_get_root_mesh"),
    ]


def _fsdp_comm_timing() -> list[str | None]:
    from torch.distributed.fsdp import FSDPModule

    return [
        _callable(FSDPModule, "FSDPModule", "set_custom_all_gather"),
        _callable(FSDPModule, "FSDPModule", "set_custom_reduce_scatter"),
        _callable(FSDPModule, "FSDPModule", "_get_fsdp_state"),
    ]


def _dtensor_chunks() -> list[str | None]:
    from torch.distributed.tensor import DTensor

    return [
        _callable(DTensor, "DTensor", "__create_chunk_list__"),
        None if "_local_tensor" in getattr(DTensor, "__slots__", ()) else "DTensor has no _local_tensor slot",
    ]


def _fused_check() -> list[str | None]:
    found_api = _callable(torch, "torch", "_amp_foreach_non_finite_check_and_unscale_")
    if found_api is not None:
        return [found_api]
    try:  # by behaviour: it flags a NaN and leaves the values as they were (multiplied by one)
        values = [torch.tensor([1.5, float("nan")]), torch.tensor([-0.0, 3.0])]
        found = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_(values, found, torch.ones(()))
    except Exception as e:  # noqa: BLE001 - whatever the changed API raises turns the feature off
        return [f"torch._amp_foreach_non_finite_check_and_unscale_ failed ({type(e).__qualname__}: {e})"]
    if found.item() != 1.0 or values[0][0].item() != 1.5 or values[1][1].item() != 3.0:
        return ["torch._amp_foreach_non_finite_check_and_unscale_ no longer flags a NaN and keeps the values"]
    return []


def _late_nonfinite() -> list[str | None]:
    found_api = _callable(torch, "torch", "_amp_foreach_non_finite_check_and_unscale_")
    if found_api is not None:
        return [found_api]
    try:  # by behaviour: a fused step told found_inf=1 must leave its parameter alone
        p = torch.nn.Parameter(torch.ones(1))
        opt = torch.optim.SGD([p], lr=1.0, fused=True)
        p.grad = torch.full((1,), float("nan"))
        found = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_([p.grad], found, torch.ones(()))
        opt.found_inf = found  # type: ignore[attr-defined]
        opt.grad_scale = None  # type: ignore[attr-defined]
        opt.step()
    except Exception as e:  # noqa: BLE001 - whatever the changed API raises turns the feature off
        return [f"a fused optimizer step with found_inf failed ({type(e).__qualname__}: {e})"]
    if found.item() != 1.0 or not torch.equal(p.detach(), torch.ones(1)):
        return ["a fused optimizer step applied an update its found_inf flag said to skip"]
    return []


_PROBES: Mapping[str, Callable[[], list[str | None]]] = {
    "ddp_bucket_layout": _ddp_bucket_layout,
    "group_timeout": _group_timeout,
    "group_registry": _group_registry,
    "fsdp_rebind": _fsdp_rebind,
    "fsdp_comm_timing": _fsdp_comm_timing,
    "dtensor_chunks": _dtensor_chunks,
    "fused_check": _fused_check,
    "late_nonfinite": _late_nonfinite,
}
assert set(_PROBES) == set(FEATURES)


def probe(feature: str) -> str | None:
    """Run ``feature``'s probe now: None when torch has what it needs, else why not (naming the API)."""
    try:
        problems = [p for p in _PROBES[feature]() if p is not None]
    except Exception as e:  # noqa: BLE001 - a probe that cannot even look (an import moved) fails closed
        problems = [f"{type(e).__qualname__}: {e}"]
    if not problems:
        return None
    return f"{FEATURES[feature]} is off under torch {torch.__version__}: {'; '.join(problems)}"


def probe_all() -> dict[str, str | None]:
    """Every feature's probe, run now."""
    return {feature: probe(feature) for feature in FEATURES}


SHARDED = frozenset({"fsdp_rebind", "fsdp_comm_timing", "dtensor_chunks"})
"""The features only a sharded (FSDP2 / DTensor) model uses."""

ON_DEMAND = frozenset({"late_nonfinite"})
"""Features probed only where a Run would use them: their probe runs a fused optimizer step (about half a second
in a fresh process), too much for every Run's start."""

STATUS: dict[str, str | None] = {}
"""Each probed feature: None when available, else the reason it is off (filled on first use)."""


def missing(feature: str) -> str | None:
    """Why ``feature`` is off under this torch (None: available); probed the first time it is asked."""
    if feature not in FEATURES:
        raise KeyError(f"no feature {feature!r} in resilient.core.compat.FEATURES")
    if feature not in STATUS:
        STATUS[feature] = probe(feature)
    return STATUS[feature]


def off(*, sharded: bool = True, on_demand: bool = False) -> dict[str, str]:
    """The features that are off, with their reasons (``sharded=False``: leave out those only sharded models use;
    those probed on demand only with ``on_demand``)."""
    found = {feature: missing(feature) for feature in FEATURES
             if (sharded or feature not in SHARDED) and (on_demand or feature not in ON_DEMAND)}
    return {feature: reason for feature, reason in found.items() if reason is not None}


def require_attributes(obj: Any, names: tuple[str, ...], feature: str) -> None:
    """CompatError naming ``feature`` unless ``obj`` carries every attribute in ``names`` (what it sets must
    exist already: setting a renamed attribute would only add a new one and keep the real one alive)."""
    absent = [name for name in names if not hasattr(obj, name)]
    if absent:
        raise CompatError(f"{FEATURES[feature]} is off under torch {torch.__version__}: "
                          f"{type(obj).__qualname__} has no {', '.join(absent)}")
