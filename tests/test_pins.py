"""A pinned checkpoint outlives retention until its holder lets go, on a directory and on S3 (a real server).

An incident's bundle pins the checkpoint a replay starts from (``resilient incident bundle``); a run that goes on
saving into the same location with ``keep=1`` deletes every older commit but that one, and deletes it too once
the pin is released.
"""

from __future__ import annotations

import pytest

from resilient.checkpoint.locations import open_storage
from resilient.checkpoint.retention import decide_retention
from resilient.core.errors import StorageError

from .tiny import tiny_run, train

HOLDER = "g0001-n1-exit"


def committed(storage) -> list[str]:
    return storage.list_committed()


def test_retention_keeps_a_pinned_checkpoint_until_it_is_released(store) -> None:
    run = tiny_run(store.url, store.endpoint, every=3, keep=1)
    train(run, 3)  # step 3 committed (the save on finish)
    run.close()
    storage = open_storage(store.url, endpoint_url=store.endpoint)
    assert committed(storage) == ["step_0000000003"]
    storage.pin("step_0000000003", HOLDER, b'{"incident": "g0001-n1-exit"}')
    storage.pin("step_0000000003", "another", b"{}")
    assert storage.list_pins() == {"step_0000000003": ["another", HOLDER]}

    run = tiny_run(store.url, store.endpoint, every=3, keep=1)
    assert run.restored_from == "step_0000000003"
    train(run, 12)
    run.close()
    assert committed(storage) == ["step_0000000003", "step_0000000012"], "keep=1 deleted the pinned commit"

    assert storage.unpin("step_0000000003", HOLDER) and not storage.unpin("step_0000000003", HOLDER)
    assert storage.unpin("step_0000000003", "another")
    assert storage.list_pins() == {}
    run = tiny_run(store.url, store.endpoint, every=3, keep=1)
    train(run, 15)
    run.close()
    assert committed(storage) == ["step_0000000015"], "released, it goes with the next retention"


def test_the_retention_policy_keeps_the_pinned_and_says_so() -> None:
    names = [f"step_{s:010d}" for s in (10, 20, 30, 40)]
    d = decide_retention(names, keep=1, permanent_every=None, newest_verified=None,
                         pinned=["step_0000000020", "step_0000000099"])
    assert d.keep == ("step_0000000020", "step_0000000040") and d.delete == ("step_0000000010", "step_0000000030")
    assert d.reason.endswith("pinned step_0000000020; deleting 2"), d.reason


def test_a_pin_written_after_retention_read_the_pins_still_keeps_the_checkpoint(store) -> None:
    """Retention decided from the pins it read; an incident's bundle pins one of its victims just after.  The
    deletion reads the pins again (on a directory under the lock a pin is written under) and keeps it; a pin of a
    checkpoint retention already deleted is refused, and leaves nothing behind."""
    run = tiny_run(store.url, store.endpoint, every=3, keep=3)
    train(run, 6)
    run.close()
    storage = open_storage(store.url, endpoint_url=store.endpoint)
    assert committed(storage) == ["step_0000000003", "step_0000000006"]
    decision = decide_retention(committed(storage), keep=1, permanent_every=None, newest_verified=None,
                                pinned=storage.list_pins())
    assert decision.delete == ("step_0000000003",)
    storage.pin("step_0000000003", HOLDER, b"{}")  # between the retention's read of the pins and its deletion
    assert storage.delete("step_0000000003", keep_pinned=True) is False
    assert committed(storage) == ["step_0000000003", "step_0000000006"]
    assert storage.unpin("step_0000000003", HOLDER)
    assert storage.delete("step_0000000003", keep_pinned=True) is True
    with pytest.raises(StorageError, match="cannot pin step_0000000003: it is not committed"):
        storage.pin("step_0000000003", HOLDER, b"{}")
    assert storage.list_pins() == {}
