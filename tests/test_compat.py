"""The private torch APIs resilient relies on: every probe fails when its API is broken on purpose, and every
feature that needs one fails closed (turned off with the reason, never a silent ``None``)."""

from __future__ import annotations

import random
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from resilient.core import compat
from resilient.elastic import groups
from resilient.core.errors import ConfigError

BREAKS = {
    # feature -> (owner, attribute) whose loss turns it off, with the words its reason must have
    "ddp_bucket_layout": [(dist, "_compute_bucket_assignment_by_size"),
                          (DistributedDataParallel, "_build_params_for_reducer"),
                          (torch._C._distributed_c10d.Reducer, "_get_zeros_like_grad_buckets")],
    "group_timeout": [(dist.ProcessGroup, "_get_backend"), (dist.distributed_c10d, "_set_pg_timeout"),
                      (dist.ProcessGroupGloo, "options")],
    "group_registry": [(dist.distributed_c10d, "_world")],
    "fsdp_rebind": [(FSDPModule, "_get_fsdp_state"), (FSDPModule, "reset_iter_state"),
                    (DeviceMesh, "_get_root_mesh")],
    "fsdp_comm_timing": [(FSDPModule, "set_custom_all_gather"), (FSDPModule, "set_custom_reduce_scatter")],
    "dtensor_chunks": [(DTensor, "__create_chunk_list__")],
    "fused_check": [(torch, "_amp_foreach_non_finite_check_and_unscale_")],
    "late_nonfinite": [(torch, "_amp_foreach_non_finite_check_and_unscale_")],
}


def test_every_feature_is_available_under_the_torch_the_project_tests() -> None:
    assert set(BREAKS) == set(compat.FEATURES)
    assert compat.probe_all() == {feature: None for feature in compat.FEATURES}
    assert compat.off() == {}


@pytest.mark.parametrize("feature,owner,name", [(f, o, n) for f, pairs in BREAKS.items() for o, n in pairs])
def test_a_probe_fails_when_its_api_is_gone_and_names_it(monkeypatch, feature, owner, name) -> None:
    # Gone wherever it is defined: a class's bases may define it too (torch 2.14's Backend has ``options``).
    for holder in (owner.__mro__ if isinstance(owner, type) else (owner,)):
        if name in vars(holder):
            monkeypatch.delattr(holder, name)
    reason = compat.probe(feature)
    assert reason is not None and reason.startswith(compat.FEATURES[feature])
    assert f"is off under torch {torch.__version__}" in reason and name in reason
    others = {f: r for f, r in compat.probe_all().items() if f != feature}
    assert all(r is None or name in r for r in others.values()), others  # only what needs that API turns off


def test_a_probe_fails_when_an_api_changed_shape(monkeypatch) -> None:
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", 3)
    assert "torch._amp_foreach_non_finite_check_and_unscale_ is no longer callable (int)" in compat.probe("fused_check")
    monkeypatch.setattr(DTensor, "__slots__", ("_spec",))
    assert "DTensor has no _local_tensor slot" in compat.probe("dtensor_chunks")


def test_without_the_ddp_layout_api_a_rebuilt_wrapper_takes_ddps_own_layout(monkeypatch) -> None:
    from resilient.run.ddp import ddp_layout

    monkeypatch.setitem(compat.STATUS, "ddp_bucket_layout", "off for the test")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(torch.nn.Linear(2, 2))
        assert ddp_layout(wrapped) is None
        monkeypatch.setitem(compat.STATUS, "ddp_bucket_layout", None)
        assert ddp_layout(wrapped) == [[0, 1]]  # weight and bias in one bucket
        del wrapped
    finally:
        dist.destroy_process_group()


