"""Sharded state (FSDP2 ``fully_shard``) through the manifest commit, in real processes under torchrun.

The worker (``tests/worker_train.py --fsdp``) shards a small MLP over the
ranks; its digests gather every DTensor to the full tensor, so a restore
on another world size can be compared with what was saved.
"""

from __future__ import annotations

import json
import os

import pytest

from resilient.checkpoint import LocalStorage
from resilient.checkpoint.inspect import inspect_checkpoint

from .helpers import assert_same_run, read_trace, run_worker

FSDP = ["--fsdp"]
STEPS = 15


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-rank FSDP2 run, per rank."""
    path = tmp_path_factory.mktemp("fsdp-reference") / "trace"
    run_worker(path, "--steps", str(STEPS), *FSDP, nproc=2)
    return [read_trace(path, r) for r in (0, 1)]


def check_resumed(reference, trace, restored: list) -> None:
    for rank in (0, 1):
        resumed = read_trace(trace, rank)
        assert [s["restored_from"] for s in resumed.starts] == restored
        assert_same_run(reference[rank], resumed)


def test_fsdp_resume_is_bitwise_equal(tmp_path, reference):
    """Stopped at step 12 and resumed: batches, lr, loss, parameters, optimizer state and RNG bitwise equal."""
    common = ["--dir", str(tmp_path / "ckpt"), "--every", "5", *FSDP]
    run_worker(tmp_path / "b", "--steps", "12", *common, nproc=2)
    run_worker(tmp_path / "b", "--steps", str(STEPS), *common, nproc=2)
    check_resumed(reference, tmp_path / "b", [None, "step_0000000012"])
    saved = read_trace(tmp_path / "b", 0)
    # What was restored, gathered to full tensors, is what the first process ended with.
    assert saved.starts[1]["params"] == saved_end(tmp_path / "b")["params"]
    manifest = json.loads((tmp_path / "ckpt" / "step_0000000015" / "manifest.json").read_text())
    assert manifest["schema"] == "resilient.checkpoint/4" and manifest["index"] == "sharded.index"
    assert sorted(f["path"] for f in manifest["files"]) == [
        "rank00000.shard", "rank00001.shard", "replicated.shard", "sharded.index"]
    detail = inspect_checkpoint(LocalStorage(tmp_path / "ckpt"), "step_0000000015")
    tensors = {t.key: t for t in detail.sharded}
    weight = tensors["model/0.weight"]  # Linear(8, 32) sharded on dim 0 over 2 ranks
    assert (weight.dtype, weight.shape, weight.placements, weight.mesh) == ("float32", (32, 8), ("S(0)",), (2,))
    assert weight.chunks == ((0, (0, 0), (16, 8)), (1, (16, 0), (16, 8)))
    assert "optimizer/state/0.weight/exp_avg_sq" in tensors


def test_hsdp_resume_is_bitwise_equal_and_writes_each_chunk_once(tmp_path):
    """HSDP, 2 replicas x 2 shards on 4 ranks: each chunk is written by one replica only, and resuming is
    bitwise equal to the run that never stopped."""
    hsdp = [*FSDP, "--mesh", "2,2"]
    run_worker(tmp_path / "a", "--steps", "12", *hsdp, nproc=4)
    common = ["--dir", str(tmp_path / "ckpt"), "--every", "5", *hsdp]
    run_worker(tmp_path / "b", "--steps", "7", *common, nproc=4)
    run_worker(tmp_path / "b", "--steps", "12", *common, nproc=4)
    for rank in range(4):
        resumed = read_trace(tmp_path / "b", rank)
        assert [s["restored_from"] for s in resumed.starts] == [None, "step_0000000007"]
        assert_same_run(read_trace(tmp_path / "a", rank), resumed)
    detail = inspect_checkpoint(LocalStorage(tmp_path / "ckpt"), "step_0000000012")
    writers = set()
    for t in detail.sharded:
        assert t.placements == ("R", "S(0)") and t.mesh == (2, 2)
        ranks = [r for r, _, _ in t.chunks]
        assert ranks in ([0, 1], [2, 3], [0], [2]), f"{t.key}: chunks from ranks {ranks}"  # one replica each
        writers.update(ranks)
    assert writers == {0, 1, 2, 3}, "the replicas share the writing"


def saved_end(trace) -> dict:
    """The first ``end`` record of rank 0's trace (the process that saved)."""
    for line in open(f"{trace}.rank0"):
        rec = json.loads(line)
        if rec.get("event") == "end":
            return rec
    raise AssertionError("no end record")


def test_fsdp_resume_from_s3_is_bitwise_equal(tmp_path, reference, s3_url):
    url, endpoint = s3_url
    common = ["--dir", url, "--endpoint-url", endpoint, "--every", "5", *FSDP]
    run_worker(tmp_path / "b", "--steps", "12", *common, nproc=2)
    run_worker(tmp_path / "b", "--steps", str(STEPS), *common, nproc=2)
    check_resumed(reference, tmp_path / "b", [None, "step_0000000012"])


@pytest.mark.parametrize(("point", "rank"), [("write", "1"), ("before_manifest", "0")],
                         ids=["rank1-mid-write", "rank0-before-manifest"])
