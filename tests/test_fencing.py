"""Generations fence checkpoint writes: a stale process never publishes, deletes or collects.

The claim rule is tested as a pure function; the fence itself on each
backend (a local directory and a real S3-compatible server); and end to end
with real processes: a "zombie" of generation 1 is SIGSTOPped in the middle
of its save, a generation-2 process of the same launch claims the location
and finishes the run, then the zombie is continued.  Its commit and its
retention must be refused with ``checkpoint_fenced`` events, the new
generation's checkpoints must be untouched, and the new generation's run
must be bitwise equal to an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import resilient
from resilient.checkpoint import CheckpointConfig, CheckpointManager, Fence, open_storage
from resilient.checkpoint import manifest as mf
from resilient.checkpoint.coordinator import Coordinator
from resilient.checkpoint.fence import decide_claim
from resilient.checkpoint.manifest import SCHEMA_V1, parse_manifest
from resilient.core.errors import FencedError

from .helpers import REPO, WORKER, assert_same_run, read_trace, run_worker

L1, L2 = "launch-a", "launch-b"


# ------------------------------------------------------------------ the rule
@pytest.mark.parametrize(
    ("holder", "claimant", "ok", "reason"),
    [
        (None, Fence(launch=L1, generation=3), True, "no fence yet"),
        (Fence(launch=L1, generation=3), Fence(launch=L1, generation=4), True, "takes the fence"),
        (Fence(launch=L1, generation=3), Fence(launch=L1, generation=3), True, "takes the fence"),
        (Fence(launch=L1, generation=3), Fence(launch=L1, generation=2), False, "stale and must exit"),
        (Fence(launch=L1, generation=9), Fence(launch=L2, generation=0), True, "another launch"),
        (Fence(launch=L1, generation=9), Fence(), True, "another launch"),  # a plain run after an agent's
        (Fence(), Fence(), True, "takes the fence"),  # plain runs, as before fencing
    ],
)
def test_claim_rule(holder, claimant, ok, reason):
    decision = decide_claim(holder, claimant)
    assert decision.ok is ok
    assert reason in decision.reason


# ------------------------------------------------------------- each backend
def _storage(store):
    return open_storage(store.url, endpoint_url=store.endpoint)


def _stage(storage, name: str, token: str):
    """A staged one-file checkpoint and its manifest, as a save would leave them."""
    from resilient.checkpoint.digest import BlockSpec
    from resilient.checkpoint.manifest import SCHEMA_BLOCKS, FileEntry, Manifest, step_of

    spec = BlockSpec(block_bytes=4096)
    staging = storage.begin(name, token)
    files = tuple(FileEntry(staging.file_prefix + rel, got.size, got.digest, rank, got.blocks)
                  for rel, data, rank in (("replicated.shard", b"x" * 100, None), ("rank00000.shard", b"y" * 10, 0))
                  for got in [storage.write_file(staging, rel, [memoryview(data)], spec)])
    manifest = Manifest(name=name, step=step_of(name) or 0, world_size=1, files=files, parent=None,
                        created_unix=time.time(), chunk_bytes=4096, schema=SCHEMA_BLOCKS,
                        digest_algorithm=spec.algorithm)
    return staging, manifest.to_bytes()


def test_stale_claim_commit_delete_gc_and_quarantine_are_refused(store):
    storage = _storage(store)
    old, new = Fence(launch=L1, generation=1), Fence(launch=L1, generation=2)
    assert storage.claim_fence(old) is None
    staged, raw = _stage(storage, "step_0000000001", "tokold1")
    storage.commit(staged, raw, fence=old)
    assert storage.claim_fence(new) == old
    assert storage.read_fence() == new

    with pytest.raises(FencedError, match="generation 2 of launch launch-a.*stale and must exit") as info:
        storage.claim_fence(old)
    assert (info.value.holder_launch, info.value.holder_generation) == (L1, 2)
    staged, raw = _stage(storage, "step_0000000002", "tokold2")
    with pytest.raises(FencedError, match="commit of step_0000000002"):
        storage.commit(staged, raw, fence=old)
    with pytest.raises(FencedError, match="deletion of step_0000000001"):
        storage.delete("step_0000000001", fence=old)
    with pytest.raises(FencedError, match="garbage collection"):
        storage.collect_garbage(keep_token="tokold2", fence=old)
    with pytest.raises(FencedError, match="quarantine of step_0000000001"):  # a stale restore that failed to verify
        storage.quarantine("step_0000000001", "digest mismatch", fence=old)
    assert storage.list_committed() == ["step_0000000001"], "a stale writer changed the committed set"
    assert storage.read_fence() == new

    # The holder itself still writes, and an operator's tool (no fence) is never refused.
    staged, raw = _stage(storage, "step_0000000003", "toknew")
    storage.commit(staged, raw, fence=new)
    storage.delete("step_0000000001", fence=new)
    assert storage.list_committed() == ["step_0000000003"]
    storage.collect_garbage()


def test_s3_commit_whose_fence_moves_during_the_put_is_taken_back(s3_url):
    """The claim lands between the fence check and the PUT: the manifest is deleted again."""
    from resilient.checkpoint.s3 import S3Storage

    url, endpoint = s3_url
    old, new = Fence(launch=L1, generation=1), Fence(launch=L1, generation=2)

    class Racing(S3Storage):
        def _check_staged(self, staging, manifest):  # runs after the fence check, before the PUT
            super()._check_staged(staging, manifest)
            S3Storage(url, endpoint_url=endpoint).claim_fence(new)

    storage = Racing(url, endpoint_url=endpoint)
    storage.claim_fence(old)
    staged, raw = _stage(storage, "step_0000000001", "tok1")
    with pytest.raises(FencedError, match="published, then deleted again"):
        storage.commit(staged, raw, fence=old)
    assert storage.list_committed() == []


def _manager(url, endpoint=None, fence=None, events=None, digest="xxh3-128"):
    config = CheckpointConfig(dir=url, endpoint_url=endpoint, every_steps=None, keep=5, digest=digest)
    return CheckpointManager(config, Coordinator(), events or resilient.EventLog(), fence=fence)


def _save(manager, step: int):
    payloads = {"rank": {"step": step, "w": torch.full((4,), float(step))}, "replicated": {"m": torch.ones(3)}}
    return manager.save(step, payloads, counters={"samples": 0, "tokens": 0}, fingerprint={}, wait=True)


def test_manifests_record_generation_and_launch_and_old_ones_still_read(store):
    result = _save(_manager(store.url, store.endpoint, Fence(launch=L1, generation=4), digest="sha256"), 3)
    assert result.ok, result.error
    assert (result.manifest.generation, result.manifest.launch) == (4, L1)
    raw = store.read("step_0000000003", "manifest.json")
    assert (json.loads(raw)["generation"], json.loads(raw)["launch"]) == (4, L1)

    # A manifest written before fencing (schema 1, no generation/launch, SHA-256 without block digests listed)
    # reads as generation 0 of no launch.
    body = json.loads(raw)
    body["schema"] = SCHEMA_V1
    del body["generation"], body["launch"], body["index"]
    for entry in body["files"]:
        del entry["blocks"]
    body["manifest_digest"] = mf._content_digest(body)
    old = mf._canonical(body)
    parsed = parse_manifest(old, "step_0000000003")
    assert (parsed.generation, parsed.launch, parsed.schema) == (0, None, SCHEMA_V1)
    assert parsed.to_bytes() == old, "an old manifest must keep its canonical bytes"
    store.write("step_0000000003", "manifest.json", old)
    restored = _manager(store.url, store.endpoint).restore()
    assert restored is not None and restored.manifest.generation == 0


def test_stale_generation_is_refused_at_start_and_a_fenced_save_is_an_event(store):
    events = resilient.EventLog()
    old = _manager(store.url, store.endpoint, Fence(launch=L1, generation=4), events)
    assert _save(old, 1).ok
    _manager(store.url, store.endpoint, Fence(launch=L1, generation=5))
    with pytest.raises(FencedError, match="held by generation 5 of launch launch-a.*generation 4.*must exit"):
        _manager(store.url, store.endpoint, Fence(launch=L1, generation=4))
    result = _save(old, 2)  # the older generation is still alive: its save is refused, not raised
    assert not result.ok and "stale" in (result.error or "")
    (fenced,) = events.of_kind("checkpoint_fenced")
    assert fenced.fields["action"] == "commit" and fenced.fields["step"] == 2
    assert fenced.fields["holder"] == {"launch": L1, "generation": 5}
    assert old.storage.list_committed() == ["step_0000000001"]
    # A new launch supersedes whatever generation the old one reached; so does a plain run.
    _manager(store.url, store.endpoint, Fence(launch=L2, generation=0))
    assert _save(_manager(store.url, store.endpoint), 3).ok


# --------------------------------------------------------- real processes
STEPS = 15


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("reference") / "trace"
    run_worker(path, "--steps", str(STEPS))
    return read_trace(path)


def _wait_stopped(proc: subprocess.Popen, marker: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the zombie exited ({proc.returncode}) before its fault point"
        if marker.exists() and Path(f"/proc/{proc.pid}/stat").read_text().split(") ", 1)[1][0] == "T":
            return
        time.sleep(0.05)
    raise AssertionError("the zombie never stopped at its fault point")


def _events(path: Path, kind: str) -> list[dict]:
    lines = Path(f"{path}.rank0").read_text().splitlines() if Path(f"{path}.rank0").exists() else []
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def _agent_env(tmp_path: Path, generation: int) -> dict[str, str]:
    return {"RESILIENT_AGENT_SOCKET": str(tmp_path / "nobody.sock"), "RESILIENT_GENERATION": str(generation),
            "RESILIENT_LAUNCH_ID": L1}


# (where the zombie stops, what the new generation restores, what the zombie is refused)
ZOMBIES = [
    ("before_manifest", "step_0000000005", ["commit", "commit"]),  # ... and its final save at 15  # staged step 10, not yet committed
    ("before_delete", "step_0000000010", ["retention", "commit"]),  # committed 10, retention decided
]


@pytest.mark.parametrize(("point", "restores", "refused"), ZOMBIES, ids=[z[0] for z in ZOMBIES])
def test_zombie_of_an_older_generation_is_fenced(tmp_path, reference, point, restores, refused):
    ckpt = tmp_path / "ckpt"
    zombie_trace, new_trace = tmp_path / "zombie", tmp_path / "new"
    zombie_events, new_events = tmp_path / "zombie-events", tmp_path / "new-events"
    common = ["--steps", str(STEPS), "--dir", str(ckpt), "--every", "5", "--sync"]
    cmd = [sys.executable, str(WORKER), "--trace", str(zombie_trace), *common, "--keep", "1",
           "--events", str(zombie_events), "--fault", point, "--fault-step", "10", "--fault-signal", "STOP"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **_agent_env(tmp_path, 1)}
    zombie = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_stopped(zombie, Path(f"{zombie_trace}.fault-fired"))
        # The run as the new generation continues it: the zombie's steps before the restored checkpoint.
        restored_step = int(restores.split("_")[1])
        kept = [line for line in Path(f"{zombie_trace}.rank0").read_text().splitlines()
                if json.loads(line).get("step", 0) < restored_step or json.loads(line).get("event") == "start"]
        Path(f"{new_trace}.rank0").write_text("\n".join(kept) + "\n")

        run_worker(new_trace, *common, "--keep", "3", "--events", str(new_events), env=_agent_env(tmp_path, 2))
        storage = open_storage(ckpt)
        committed = storage.list_committed()
        assert committed == ["step_0000000005", "step_0000000010", "step_0000000015"]
        before = {n: (ckpt / n / "manifest.json").read_bytes() for n in committed}
        assert parse_manifest(before["step_0000000015"], "step_0000000015").generation == 2
        assert storage.read_fence() == Fence(launch=L1, generation=2)

        os.kill(zombie.pid, signal.SIGCONT)
        _, err = zombie.communicate(timeout=120)
    finally:
        if zombie.poll() is None:
            zombie.kill()
            zombie.wait()
    assert zombie.returncode == 0, f"a fenced save must not crash the zombie:\n{err[-3000:]}"
    fenced = _events(zombie_events, "checkpoint_fenced")
    assert [e["action"] for e in fenced] == refused, fenced
    for e in fenced:
        assert (e["generation"], e["launch"]) == (1, L1)
        assert e["holder"] == {"launch": L1, "generation": 2}
        assert "stale" in e["error"]
    assert not any(e["step"] == 15 for e in _events(zombie_events, "checkpoint_committed"))
    # The new generation's checkpoints are exactly as it left them.
    assert storage.list_committed() == committed
    assert {n: (ckpt / n / "manifest.json").read_bytes() for n in committed} == before
    assert open_storage(ckpt).read_fence() == Fence(launch=L1, generation=2)
    assert [e["name"] for e in _events(new_events, "checkpoint_restored")] == [restores]

    resumed = read_trace(new_trace)
    assert resumed.starts[-1]["restored_from"] == restores
    assert_same_run(reference, resumed)
