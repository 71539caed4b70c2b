"""The memory tier's own protocol, in process: slots, manifests, digests, room, the agreement across ranks.

Real files in a real tmpfs (/dev/shm where there is one); the ranks of a job
are several :class:`MemoryTier` objects on one directory, as the ranks of a
node are.  What a crash leaves behind is made by stopping a save where a
killed process would have stopped (its manifest never published), never by
pretending files exist.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.checkpoint import memory as mem
from resilient.checkpoint.coordinator import Coordinator
from resilient.checkpoint.restore import agree
from resilient.core.errors import CheckpointCorruptError
from resilient.core.events import EventLog
from resilient.run.memory import decide_interval

SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None


@pytest.fixture
def root(tmp_path):
    with tempfile.TemporaryDirectory(dir=SHM, prefix="resilient-memory-test-") as d:
        yield Path(d)


def payloads(step: int, rank: int = 0) -> dict:
    g = torch.Generator().manual_seed(step * 10 + rank)
    return {
        "rank": {"rng": torch.randint(0, 255, (64,), dtype=torch.uint8, generator=g), "cursor": step * 4,
                 "flags": torch.tensor([step % 2 == 0, True]), "half": torch.randn(3, 5, generator=g).bfloat16()},
        "replicated": {"model": {"w": torch.randn(17, 9, generator=g, dtype=torch.float64)}, "step": step,
                       "empty": torch.zeros(0, 4)},
    }


def tier(root: Path, local_rank: int = 0, *, limit: int = 1 << 30, events: EventLog | None = None,
         generation: int = 0) -> mem.MemoryTier:
    return mem.MemoryTier(root, limit=limit, local_rank=local_rank, events=events or EventLog(),
                          generation=generation)


def save(t: mem.MemoryTier, step: int, rank: int = 0, world: int = 1, fingerprint: str = "f",
         pin_every: int = 0) -> mem.SaveCost | None:
    return t.save(step, payloads(step, rank), rank=rank, world_size=world, fingerprint=fingerprint,
                  counters={"step": step, "samples": step * 4, "tokens": 0},
                  pin=bool(pin_every) and step % pin_every == 0)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def test_a_saved_step_comes_back_bitwise_from_private_memory(root):
    t = tier(root)
    for step in range(1, 6):
        assert save(t, step) is not None
    t.wait()
    assert t.holdings(rank=0, world_size=1, fingerprint="f") == [(5, 0), (4, 0), (3, 0)]  # three slots
    replicated, own, counters = t.load(3, 0, 0)
    want = payloads(3)
    assert same(replicated, want["replicated"]) and same(own, want["rank"])
    assert counters == {"step": 3, "samples": 12, "tokens": 0}
    save(t, 6)  # overwrites the oldest slot, step 3's: what was loaded is a private copy, not a view of it
    t.wait()
    assert same(own, want["rank"]) and same(replicated, want["replicated"])
    assert t.holdings(rank=0, world_size=1, fingerprint="f") == [(6, 0), (5, 0), (4, 0)]
    t.close()


def test_another_fingerprint_world_size_or_later_generation_holds_nothing(root):
    t = tier(root, generation=3)
    save(t, 1, rank=0, world=2)
    t.wait()
    assert t.holdings(rank=0, world_size=2, fingerprint="f") == [(1, 3)]
    assert t.holdings(rank=0, world_size=2, fingerprint="other run") == []
    assert t.holdings(rank=0, world_size=4, fingerprint="f") == []
    assert tier(root, generation=2).holdings(rank=0, world_size=2, fingerprint="f") == []  # written later
    assert t.holdings(rank=1, world_size=2, fingerprint="f") == []  # another rank's state is not this one's


def test_a_flipped_byte_is_refused_and_the_restore_takes_the_next_older_common_step(root):
    events = EventLog()
    t = tier(root, events=events)
    for step in (1, 2, 3):
        save(t, step)
    t.wait()
    newest = next(r for r in mem.read_records(root, "rank00000") if r.step == 3)
    path = root / f"rank00000.{newest.slot}.shard"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10
    path.write_bytes(raw)
    with pytest.raises(CheckpointCorruptError, match="digest mismatch"):
        t.load(3, 0, 0)
    got = mem.restore_memory(t, Coordinator(), events, fingerprint="f", not_before=None, agree=agree)
    assert got is not None and got.step == 2 and same(got.rank_state, payloads(2)["rank"])
    restored = events.of_kind("memory_tier_restored")[-1].fields
    assert restored["step"] == 2 and "digest mismatch" in restored["skipped"][0]


def test_nothing_at_least_as_new_as_the_durable_commit_means_the_durable_tier(root):
    events = EventLog()
    t = tier(root, events=events)
    for step in (1, 2, 3):
        save(t, step)
    t.wait()
    assert mem.restore_memory(t, Coordinator(), events, fingerprint="f", not_before=4, agree=agree) is None
    got = mem.restore_memory(t, Coordinator(), events, fingerprint="f", not_before=3, agree=agree)
    assert got is not None and got.step == 3  # as new as the commit: memory is the faster read
    for slot in range(mem.SLOTS):  # every slot damaged: the durable tier, and an event that says why
        shard = root / f"replicated.{slot}.shard"
        shard.write_bytes(b"\0" * shard.stat().st_size)
    assert mem.restore_memory(t, Coordinator(), events, fingerprint="f", not_before=None, agree=agree) is None
    fallback = events.of_kind("memory_tier_fallback")[-1].fields
    assert len(fallback["problems"]) == 3 and all("replicated" in p for p in fallback["problems"])


def test_a_save_at_an_earlier_step_drops_the_future_the_run_went_back_from(root):
    t = tier(root)
    for step in (7, 8, 9):
        save(t, step)
    save(t, 8)  # a restore from the durable tier went back to 6 and trained on
    t.wait()
    assert t.holdings(rank=0, world_size=1, fingerprint="f") == [(8, 0), (7, 0)]


def test_a_restarted_rank_drops_pinned_futures_and_keeps_its_older_pin(root):
    """Pinned steps a restarted process finds are its own to turn over: a save after a restore at step 15 drops
    every pinned step past it (a future the run went back from), and the next pin takes a free slot, not the one
    holding step 10."""
    t = tier(root)
    for step in range(1, 31):
        save(t, step, pin_every=10)
    t.close()
    assert tier(root).holdings(rank=0, world_size=1, fingerprint="f") == [(30, 0), (29, 0), (28, 0), (27, 0),
                                                                         (20, 0), (10, 0)]
    again = tier(root)  # a new worker, restored at step 15
    for step in range(16, 21):
        save(again, step, pin_every=10)
    again.close()
    assert again.holdings(rank=0, world_size=1, fingerprint="f") == [(20, 0), (19, 0), (18, 0), (17, 0), (10, 0)]


def test_a_node_without_room_says_so_and_keeps_to_the_durable_tier(root):
    events = EventLog()
    t = tier(root, limit=20_000, events=events)  # one slot of a rank's and the replicated state needs ~3 KiB each
    results = [save(t, step) for step in range(1, 8)]
    assert results[0] is not None and results[-1] is None
    off = events.of_kind("memory_tier_off")
    assert len(off) == 1 and "--memory-limit" in off[0].fields["reason"] and off[0].fields["limit_bytes"] == 20_000
    assert t.off is not None and mem.usage(root) <= 20_000


def test_a_tmpfs_out_of_room_is_no_room_not_a_crash(root, monkeypatch):
    import errno
    import os

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    events = EventLog()
    t = tier(root, events=events)
    assert save(t, 1) is None
    assert "has no room" in events.of_kind("memory_tier_off")[0].fields["reason"]
    assert not any(p.stat().st_size for p in root.glob("*.shard"))


class _Killed(mem.MemoryTier):
    """A rank killed during a save: the copy happens (or not) and the manifest is never published."""

    def kill_during(self, step: int, rank: int, world: int, copied: bool, pin_every: int = 0) -> None:
        self.wait()  # the save before it was published (the next save waits for it before it copies anything)
        if copied:
            self._publish = lambda *a, **k: None  # type: ignore[method-assign]
            save(self, step, rank, world, pin_every=pin_every)
        else:
            stem = mem.file_stem(mem.RANK, rank)  # the manifest goes first, then the copy dies midway
            pinned = bool(pin_every) and step % pin_every == 0
            slot = self._free_slot(stem, mem.PINNED if pinned else tuple(range(mem.SLOTS)))
            (self.root / f"{stem}.{slot}.json").unlink(missing_ok=True)


@settings(max_examples=60, deadline=None)
@given(saves=st.integers(1, 7), ahead=st.booleans(), copied=st.booleans(), published_ahead=st.booleans(),
       every=st.sampled_from([1, 2, 5]), pin_every=st.sampled_from([0, 2, 3, 10]))
def test_ranks_one_save_apart_always_share_a_step_whatever_the_crash(saves, ahead, copied, published_ahead, every,
                                                                      pin_every):
    """Rank 1 dies during its save of step n; rank 0 (a step apart at most) finished n, or also took n + every.
    With pinned steps (kept for a peer node's copy) saved into slots of their own, the same holds."""
    with tempfile.TemporaryDirectory(dir=SHM, prefix="resilient-memory-test-") as d:
        root = Path(d)
        r0, r1 = tier(root, 0), _Killed(root, limit=1 << 30, local_rank=1, events=EventLog())
        steps = [every * i for i in range(1, saves + 1)]
        for step in steps[:-1]:
            save(r0, step, 0, 2, pin_every=pin_every)
            save(r1, step, 1, 2, pin_every=pin_every)
        n = steps[-1]
        save(r0, n, 0, 2, pin_every=pin_every)
        r1.kill_during(n, 1, 2, copied, pin_every)
        if ahead:  # rank 0 went through the next boundary before the agent stopped it
            r0.wait()
            if not published_ahead:
                r0._publish = lambda *a, **k: None  # type: ignore[method-assign]
            save(r0, n + every, 0, 2, pin_every=pin_every)
        r0.wait()
        r1.wait()
        held = [set(t.holdings(rank=r, world_size=2, fingerprint="f")) for t, r in ((r0, 0), (r1, 1))]
        common = held[0] & held[1]
        if len(steps) > 1:
            assert max(common) == (steps[-2], 0)
        else:
            assert not common  # nothing was saved everywhere before the crash


def test_the_interval_keeps_the_tier_within_its_budget_of_the_step():
    costs = [mem.SaveCost(s, 100 << 20, stall_s=0.02, hash_s=0.06) for s in range(5)]
    assert decide_interval([], 0.05, on_cpu=True).every == 1
    assert decide_interval(costs, None, on_cpu=True).every == 1
    gpu = decide_interval(costs, 0.05, on_cpu=False)  # 20 ms against 1% of 50 ms = 0.5 ms
    assert gpu.every == 40 and "20.0 ms" in gpu.reason and "within 1% of the step time" in gpu.reason
    cpu = decide_interval(costs, 0.05, on_cpu=True)  # the hashing takes cores from the step too
    assert cpu.every == 160
    assert decide_interval(costs, 0.05, on_cpu=True, bound=10).every == 10
    cheap = [mem.SaveCost(s, 1 << 10, stall_s=0.0001, hash_s=0.0001) for s in range(5)]
    assert decide_interval(cheap, 0.05, on_cpu=True).every == 1
    mixed = [*costs[:2], *cheap[:3]]  # the median: one slow save does not set the cadence
    assert decide_interval(mixed, 0.05, on_cpu=True).every == 1


def test_a_manifest_that_is_not_whole_holds_nothing(root):
    t = tier(root)
    save(t, 1)
    t.wait()
    record = mem.read_records(root, "rank00000")[0]
    path = root / f"rank00000.{record.slot}.json"
    body = json.loads(path.read_bytes())
    for broken in (path.read_bytes()[:-5], json.dumps({**body, "format": "other"}).encode(),
                   json.dumps({**body, "slot": record.slot + 1}).encode(), b"[]"):
        path.write_bytes(broken)
        assert mem.read_records(root, "rank00000") == []