def test_kill_during_sharded_save_loses_nothing(tmp_path, reference, point, rank):
    """One rank SIGKILLed while writing its chunks, or rank 0 before the manifest: step 5 stays the newest."""
    ckpt = tmp_path / "ckpt"
    common = ["--steps", str(STEPS), "--dir", str(ckpt), "--every", "5", "--keep", "1", *FSDP]
    run_worker(tmp_path / "t", *common, "--fault", point, "--fault-step", "10", "--fault-rank", rank,
               nproc=2, expect="killed")
    assert os.path.exists(f"{tmp_path / 't'}.fault-fired"), "the fault never fired"
    assert LocalStorage(ckpt).list_committed() == ["step_0000000005"]
    run_worker(tmp_path / "t", *common, nproc=2)
    for r in (0, 1):
        assert read_trace(tmp_path / "t", r).starts[-1]["restored_from"] == "step_0000000005"
    check_resumed(reference, tmp_path / "t", [None, "step_0000000005"])
    assert not os.listdir(ckpt / ".staging"), "staging leftovers of the crashed save were not collected"
    assert LocalStorage(ckpt).list_committed() == ["step_0000000015"]


@pytest.mark.parametrize("damaged", ["rank00001.shard", "replicated.shard", "sharded.index"])
def test_corrupt_file_falls_back_on_every_rank(tmp_path, reference, damaged):
    """A flipped byte in one file of step 10 (rank 1's chunks, rank 0's replicated state, the index):
    quarantined, and both ranks restore step 5."""
    ckpt = tmp_path / "ckpt"
    common = ["--dir", str(ckpt), "--every", "5", "--keep", "2", *FSDP]
    run_worker(tmp_path / "t", "--steps", "10", *common, nproc=2)
    shard = ckpt / "step_0000000010" / damaged
    blob = bytearray(shard.read_bytes())
    blob[-5] ^= 0x40  # the last bytes: tensor data (rank 1's last chunk), or the end of a JSON header
    shard.write_bytes(bytes(blob))
    run_worker(tmp_path / "t", "--steps", str(STEPS), *common, "--events", str(tmp_path / "ev"), nproc=2)
    for r in (0, 1):
        assert read_trace(tmp_path / "t", r).starts[-1]["restored_from"] == "step_0000000005"
    events = [json.loads(line) for line in open(tmp_path / "ev.rank0")]
    (quarantined,) = [e for e in events if e["kind"] == "checkpoint_quarantined"]
    assert quarantined["name"] == "step_0000000010"
    assert damaged in quarantined["reason"]
    assert LocalStorage(ckpt).list_quarantined()
    # Steps 5..15 are re-done from step 5 and still equal the reference.
    for r in (0, 1):
        assert_same_run(reference[r], read_trace(tmp_path / "t", r), from_step=5)


def test_restore_two_to_four_to_two_ranks(tmp_path):
    """Saved on 2 ranks, restored on 4, saved, restored on 2: every tensor gathered equals what was saved, each
    step consumes the reference's global batch, and the loss stays within 1e-5 (relative) of the reference.

    Without dropout and augmentation noise (drawn from each rank's own random stream, which a new world size
    cannot continue), the runs differ only in how gradients are summed."""
    common = ["--micro", "--elastic", "--every", "4", "--dropout", "0", "--augment", "0", *FSDP]
    ckpt = ["--dir", str(tmp_path / "ckpt")]
    run_worker(tmp_path / "ref", "--steps", "24", *common, nproc=2)
    run_worker(tmp_path / "b", "--steps", "8", *ckpt, *common, nproc=2)
    run_worker(tmp_path / "b", "--steps", "16", *ckpt, *common, nproc=4)
    run_worker(tmp_path / "b", "--steps", "24", *ckpt, *common, nproc=2)
    rank0 = [json.loads(line) for line in open(f"{tmp_path / 'b'}.rank0")]
    starts = [r for r in rank0 if r.get("event") == "start"]
    ends = [r for r in rank0 if r.get("event") == "end"]
    assert [(s["world_size"], s["restored_from"]) for s in starts] == [
        (2, None), (4, "step_0000000008"), (2, "step_0000000016")]
    for start, end in zip(starts[1:], ends[:2]):  # gathered to full: restored == saved, parameters and optimizer
        assert (start["params"], start["optimizer"]) == (end["params"], end["optimizer"])
    ref = [read_trace(tmp_path / "ref", r) for r in (0, 1)]
    got = {r: read_trace(tmp_path / "b", r) for r in range(4)}
    for step in range(24):
        ranks = [r for r in got if step in got[r].steps and (r < 2 or 8 <= step < 16)]
        assert [got[r].steps[step]["world_size"] for r in ranks] == [4 if 8 <= step < 16 else 2] * len(ranks)
        batch = sorted(i for r in ranks for i in got[r].steps[step]["indices"])
        assert batch == sorted(i for t in ref for i in t.steps[step]["indices"]), f"step {step}: another batch"
        loss = sum(float.fromhex(got[r].steps[step]["loss"]) for r in ranks) / len(ranks)
        expected = sum(float.fromhex(t.steps[step]["loss"]) for t in ref) / 2
        assert loss == pytest.approx(expected, rel=1e-5), f"step {step}"
    final, expected = got[0].end["full_params"], ref[0].end["full_params"]
    assert final == pytest.approx(expected, rel=1e-4, abs=1e-5)


