"""In-process recovery of sharded state under ``resilient run``: HSDP takes a lost shard from its replica.

``tests/elastic_worker.py --mesh 2,2`` trains an FSDP2 model on an HSDP mesh
of 2 replicas x 2 shards made by ``resilient.device_mesh`` (a spare waits
there until it is promoted), with dropout and random augmentation under
``run.attempt()``.  The uninterrupted run on the same mesh is the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .agent_helpers import events, explain, incidents
from .test_agent_inproc import DIE_STEP, assert_bitwise_equal, elastic_run, trace


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, proc = elastic_run(tmp_path_factory.mktemp("hsdp"), "ref", "--nproc-per-node", "4", extra=("--mesh", "2,2"))
    assert proc.returncode == 0, explain(proc)
    return out


def test_a_spare_takes_a_killed_hsdp_rank_shard_from_its_replica(tmp_path: Path, hsdp_reference: Path) -> None:
    out, proc = elastic_run(tmp_path, "kill", "--nproc-per-node", "4", "--spares", "1", die=("w3", "kill"),
                            extra=("--mesh", "2,2", "--spares-ready", "1"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "restart"), "recovered by a restart, not in process"
    decided = events(run, "recovery_decided")
    assert [d["action"] for d in decided] == ["promote_spare"], decided
    assert [(p["rank"], p["spare"]) for p in decided[0]["promotions"]] == [(3, "s4")]
    done = events(run, "recovered_in_process")
    assert len(done) == 1 and done[0]["resumed_after_step"] == DIE_STEP, done
    workers = {line["worker"] for line in trace(out) if line["step"] > DIE_STEP and line["rank"] == 3}
    assert workers == {"s4"}, f"rank 3 after the failure was {workers}, not the spare"
    assert_bitwise_equal(out, hsdp_reference, 4)  # zero steps re-done, bitwise equal


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, proc = elastic_run(tmp_path_factory.mktemp("fsdp"), "ref", "--nproc-per-node", "2", extra=("--mesh", "2"))
    assert proc.returncode == 0, explain(proc)
    return out


@pytest.mark.parametrize("tier", ["memory", "durable"])
def test_pure_fsdp_has_no_replica_so_a_lost_rank_restarts_from_memory_or_the_newest_commit(
        tmp_path: Path, fsdp_reference: Path, tier: str) -> None:
    flags = () if tier == "memory" else ("--no-memory-tier",)
    out, proc = elastic_run(tmp_path, "fsdp", "--nproc-per-node", "2", "--spares", "1", *flags, die=("w1", "kill"),
                            extra=("--mesh", "2", "--spares-ready", "1"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    why = ("in-process recovery impossible: no survivor holds a copy of the sharded state of rank 1 (pure FSDP: "
           "each shard exists on one rank only), so only a restart restores it (from the node's memory tier, else "
           "the newest commit)")
    decided = events(run, "recovery_decided")
    assert [d["action"] for d in decided] == ["restart"] and decided[0]["reason"].startswith(why), decided
    [incident] = incidents(run)
    assert incident["decision"]["action"] == "restart" and incident["ladder"]["reason"].startswith(why), incident
    assert f"not recovered in process: {why}" in proc.stderr  # the incident as the console shows it
    assert len(events(run, "restart")) == 1 and not events(run, "recovered_in_process")
    lines = trace(out)
    [restored] = [e for e in events(run, "restored") if e["generation"] == 2]
    if tier == "memory":
        # Each rank's shards as it kept them in the node's memory tier, put back without a reshard: the newest
        # boundary both ranks published, 4 (rank 1 was killed in step 4) or 3 when its save at 4 had not been
        # published yet; at most the step in which rank 1 died is done again.
        assert restored["checkpoint"] in ("memory:step_0000000003", "memory:step_0000000004"), restored
        steps = [line["step"] for line in lines if line["rank"] == 0]
        assert sorted(set(steps)) == list(range(8)) and len(steps) <= 9, steps
    else:
        # The newest commit (every 3 steps: step 3): steps 3 and 4 re-done.
        assert restored["checkpoint"] == "step_0000000003", restored
        assert [line["step"] for line in lines if line["rank"] == 0] == [0, 1, 2, 3, 3, 4, 5, 6, 7]
    last = {(line["step"], line["rank"]): (line["indices"], line["losses"]) for line in lines}
    want = {(line["step"], line["rank"]): (line["indices"], line["losses"]) for line in trace(fsdp_reference)}
    assert last == want
    final = json.loads((out / "final.json").read_text())
    ref = json.loads((fsdp_reference / "final.json").read_text())
    assert (final["params"], final["optimizer"], final["lr"]) == (ref["params"], ref["optimizer"], ref["lr"])


def test_each_replica_group_takes_its_shards_from_a_member_that_holds_the_agreed_step() -> None:
    from resilient.elastic.mesh_rebind import ShardLayout
    from resilient.elastic.shard_sync import shard_sources
    from resilient.elastic.state_sync import StateSyncError, decide_source

    hsdp = ShardLayout(root=None, meshes=(), infos=(), modules=(), replica_dim=0, replicas=((0, 2), (1, 3)))
    # Rank 3 replaced: its group takes the shards from rank 1; the agent's source wins in its own group.
    assert shard_sources(decide_source([5, 5, 5, None], preferred=2), hsdp) == {(0, 2): 2, (1, 3): 1}
    # Rank 1 had not applied step 5, rank 3 had: rank 3 is its group's source.
    assert shard_sources(decide_source([5, 4, 5, 5]), hsdp) == {(0, 2): 0, (1, 3): 3}
    with pytest.raises(StateSyncError, match=r"the shard of rank\(s\) \[1, 3\] cannot be rebuilt in memory: no "
                                             r"replica of it survived with step 5 applied"):
        shard_sources(decide_source([5, 4, 5, None]), hsdp)
    fsdp = ShardLayout(root=None, meshes=(), infos=(), modules=(), replica_dim=None, replicas=((0,), (1,)))
    with pytest.raises(StateSyncError, match=r"no other rank holds it \(no replica: pure FSDP\)"):
        shard_sources(decide_source([5, None]), fsdp)
    assert hsdp.peers_of(3) == (1, 3)
