"""What a :class:`~resilient.run.Run` checkpoints, and how a restored checkpoint is put back.

Rank 0 saves the replicated state (model, optimizer, scheduler, scaler);
every rank saves its own (RNG, data cursor, user state, counters).  A
sharded model (FSDP2, DTensor) saves its model and optimizer state through
``get_state_dict``: each rank writes its chunks, rank 0 the rest
(:mod:`resilient.checkpoint.sharded`); restoring reshards them onto the
live model and puts them back with ``set_state_dict``.  Putting
it back refuses a checkpoint whose components do not match the Run's, with
a message naming the fix, and restores the RNG last so that nothing loaded
before it consumes random numbers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from . import compat
from .checkpoint import sharded
from .checkpoint.cadence import FailureRate
from .checkpoint.config import CheckpointConfig
from .checkpoint.coordinator import Coordinator
from .checkpoint.fence import Fence
from .checkpoint.manager import CheckpointManager
from .checkpoint.restore import RANK, REPLICATED, Restored
from .errors import CheckpointMismatchError, ConfigError
from .events import EventKind
from .state import capture_rng, load_model_state, load_optimizer_state, restore_rng, unwrap

if TYPE_CHECKING:
    from .checkpoint.manager import SaveResult
    from .elastic.mesh_rebind import ShardLayout
    from .run import Run
    from .worker.env import WorkerEnv
    from .worker.hooks import WorkerHooks


def open_checkpoints(run: Run, config: CheckpointConfig, env: WorkerEnv | None, *, spare: bool,
                     restore: bool = True) -> CheckpointManager:
    """The Run's checkpoint manager, with the newest verified commit restored into the Run (if any and
    ``restore``)."""
    coordinator = Coordinator.from_environment(config.timeout_s)
    # The agent's generation and launch fence this job's writes (none without an agent).
    fence = Fence(launch=env.launch_id, generation=env.generation) if env is not None else Fence()
    if run._recovery is not None and (spare or env is not None and env.resizable):
        # A spare restores alone; a world the agent may shrink or grow restores at any size.
        config = dataclasses.replace(config, elastic=True)
    # A spare neither claims the location nor sweeps it: the members are saving there.
    manager = CheckpointManager(config, coordinator, run.events, fence=fence, claim=not spare,
                                failure_rate=failure_rate(config, env))
    if not restore:
        return manager
    if run._memory is not None and not spare:  # the node's memory tier first, when it is at least as new
        durable = manager.newest()
        restored = run._memory.restore(coordinator, durable)
        if restored is not None:
            run._apply(restored)
            manager.last_committed = durable
            return manager
    if run._sharded:
        restored = manager.restore(targets=lambda: sharded_targets(run))
    else:  # read in place: into the model's parameters and buffers, and the optimizer's state where it has one
        restored = manager.restore(live=lambda: capture_payloads(run, replicated=True))
    if restored is not None:
        run._apply(restored)
    return manager


def failure_rate(config: CheckpointConfig, env: WorkerEnv | None) -> FailureRate | None:
    """The failure rate the save interval is computed from: the config's, else the agent's (``--mtbf``, where 0
    says the agent computes it from the run's history and has none yet); None: a fixed interval."""
    if config.mtbf_s is not None:
        return FailureRate(config.mtbf_s, "CheckpointConfig.mtbf_s")
    if env is None or env.mtbf_s is None:
        return None
    return FailureRate(env.mtbf_s or None, env.mtbf_source or "the agent")


def capture_payloads(run: Run, *, replicated: bool | None = None, local_shards: bool = False) -> dict[str, Any]:
    """What one rank saves: its own state (RANK) and, on rank 0 (or where ``replicated`` says), the replicated
    state (REPLICATED).  ``local_shards`` (the memory tier): sharded state as every local tensor of this rank with
    its layout (:func:`~resilient.checkpoint.sharded.split_local`), not the durable checkpoint's chunks and
    table."""
    with_replicated = run.rank == 0 if replicated is None else replicated
    payloads: dict[str, Any] = {
        RANK: {
            "rng": capture_rng(),
            "data": run.data.state_dict() if run.data is not None else None,
            "user": {name: obj.state_dict() for name, obj in run.user_state.items()},
            "counters": {"step": run.step, "samples": run.samples, "tokens": run.tokens},
        }
    }
    if run._sharded and local_shards:
        rest, payloads[RANK][sharded.SHARDS], payloads[RANK][sharded.LAYOUT] = sharded.split_local(sharded_state(run))
        model_state, optimizer_state = rest["model"], rest["optimizer"]
    elif run._sharded:
        parts = sharded.split(sharded_state(run), run.rank)
        payloads[RANK][sharded.SHARDS] = parts.local
        payloads[sharded.INDEX] = parts.table
        model_state, optimizer_state = parts.replicated["model"], parts.replicated["optimizer"]
    elif with_replicated:
        model_state = unwrap(run.model).state_dict()
        optimizer_state = run.optimizer.state_dict() if run.optimizer is not None else None
    if with_replicated:
        payloads[REPLICATED] = {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": run.scheduler.state_dict() if run.scheduler is not None else None,
            "scaler": run.scaler.state_dict() if run.scaler is not None else None,
            "step": run.step,
        }
    return payloads


def sharded_state(run: Run) -> dict[str, Any]:
    """The model's and optimizer's state dicts with DTensors, keyed by parameter name (``get_state_dict``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if run.optimizer is None:
        return {"model": get_model_state_dict(run.model), "optimizer": None}
    model_state, optimizer_state = get_state_dict(run.model, run.optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def sharded_targets(run: Run) -> dict[str, Any]:
    """The live DTensors a sharded checkpoint is resharded onto."""
    return sharded.targets_of(sharded_state(run))


def _load_sharded(run: Run, restored: Restored) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    assert restored.sharded is not None
    rep, name = restored.replicated, restored.manifest.name
    tree = sharded.rebuild({"model": rep["model"], "optimizer": rep["optimizer"]}, restored.sharded)
    try:
        if run.optimizer is None:
            set_model_state_dict(run.model, tree["model"])
        else:
            set_state_dict(run.model, run.optimizer, model_state_dict=tree["model"],
                           optim_state_dict=tree["optimizer"])
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointMismatchError(
            f"checkpoint {name} does not fit this sharded model and optimizer ({e}); restore it with the model "
            "configuration and optimizer it was trained with") from None


def apply_restored(run: Run, restored: Restored) -> None:
    """Put a verified checkpoint back into the Run's components, refusing one that does not fit them."""
    name = restored.manifest.name
    rep, mine = restored.replicated, restored.rank_state
    if run._sharded and restored.sharded is None:
        raise CheckpointMismatchError(
            f"checkpoint {name} holds unsharded (DDP or single-process) model state but this Run's model is "
            "sharded (FSDP2/DTensor); restore it into the unsharded model it was saved from, or point "
            "CheckpointConfig.dir at a fresh location")
    if not run._sharded:
        load_model_state(run.model, rep["model"], name)
    for label, obj, value in (
        ("optimizer", run.optimizer, rep["optimizer"]),
        ("scheduler", run.scheduler, rep["scheduler"]),
        ("scaler", run.scaler, rep["scaler"]),
    ):
        if (obj is None) != (value is None):
            raise ConfigError(
                f"checkpoint {name} {'has' if value is not None else 'lacks'} {label} state but this Run "
                f"{'lacks' if obj is None else 'has'} a {label}; create the Run with the same components"
            )
    if run._sharded:
        _load_sharded(run, restored)
    elif run.optimizer is not None:
        load_optimizer_state(run.optimizer, rep["optimizer"], name)
    if run.scheduler is not None:
        run.scheduler.load_state_dict(rep["scheduler"])
    if run.scaler is not None:
        run.scaler.load_state_dict(rep["scaler"])
    missing = set(run.user_state) - set(mine["user"])
    if missing:
        raise ConfigError(f"checkpoint {name} has no state for {sorted(missing)}; it was saved without them")
    for key, obj in run.user_state.items():
        obj.load_state_dict(mine["user"][key])
    if run.data is not None:
        if mine["data"] is None:
            raise ConfigError(f"checkpoint {name} has no data cursor; it was saved without data=ElasticLoader")
        run.data.load_state_dict(mine["data"])
    counters = mine["counters"]
    run.step, run.samples, run.tokens = counters["step"], counters["samples"], counters["tokens"]
    restore_rng(mine["rng"])  # last: loading above must not consume random numbers after it
    saved_config = restored.manifest.fingerprint.get("config")
    if saved_config != run._fingerprint["config"]:
        run.events.emit(EventKind.CONFIG_CHANGED, checkpoint=name, saved=saved_config,
                         now=run._fingerprint["config"])
    run.restored_from = name


def digest_config(config: Mapping[str, Any] | None) -> str | None:
    """The config's fingerprint in every manifest (a resume under another config is an event)."""
    if config is None:
        return None
    text = json.dumps(config, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def check_sharding(model: torch.nn.Module, ddp: object, *, spare: bool) -> bool:
    """Whether ``model`` is sharded (DTensor parameters); refuses what cannot be saved, wrapped or spared.

    ``spare``: a spare that was not promoted in ``resilient.device_mesh()`` (it sharded its model before it
    had a group, so the model cannot be in the group the spare joins).
    """
    is_sharded = sharded.is_sharded(model)
    unavailable = compat.missing("dtensor_chunks") if is_sharded else None
    if unavailable:
        raise compat.CompatError(f"this model is sharded (FSDP2/DTensor), but {unavailable}; use a torch version "
                                 "the project tests (see pyproject.toml) or an unsharded model")
    if is_sharded and spare:
        raise ConfigError("this worker was started as a spare and its model is sharded (FSDP2/DTensor), but its "
                          "device mesh was not made with resilient.device_mesh(): a spare has no process group "
                          "until it is promoted, and that call waits for it. Create the mesh with "
                          "resilient.device_mesh(...) (the arguments of init_device_mesh), or run without spares")
    if is_sharded and ddp:
        raise ConfigError("Run(ddp=...) wraps the model in DistributedDataParallel, but its parameters are sharded "
                          "(FSDP2/DTensor); drop ddp=, the sharded model already synchronises its gradients")
    if not is_sharded:
        for name, p in model.named_parameters():
            if type(p.data) is not torch.Tensor:  # a plain Parameter's data is a plain Tensor
                raise ConfigError(
                    f"parameter {name!r} is a {type(p.data).__qualname__}; resilient checkpoints hold plain "
                    "tensors and DTensors (FSDP2, tensor parallel). Convert it, or shard the model with "
                    "torch.distributed.fsdp.fully_shard")
    return is_sharded


def shard_layout(run: Run, model: torch.nn.Module, optimizer: Any, env: WorkerEnv | None, *,
                 spare: bool) -> ShardLayout | None:
    """A sharded model's layout for in-process recovery under an agent that offers it; None otherwise.

    A layout in-process recovery cannot move leaves the run to restarts, and says why in the event log; a
    spare with such a model could never take over, so it is refused.
    """
    if not run._sharded or env is None or env.recovery_store is None:
        return None
    from .elastic.mesh_rebind import ShardRecoveryUnsupported, survey

    try:
        return survey(model, optimizer)
    except ShardRecoveryUnsupported as e:
        if spare:
            raise ConfigError(f"this spare cannot take over a rank of this sharded model: {e}; run without "
                              "spares") from None
        run.events.emit(EventKind.AGENT_HOOK_MISSING,
                        note=f"no in-process recovery for this sharded model ({e}): recovery is by restart")
        return None


def new_save_report(checkpoints: CheckpointManager | None,
                    reported: SaveResult | None) -> tuple[dict[str, Any] | None, SaveResult | None]:
    """The newest finished save if not ``reported`` yet (what the agent exports as checkpoint duration and
    bytes), and the save reported now."""
    results = checkpoints.results if checkpoints is not None else None
    if not results or results[-1] is reported:
        return None, reported
    result = results[-1]
    size = result.manifest.total_bytes if result.manifest is not None else 0
    return {"step": result.step, "duration_s": round(result.stall_s + result.write_s, 6), "ok": result.ok,
            "bytes": size, "deferred_from": result.deferred_from, "deferred_slots": result.deferred_slots}, result


def stop_at_boundary(run: Run, hooks: WorkerHooks) -> None:
    """Stop ``run`` at this boundary if the agent asked for it and its ``step`` reached the stop step.

    The agent picks a stop step ahead of every rank so that all ranks
    commit the same step together.  A rank that is already past it stops
    at its current boundary instead; if its peers stop at another step,
    their commits do not match and the commit fails (or waits for its
    timeout), so the agent must choose the stop step with room to spare.
    """
    request = hooks.take_stop_request()
    if request is None or run.step < request.stop_at_step:
        return
    result = run.save() if run.checkpoints is not None else None
    committed = result.name if result is not None and result.ok else None
    run.events.emit(EventKind.GRACEFUL_STOP, step=run.step, stop_at_step=request.stop_at_step,
                    reason=request.reason, committed=committed, error=result.error if result is not None else None)
    hooks.bye(run.step, run._committed_step())
    raise SystemExit(0)