def _index(chunks: list[dict], shape: list[int] | None = None) -> dict:
    return {"format": 1, "tensors": [{"key": '["model","w"]', "dtype": "float32", "shape": shape or [4, 2],
                                      "placements": ["S(0)"], "mesh": [2], "chunks": chunks}]}


GOOD = [{"offsets": [0, 0], "sizes": [2, 2], "rank": 0, "item": 0},
        {"offsets": [2, 0], "sizes": [2, 2], "rank": 1, "item": 0}]


@pytest.mark.parametrize(("chunks", "problem"), [
    (GOOD[:1], "do not cover"),  # a hole
    ([GOOD[0], {**GOOD[0], "rank": 1}], "same offsets"),  # the same region twice, sizes adding up
    ([GOOD[0], {**GOOD[1], "rank": 0}], "listed twice"),  # two chunks claim one tensor of one file
    ([GOOD[0], {**GOOD[1], "rank": 2}], "no such rank"),
    ([GOOD[0], {**GOOD[1], "item": True}], "non-negative integers"),
    ([GOOD[0], {**GOOD[1], "offsets": [3, 0]}], "outside shape"),
])
def test_a_malformed_index_is_refused(chunks, problem):
    from resilient.checkpoint.sharded import parse_index

    assert parse_index(_index(GOOD), world_size=2)
    with pytest.raises(ValueError, match=problem):
        parse_index(_index(chunks), world_size=2)
    for bad in ({"format": 1, "tensors": [{"key": "model.w"}]}, {"format": 2, "tensors": []}, [], None):
        with pytest.raises(ValueError):
            parse_index(bad, world_size=2)


def test_reads_must_fill_a_chunk_exactly():
    """Overlapping saved chunks whose volumes add up, leaving a hole: refused at restore (corrupt)."""
    from types import SimpleNamespace

    from resilient.checkpoint.sharded import _check_fill

    def read(offsets, lengths):
        return SimpleNamespace(dest_offsets=offsets, lengths=lengths)

    _check_fill("w", (4, 2), [read((0, 0), (2, 2)), read((2, 0), (2, 2))])
    with pytest.raises(ValueError, match="overlap"):
        _check_fill("w", (4, 2), [read((0, 0), (3, 2)), read((1, 0), (1, 2))])
    with pytest.raises(ValueError, match="exactly"):
        _check_fill("w", (4, 2), [read((0, 0), (2, 2))])


def test_restore_onto_another_mesh(tmp_path):
    """Saved with FSDP over 4 ranks (mesh (4,)), restored as HSDP on 4 ranks (mesh (2, 2)), then trained on:
    every parameter and optimizer state tensor, gathered to full, equals what was saved."""
    ckpt = ["--dir", str(tmp_path / "ckpt"), "--every", "4", *FSDP]
    run_worker(tmp_path / "b", "--steps", "4", *ckpt, nproc=4)
    run_worker(tmp_path / "b", "--steps", "6", *ckpt, "--mesh", "2,2", nproc=4)
    rank0 = [json.loads(line) for line in open(f"{tmp_path / 'b'}.rank0")]
    (_, restored), (saved, _) = [r for r in rank0 if r.get("event") == "start"], \
        [r for r in rank0 if r.get("event") == "end"]
    assert restored["restored_from"] == "step_0000000004" and restored["step"] == 4
    assert (restored["params"], restored["optimizer"]) == (saved["params"], saved["optimizer"])
    detail = inspect_checkpoint(LocalStorage(tmp_path / "ckpt"), "step_0000000006")
    assert {t.placements for t in detail.sharded} == {("R", "S(0)")}


def test_kept_local_shards_go_back_only_onto_the_layout_they_were_kept_from(tmp_path):
    """The memory tier keeps each rank's local tensors with their layout; putting them back onto another layout
    (placements, mesh, model) is refused by name, so the restore falls back to the durable tier, which reshards."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from resilient.checkpoint.sharded import key_of, put_back_local, split_local

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
        rest, local, layout = split_local({"model": {"w": w, "n": 3}})
        assert rest == {"model": {"w": None, "n": 3}}
        key = key_of(("model", "w"))
        back = put_back_local({key: w}, [t.clone() for t in local], layout)
        assert torch.equal(back[key].full_tensor(), w.full_tensor()) and back[key].placements == w.placements
        replicated = distribute_tensor(torch.zeros(4, 3), mesh, [Replicate()])
        with pytest.raises(ValueError, match=r"was kept as .*S\(0\).* the live tensor is .*'R'"):
            put_back_local({key: replicated}, local, layout)
        with pytest.raises(ValueError, match="another model"):
            put_back_local({key: w, key_of(("model", "v")): w}, local, layout)
    finally:
        dist.destroy_process_group()
