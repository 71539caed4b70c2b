"""A failure on one rank during restore is the same outcome on every rank, at once.

Two real gloo ranks restore checkpoints while the storage of one of them
fails (injected through ``CheckpointManager(storage=...)``): listing,
reading a manifest (rank 0 does both alone) or reading a shard, with a
resilient error, an unexpected exception or a MemoryError.  Every rank must
end with the same error (or the same fallback), and never a timeout: a rank
left waiting in a collective would end with the checkpoint group's gloo
timeout (120 s), not with its peer's error.

A shard whose header nests 10,000 levels deep (made to pass size and digest
checks, as a bug in a writer or a hostile store could) is quarantined and
the previous checkpoint restored on both ranks; ``resilient checkpoint
verify`` and ``inspect`` report the same problem for the same file.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.checkpoint import manifest as mf
from resilient.checkpoint.digest import digest_bytes
from resilient.checkpoint.inspect import inspect_checkpoint, verify_checkpoint
from resilient.checkpoint.shard import MAGIC
from resilient.checkpoint.storage import LocalStorage
from resilient.cli.main import main as cli

from .helpers import REPO

WORKER = Path(__file__).with_name("agreement_worker.py")
NEWEST, PREVIOUS = "step_0000000002", "step_0000000001"
DEEP = 10_000


def torchrun(*args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
           str(WORKER), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert proc.returncode == 0, f"workers failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def deep_shard() -> bytes:
    """A well-framed shard whose JSON header nests DEEP levels."""
    body = b'{"format":1,"skeleton":' + b"[" * DEEP + b"]" * DEEP + b',"tensors":[],"data_bytes":0}'
    prefix = MAGIC + struct.pack("<Q", len(body)) + body
    return prefix + b"\0" * (-len(prefix) % 64)


def plant_deep_header(directory: Path, name: str, rel: str) -> None:
    """Replace ``rel`` with a deep-header shard and re-seal the manifest, so size and digest pass."""
    blob = deep_shard()
    (directory / name / rel).write_bytes(blob)
    body = json.loads((directory / name / "manifest.json").read_bytes())
    (entry,) = [f for f in body["files"] if f["path"] == rel]
    got = digest_bytes(blob, body["chunk_bytes"], body["digest_algorithm"])
    entry["size"], entry["digest"], entry["blocks"] = len(blob), got.digest, list(got.blocks)
    body["manifest_digest"] = mf._content_digest(body)
    (directory / name / "manifest.json").write_bytes(mf._canonical(body))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("agreement")
    pristine = root / "pristine"
    torchrun("save", str(pristine))
    assert LocalStorage(pristine).list_committed() == [PREVIOUS, NEWEST]
    dirs = {}
    for scenario in ("list0", "manifest0", "read0", "read1", "deep", "count", "count_shared"):
        dirs[scenario] = Path(shutil.copytree(pristine, root / scenario))
    plant_deep_header(dirs["deep"], NEWEST, "rank00001.shard")
    evidence = Path(shutil.copytree(dirs["deep"], root / "deep-evidence"))
    out = root / "out"
    torchrun("restore", str(out), *(f"{'none' if s == 'deep' else s}={d}" for s, d in dirs.items()))
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in (0, 1)]
    by_scenario = {s: [ranks[0]["none" if s == "deep" else s], ranks[1]["none" if s == "deep" else s]] for s in dirs}
    return by_scenario, dirs, evidence


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        ("list0", "StorageError: injected: listing failed on rank 0"),
        ("manifest0", "CheckpointError: rank 0 failed with RuntimeError: injected: manifest read blew up on rank 0"),
        ("read0", "rank 0: could not read step_0000000002/replicated.shard"),
        ("read1", "rank 1: injected: rank 1 cannot read"),
    ],
)
def test_one_rank_failing_is_the_same_error_on_every_rank_at_once(outcomes, scenario, expected):
    by_scenario, dirs, _ = outcomes
    rank0, rank1 = by_scenario[scenario]
    assert rank0["outcome"] == rank1["outcome"], "the ranks disagree"
    assert expected in rank0["outcome"]
    for r in (rank0, rank1):
        # A rank left waiting in a collective would end with the checkpoint group's gloo timeout instead.
        assert "timeout" not in r["outcome"].lower() and "timed out" not in r["outcome"].lower(), r["outcome"]
        assert not r["quarantined"], "an I/O failure must never quarantine a checkpoint"
    assert LocalStorage(dirs[scenario]).list_committed() == [PREVIOUS, NEWEST]


def test_read_failures_surface_as_storage_errors(outcomes):
    by_scenario, _, _ = outcomes
    assert by_scenario["read0"][0]["outcome"].startswith("StorageError: cannot read checkpoint step_0000000002")
    assert "MemoryError" in by_scenario["read0"][0]["outcome"]
    assert by_scenario["read1"][1]["outcome"].startswith("StorageError: cannot read checkpoint step_0000000002")


def test_deep_header_is_quarantined_and_the_previous_checkpoint_restored_on_both_ranks(outcomes):
    by_scenario, dirs, _ = outcomes
    rank0, rank1 = by_scenario["deep"]
    assert rank0["outcome"] == rank1["outcome"] == f"restored {PREVIOUS}"
    assert [rank0["state_of"], rank1["state_of"]] == [0, 1]
    (event,) = rank0["quarantined"]
    assert event["name"] == NEWEST
    assert event["reason"].startswith("rank00001.shard: undecodable content (header nests")
    assert LocalStorage(dirs["deep"]).list_committed() == [PREVIOUS]


def test_cli_verify_and_inspect_report_the_same_problem_as_restore(outcomes, capsys):
    by_scenario, _, evidence = outcomes
    reason = by_scenario["deep"][0]["quarantined"][0]["reason"]
    problem = reason.split(": ", 1)[1]
    storage = LocalStorage(evidence)
    (check,) = [c for c in verify_checkpoint(storage, NEWEST).files if c.problem]
    assert (check.path, check.problem, check.digest_ok, check.decode_ok) == ("rank00001.shard", problem, True, False)
    (summary,) = [f for f in inspect_checkpoint(storage, NEWEST).files if f.problem]
    assert (summary.path, summary.problem) == ("rank00001.shard", problem)
    assert cli(["checkpoint", "verify", str(evidence)]) == 1
    assert f"rank00001.shard: {problem}" in capsys.readouterr().out
    assert cli(["checkpoint", "inspect", str(evidence)]) == 1
    assert f"PROBLEM   {problem}" in capsys.readouterr().out


def test_in_a_shared_directory_every_rank_reads_the_replicated_state_itself_in_place(outcomes):
    by_scenario, dirs, _ = outcomes
    rank0, rank1 = by_scenario["count"]
    assert rank0["outcome"] == rank1["outcome"] == f"restored {NEWEST}"
    size = {f["path"]: f["size"] for f in json.loads((dirs["count"] / NEWEST / "manifest.json").read_bytes())["files"]}
    assert rank0["reads"] == {"replicated.shard": size["replicated.shard"], "rank00000.shard": size["rank00000.shard"]}
    assert rank1["reads"] == {"replicated.shard": size["replicated.shard"], "rank00001.shard": size["rank00001.shard"]}
    assert rank1["model"] == rank0["model"] == [float(2 * i) for i in range(16)]
    assert [rank0["restored"][0]["read_bytes"], rank1["restored"][0]["read_bytes"]] == [
        size["replicated.shard"] + size["rank00000.shard"], size["replicated.shard"] + size["rank00001.shard"]]


def test_from_a_store_without_ranged_reads_the_replicated_state_is_read_once_and_sent_to_the_other_ranks(outcomes):
    by_scenario, dirs, _ = outcomes
    rank0, rank1 = by_scenario["count_shared"]
    assert rank0["outcome"] == rank1["outcome"] == f"restored {NEWEST}"
    manifest = json.loads((dirs["count_shared"] / NEWEST / "manifest.json").read_bytes())
    size = {f["path"]: f["size"] for f in manifest["files"]}
    assert rank0["reads"] == {"replicated.shard": size["replicated.shard"], "rank00000.shard": size["rank00000.shard"]}
    assert rank1["reads"] == {"rank00001.shard": size["rank00001.shard"]}, "rank 1 read the replicated state itself"
    assert rank1["model"] == rank0["model"] == [float(2 * i) for i in range(16)]
    assert [rank0["restored"][0]["read_bytes"], rank1["restored"][0]["read_bytes"]] == [
        size["replicated.shard"] + size["rank00000.shard"], size["rank00001.shard"]]