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
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint import sharded
from ..checkpoint.cadence import FailureRate
from ..checkpoint.config import CheckpointConfig
from ..checkpoint.coordinator import Coordinator
from ..checkpoint.fence import Fence
from ..checkpoint.manager import CheckpointManager
from ..checkpoint.restore import RANK, REPLICATED, Restored
from ..core import compat
from ..core.errors import CheckpointMismatchError, ConfigError
from ..core.events import EventKind
from ..core.state import capture_rng, load_model_state, load_optimizer_state, restore_rng, unwrap
from . import resume
from .streams import generator_states, set_generator_states

if TYPE_CHECKING:
    from ..checkpoint.manifest import Manifest
    from ..elastic.mesh_rebind import ShardLayout
    from ..worker.env import WorkerEnv
    from .state import RunState


def open_checkpoints(
    state: RunState, config: CheckpointConfig, env: WorkerEnv | None, *, spare: bool, restore: bool = True,
    from_memory: Callable[[Coordinator, Manifest | None], Restored | None] | None = None,
) -> CheckpointManager:
    """The Run's checkpoint manager, with the newest verified commit restored into the Run (if any and
    ``restore``).  ``from_memory``: the node's memory tier's restore (:meth:`.memory.RunMemory.restore`), tried
    first and taken when it holds a step at least as new as the newest durable commit."""
    coordinator = Coordinator.from_environment(config.timeout_s)
    # The agent's generation and launch fence this job's writes (none without an agent).
    fence = Fence(launch=env.launch_id, generation=env.generation) if env is not None else Fence()
    if state.recovery is not None and (spare or env is not None and env.resizable):
        # A spare restores alone; a world the agent may shrink or grow restores at any size.
        config = dataclasses.replace(config, elastic=True)
    # A spare neither claims the location nor sweeps it: the members are saving there.
    manager = CheckpointManager(config, coordinator, state.events, fence=fence, claim=not spare,
                                failure_rate=failure_rate(config, env))
    if not restore:
        return manager
    if from_memory is not None and not spare:  # the node's memory tier first, when it is at least as new
        durable = manager.newest()
        restored = from_memory(coordinator, durable)
        if restored is not None:
            apply_restored(state, restored)
            manager.last_committed = durable
            return manager
    if state.sharded:
        restored = manager.restore(targets=lambda: sharded_targets(state))
    else:  # read in place: into the model's parameters and buffers, and the optimizer's state where it has one
        restored = manager.restore(live=lambda: capture_payloads(state, replicated=True))
    if restored is not None:
        apply_restored(state, restored)
    return manager


def failure_rate(config: CheckpointConfig, env: WorkerEnv | None) -> FailureRate | None:
    """The failure rate the save interval is computed from: the config's, else the agent's (``--mtbf``, where 0
    says the agent computes it from the run's history and has none yet); None: a fixed interval."""
    if config.mtbf_s is not None:
        return FailureRate(config.mtbf_s, "CheckpointConfig.mtbf_s")
    if env is None or env.mtbf_s is None:
        return None
    return FailureRate(env.mtbf_s or None, env.mtbf_source or "the agent")


def capture_payloads(state: RunState, *, replicated: bool | None = None, local_shards: bool = False) -> dict[str, Any]:
    """What one rank saves: its own state (RANK) and, on rank 0 (or where ``replicated`` says), the replicated
    state (REPLICATED).  ``local_shards`` (the memory tier): sharded state as every local tensor of this rank with
    its layout (:func:`~resilient.checkpoint.sharded.split_local`), not the durable checkpoint's chunks and
    table."""
    with_replicated = state.rank == 0 if replicated is None else replicated
    payloads: dict[str, Any] = {
        RANK: {
            "rng": capture_rng(),
            "generators": generator_states(state.generators),
            resume.PREFETCH: resume.saved_prefetch(state),
            "data": state.data.state_dict() if state.data is not None else None,
            "user": {name: obj.state_dict() for name, obj in state.user_state.items()},
            "counters": {"step": state.step, "samples": state.samples, "tokens": state.tokens},
        }
    }
    if state.sharded and local_shards:
        rest, payloads[RANK][sharded.SHARDS], payloads[RANK][sharded.LAYOUT] = sharded.split_local(sharded_state(state))
        model_state, optimizer_state = rest["model"], rest["optimizer"]
    elif state.sharded:
        parts = sharded.split(sharded_state(state), state.rank)
        payloads[RANK][sharded.SHARDS] = parts.local
        payloads[sharded.INDEX] = parts.table
        model_state, optimizer_state = parts.replicated["model"], parts.replicated["optimizer"]
    elif with_replicated:
        model_state = unwrap(state.model).state_dict()
        optimizer_state = state.optimizer.state_dict() if state.optimizer is not None else None
    if with_replicated:
        payloads[REPLICATED] = {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
            "scaler": state.scaler.state_dict() if state.scaler is not None else None,
            "step": state.step,
        }
    return payloads


