"""Bad input and hostile storage: clear errors, and the last commit is never lost."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

import resilient
from resilient.core.errors import SerializationError

from .tiny import params, same, tiny_run, train


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1 MiB filesystem (tmpfs), to run out of space for real."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path):
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def test_full_disk_fails_the_save_keeps_training_and_the_last_commit(tiny_disk):
    events = resilient.EventLog()
    run = tiny_run(tiny_disk / "ckpt", events=events)
    train(run, 3)
    run.close()
    after_3 = params(run)
    fill(tiny_disk / "filler")
    train(run, 6)  # the save at step 6 cannot be written
    result = run.close()
    assert run.step == 6, "a failed background save must not stop training"
    assert result is not None and not result.ok
    (failed,) = events.of_kind("checkpoint_failed")
    assert "No space left" in failed.fields["error"] and "free space" in failed.fields["error"]
    assert run.checkpoints.last_committed.name == "step_0000000003", "latest advanced past a failed save"
    os.remove(tiny_disk / "filler")
    again = tiny_run(tiny_disk / "ckpt")
    assert again.restored_from == "step_0000000003" and same(params(again), after_3)
    assert not os.listdir(tiny_disk / "ckpt" / ".staging"), "the failed save left staging files behind"


def test_unwritable_location_fails_at_start_naming_the_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(resilient.StorageError, match=f"{blocker}.*choose another|{blocker}"):
        tiny_run(blocker / "ckpt")


def test_missing_s3_bucket_fails_at_start(moto_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with pytest.raises(resilient.StorageError, match="bucket no-such-bucket does not exist"):
        tiny_run("s3://no-such-bucket/ckpt", moto_server)


def test_state_that_needs_pickle_is_refused_with_its_path(tmp_path):
    class Hooky:
        def state_dict(self):
            return {"callback": print}

        def load_state_dict(self, state):
            pass

    model = torch.nn.Linear(2, 2)
    run = resilient.Run(model=model, state={"hooky": Hooky()},
                        checkpoint=resilient.CheckpointConfig(dir=tmp_path / "c", every_steps=None))
    with pytest.raises(SerializationError, match=r"rank\.user\.hooky\.callback"):
        run.save()
    assert run.checkpoints.storage.list_committed() == []


def test_objects_without_state_dict_are_refused(tmp_path):
    with pytest.raises(resilient.ConfigError, match=r"state\['thing'\]"):
        resilient.Run(model=torch.nn.Linear(2, 2), state={"thing": object()})


def test_a_zero_redundancy_optimizer_is_refused_naming_what_to_use_instead():
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(2, 2)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        with pytest.raises(resilient.ConfigError, match=r"ZeroRedundancyOptimizer\(\.\.\.\)\) is not supported: its "
                                                        r"state is sharded over the ranks.*FSDP2 \(fully_shard\)"):
            resilient.Run(model=model, optimizer=optimizer, agent=None)
    finally:
        dist.destroy_process_group()


def test_save_returns_once_committed_and_a_new_process_loses_nothing(tmp_path):
    run = tiny_run(tmp_path / "c", every=None)
    train(run, 4)
    result = run.save()
    assert result.ok and result.manifest.step == 4
    assert run.checkpoints.storage.list_committed() == ["step_0000000004"]
    assert run.save() is result, "saving the same step twice must not write twice"