def test_without_the_group_apis_in_process_recovery_is_declined_with_the_reason(monkeypatch) -> None:
    model = torch.nn.Linear(2, 2)
    assert groups.restart_only(model) is None
    for feature in ("group_timeout", "group_registry"):
        monkeypatch.setitem(compat.STATUS, feature, f"{feature} is off for the test")
        assert groups.restart_only(model) == (f"{feature} is off for the test; without it in-process recovery is "
                                              "declined (recovery is by restart)")
        monkeypatch.setitem(compat.STATUS, feature, None)


def test_a_model_off_the_cpu_recovers_by_restart_and_says_why() -> None:
    reason = groups.restart_only(torch.nn.Linear(2, 2, device="meta"))
    assert reason is not None and reason.startswith("this run's model is on meta: in-process recovery re-forms "
                                                    "gloo groups and sends CPU state")
    assert "recovery for this run is by restart" in reason


def test_without_the_sharding_apis_fsdp_recovery_and_sharded_checkpoints_fail_closed(monkeypatch) -> None:
    from resilient.elastic.mesh_rebind import ShardRecoveryUnsupported, survey
    from resilient.run.payloads import check_sharding

    monkeypatch.setitem(compat.STATUS, "fsdp_rebind", "fsdp_rebind is off for the test")
    with pytest.raises(ShardRecoveryUnsupported, match="fsdp_rebind is off for the test"):
        survey(torch.nn.Linear(2, 2), None)
    monkeypatch.setitem(compat.STATUS, "dtensor_chunks", "dtensor_chunks is off for the test")
    monkeypatch.setattr("resilient.checkpoint.sharded.is_sharded", lambda model: True)
    with pytest.raises(compat.CompatError, match="this model is sharded .*dtensor_chunks is off for the test"):
        check_sharding(torch.nn.Linear(2, 2), False, spare=False)


def test_without_the_fused_check_the_nonfinite_check_still_finds_a_nan(monkeypatch) -> None:
    from resilient import Run
    from resilient.core.errors import NonFiniteGradientsError

    monkeypatch.setitem(compat.STATUS, "fused_check", "fused_check is off for the test")
    monkeypatch.delattr(torch, "_amp_foreach_non_finite_check_and_unscale_")  # the fallback must not touch it
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = Run(model=model, optimizer=optimizer, agent=None, nonfinite="raise")
    model(torch.tensor([[float("nan"), 1.0]])).sum().backward()
    with pytest.raises(NonFiniteGradientsError):
        optimizer.step()
    run.close()


def test_features_that_are_off_are_reported_once_when_a_run_starts(monkeypatch) -> None:
    from resilient import Run

    monkeypatch.setitem(compat.STATUS, "fused_check", "fused_check is off for the test")
    run = Run(model=torch.nn.Linear(2, 1), agent=None)
    [event] = run.events.of_kind("torch_features_off")
    assert event.fields["features"] == {"fused_check": "fused_check is off for the test"}
    run.close()


def test_a_state_object_that_cannot_be_copied_is_refused_at_run_naming_it() -> None:
    from resilient import Run

    class Locked:
        def __init__(self) -> None:
            self.lock = threading.Lock()

        def state_dict(self) -> dict:
            return {"lock": self.lock}

        def load_state_dict(self, state: dict) -> None:
            self.lock = state["lock"]

    with pytest.raises(ConfigError, match=r"Run\(state=\{'sampler': \.\.\.\}\): its state_dict\(\) cannot be copied "
                                          r"\(TypeError: cannot pickle '_thread.lock' object\)"):
        Run(model=torch.nn.Linear(2, 1), agent=None, state={"sampler": Locked()})


def test_reseed_draws_python_and_numpy_numbers_from_the_seed_step_and_rank_not_from_history() -> None:
    from resilient import Run

    def draws(noise: int) -> list[float]:
        random.seed(noise)  # whatever the process drew before
        run = Run(model=torch.nn.Linear(2, 1), agent=None, seed=5, reseed=True)
        found = []
        for _ in run.steps(3):
            with run.attempt():
                found.append(random.random())
        run.close()
        return found

    first = draws(1)
    assert first == draws(2) and len(set(first)) == 3