def sharded_state(state: RunState) -> dict[str, Any]:
    """The model's and optimizer's state dicts with DTensors, keyed by parameter name (``get_state_dict``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if state.optimizer is None:
        return {"model": get_model_state_dict(state.model), "optimizer": None}
    model_state, optimizer_state = get_state_dict(state.model, state.optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def sharded_targets(state: RunState) -> dict[str, Any]:
    """The live DTensors a sharded checkpoint is resharded onto."""
    return sharded.targets_of(sharded_state(state))


def _load_sharded(state: RunState, restored: Restored) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    assert restored.sharded is not None
    rep, name = restored.replicated, restored.manifest.name
    tree = sharded.rebuild({"model": rep["model"], "optimizer": rep["optimizer"]}, restored.sharded)
    try:
        if state.optimizer is None:
            set_model_state_dict(state.model, tree["model"])
        else:
            set_state_dict(state.model, state.optimizer, model_state_dict=tree["model"],
                           optim_state_dict=tree["optimizer"])
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointMismatchError(
            f"checkpoint {name} does not fit this sharded model and optimizer ({e}); restore it with the model "
            "configuration and optimizer it was trained with") from None


def apply_restored(state: RunState, restored: Restored) -> None:
    """Put a verified checkpoint back into the Run's components, refusing one that does not fit them; nothing
    is due to be saved at the restored step."""
    name = restored.manifest.name
    rep, mine = restored.replicated, restored.rank_state
    if state.sharded and restored.sharded is None:
        raise CheckpointMismatchError(
            f"checkpoint {name} holds unsharded (DDP or single-process) model state but this Run's model is "
            "sharded (FSDP2/DTensor); restore it into the unsharded model it was saved from, or point "
            "CheckpointConfig.dir at a fresh location")
    if not state.sharded:
        load_model_state(state.model, rep["model"], name)
    for label, obj, value in (
        ("optimizer", state.optimizer, rep["optimizer"]),
        ("scheduler", state.scheduler, rep["scheduler"]),
        ("scaler", state.scaler, rep["scaler"]),
    ):
        if (obj is None) != (value is None):
            raise ConfigError(
                f"checkpoint {name} {'has' if value is not None else 'lacks'} {label} state but this Run "
                f"{'lacks' if obj is None else 'has'} a {label}; create the Run with the same components"
            )
    if state.sharded:
        _load_sharded(state, restored)
    elif state.optimizer is not None:
        load_optimizer_state(state.optimizer, rep["optimizer"], name)
    if state.scheduler is not None:
        state.scheduler.load_state_dict(rep["scheduler"])
    if state.scaler is not None:
        state.scaler.load_state_dict(rep["scaler"])
    missing = set(state.user_state) - set(mine["user"])
    if missing:
        raise ConfigError(f"checkpoint {name} has no state for {sorted(missing)}; it was saved without them")
    for key, obj in state.user_state.items():
        obj.load_state_dict(mine["user"][key])
    if state.data is not None:
        if mine["data"] is None:
            raise ConfigError(f"checkpoint {name} has no data cursor; it was saved without data=ElasticLoader")
        state.data.load_state_dict(mine["data"])
    counters = mine["counters"]
    state.step, state.samples, state.tokens = counters["step"], counters["samples"], counters["tokens"]
    if state.generators:
        set_generator_states(state.generators, mine.get("generators") or {}, f"checkpoint {name}")
    restore_rng(mine["rng"])  # last: loading above must not consume random numbers after it
    if restored.manifest.world_size == state.world_size:  # this rank's own streams: checked at the first step
        resume.restore(state, state.step, name, mine)
    saved_config = restored.manifest.fingerprint.get("config")
    if saved_config != state.fingerprint["config"]:
        changed = config_changes(restored.manifest.fingerprint.get("config_values"), state.fingerprint["config_values"])
        state.events.emit(EventKind.CONFIG_CHANGED, checkpoint=name, saved=saved_config,
                          now=state.fingerprint["config"], changed=changed)
        if state.hooks is not None:  # said on the agent's console and in resilient status
            state.hooks.notice({"kind": EventKind.CONFIG_CHANGED.value, "checkpoint": name, "step": state.step,
                                "changed": changed})
    state.restored_from = name
    state.last_saved_step = state.step


def config_values(config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The config as JSON values (what is not JSON as its ``repr``), kept in every manifest."""
    return None if config is None else json.loads(json.dumps(config, sort_keys=True, default=repr))


def config_changes(saved: Mapping[str, Any] | None, now: Mapping[str, Any] | None) -> dict[str, list[Any]] | None:
    """The keys whose values differ, ``{key: [saved, now]}`` (an absent key is None); None when the saved
    checkpoint kept no values (written before they were kept) or either side has no config."""
    if saved is None or now is None:
        return None
    return {k: [saved.get(k), now.get(k)] for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)}


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


def shard_layout(state: RunState, env: WorkerEnv | None, *, spare: bool) -> ShardLayout | None:
    """A sharded model's layout for in-process recovery under an agent that offers it; None otherwise.

    A layout in-process recovery cannot move leaves the run to restarts, and says why in the event log; a
    spare with such a model could never take over, so it is refused.
    """
    if not state.sharded or env is None or env.recovery_store is None:
        return None
    from ..elastic.mesh_rebind import ShardRecoveryUnsupported, survey

    try:
        return survey(state.model, state.optimizer)
    except ShardRecoveryUnsupported as e:
        if spare:
            raise ConfigError(f"this spare cannot take over a rank of this sharded model: {e}; run without "
                              "spares") from None
        state.events.emit(EventKind.AGENT_HOOK_MISSING,
                          note=f"no in-process recovery for this sharded model ({e}): recovery is by restart")
        return None
