"""``resilient incident ls|show|bundle|release`` on a real run: one sample of the dataset raises when read.

The agent writes the incident (with the worker's error file, which carries where the run was in its data);
the CLI lists it with its id first and shows it whole, naming the failing step's samples, the bad one among
them; bundles it (logs, launch record, script and hash, position, the checkpoint before the failing step,
pinned, never the token); retention keeps the pinned checkpoint until the incident is released.  Unknown and
ambiguous ids are refused with the ids that exist.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from resilient.agent.incident_view import find, lines
from resilient.core.errors import ConfigError

from .agent_helpers import agent_env, run_agent

SCRIPT = '''
import os
import sys
import torch
import resilient

BAD = int(sys.argv[1])
STEPS = int(sys.argv[2])
MARKER = sys.argv[4]


class Samples:
    """32 samples; reading sample BAD raises while the file MARKER exists (the data is bad there)."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        if i == BAD and os.path.exists(MARKER):
            raise ValueError(f"sample {i} cannot be decoded")
        return torch.full((4,), float(i) / 32)


torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = resilient.ElasticLoader(Samples(), batch_size=4, seed=7)
ckpt = resilient.CheckpointConfig(dir=sys.argv[3], every_steps=2, keep=1, when_busy="wait")
with resilient.Run(model=model, optimizer=opt, data=data, checkpoint=ckpt) as run:
    for step in run.steps(STEPS):
        loss = model(next(run.data)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        run.report(loss=loss)
'''


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resilient", "incident", *args], capture_output=True, text=True,
                          timeout=60, env=agent_env(), check=False)


def test_an_incident_is_listed_by_id_and_shown_with_the_failing_steps_samples(tmp_path: Path) -> None:
    loader_order = __import__("resilient").ElasticLoader(list(range(32)), batch_size=4, seed=7)
    loader_order.bind(0, 1)
    bad = loader_order.indices_at(12, 1)[0]  # the first sample of step 3: steps 0-2 succeed
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    ckpt, marker = tmp_path / "ckpt", tmp_path / "bad-data"
    marker.touch()
    done = run_agent(run_dir, "--max-restarts", "0", script=script,
                     script_args=(str(bad), "8", str(ckpt), str(marker)))
    assert done.returncode != 0, done.stderr[-2000:]

    listed = cli("ls", str(run_dir))
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split()[:4] == ["ID", "TIME", "KIND", "STEP"] and len(rows) == 1, listed.stdout
    [record] = json.loads(cli("ls", str(run_dir), "--json").stdout)
    fields = rows[0].split()
    assert fields[0] == record["id"] and fields[2] == "exit" and fields[3] == "3", rows[0]
    # The loader names the sample and its stream position, with the dataset's own error.
    assert f"DataFetchError: ElasticLoader: dataset[{bad}] at stream position 12" in rows[0], rows[0]
    assert f"ValueError: sample {bad} cannot be decoded" in rows[0], rows[0]

    shown = cli("show", str(run_dir), record["id"][:5])  # a prefix only it has
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert f"first failure: resilient.core.errors.DataFetchError: ElasticLoader: dataset[{bad}]" in text, text
    assert "traceback:" in text and "__getitem__" in text
    step_samples = loader_order.indices_at(12, 4)
    assert "data at step 3: stream positions 12 to 15 (global batch 4, seed 0)" in text, text
    assert f"read samples {', '.join(map(str, step_samples))}" in text and bad in step_samples
    assert json.loads(cli("show", str(run_dir), record["id"], "--json").stdout) == record

    missing = cli("show", str(run_dir), "nope")
    assert missing.returncode == 2 and "no incident 'nope'" in missing.stderr and record["id"] in missing.stderr
    assert cli("ls", str(tmp_path / "elsewhere")).returncode == 2

    # The bundle: everything to investigate it elsewhere, and the checkpoint before step 3 (step 2), pinned.
    out = tmp_path / "b" / "incident.tar.gz"
    bundled = cli("bundle", str(run_dir), record["id"], "--out", str(out))
    assert bundled.returncode == 0, bundled.stderr
    assert f"into {out} (" in bundled.stdout and "checkpoint step_0000000002" in bundled.stdout, bundled.stdout
    with tarfile.open(out) as tar:
        files = {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    for name in ("incident.json", "bundle.json", "events.jsonl", "launch.json", "script/train.py",
                 "ranks/" + record["node"] + "/rank0.log", "ranks/" + record["node"] + "/rank0.error.json",
                 "checkpoint/step_0000000002/manifest.json"):
        assert name in files, (name, sorted(files))
    index = json.loads(files["bundle.json"])
    assert index["script"]["sha256"] == hashlib.sha256(SCRIPT.encode()).hexdigest()
    assert index["position"]["indices"] == step_samples and index["step"] == 3
    assert index["checkpoint"]["name"] == "step_0000000002" and index["checkpoint"]["copied"] is True
    launch = json.loads(files["launch.json"])
    assert launch["versions"]["resilient"] and launch["versions"]["torch"] and launch["entrypoint"][-4:] == [
        str(bad), "8", str(ckpt), str(marker)] and launch["settings"]["restart"]["max_restarts"] == 0
    token = (run_dir / "token").read_text().strip()
    assert not any(token.encode() in data for data in files.values()), "the run token is in the bundle"

    # Over the limit: referenced, not copied (and pinned all the same).
    ref = cli("bundle", str(run_dir), record["id"], "--out", str(tmp_path / "ref.tar.gz"), "--max-checkpoint-bytes", "10")
    assert ref.returncode == 0 and "referenced, not copied" in ref.stdout, ref.stdout
    with tarfile.open(tmp_path / "ref.tar.gz") as tar:
        assert not [m.name for m in tar.getmembers() if "/checkpoint/" in m.name]

    # Pinned: the same location trained on (a sample that reads fine) keeps only its newest commit and the pin.
    again = run_agent(tmp_path / "run2", "--max-restarts", "0", script=script,
                      script_args=("-1", "8", str(ckpt), str(marker)))
    assert again.returncode == 0, again.stderr[-2000:]
    kept = sorted(d.name for d in ckpt.iterdir() if d.name.startswith("step_"))
    assert kept == ["step_0000000002", "step_0000000008"], kept
    released = cli("release", str(run_dir), record["id"])
    assert released.returncode == 0 and "released step_0000000002" in released.stdout, released
    gc = subprocess.run([sys.executable, "-m", "resilient", "checkpoint", "gc", str(ckpt), "--keep", "1"],
                        capture_output=True, text=True, timeout=120, env=agent_env(), check=False)
    assert gc.returncode == 0, gc.stderr
    assert sorted(d.name for d in ckpt.iterdir() if d.name.startswith("step_")) == ["step_0000000008"]

    # Released and gone: a bundle now says there is no checkpoint to start from.
    none = cli("bundle", str(run_dir), record["id"], "--out", str(tmp_path / "none.tar.gz"))
    assert none.returncode == 0 and "no committed checkpoint at or before step 3" in none.stdout, none.stdout

    # Replayed from the bundle alone, from another directory: the run directory and every checkpoint gone.
    shutil.rmtree(run_dir)
    shutil.rmtree(ckpt)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Asked first: what would run, and nothing runs without --yes.
    asked = replay(out, "--workdir", str(tmp_path / "w0"), cwd=elsewhere, yes=False)
    sha = hashlib.sha256(SCRIPT.encode()).hexdigest()
    assert asked.returncode == 2 and "run this again with --yes" in asked.stderr, asked.stdout + asked.stderr
    assert f"sha256 {sha} (as the bundle recorded it); the same as the run's script at {script}" in asked.stdout
    assert not (tmp_path / "w0" / "results").exists() and not (tmp_path / "w0" / "rank0.log").exists()
    script.write_text(SCRIPT + "\n# edited since the run\n")
    asked = replay(out, "--workdir", str(tmp_path / "w0b"), cwd=elsewhere, yes=False)
    assert f"DIFFERENT from the run's script at {script} (changed since the run?)" in asked.stdout, asked.stdout
    replayed = replay(out, "--workdir", str(tmp_path / "w1"), cwd=elsewhere)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    text = replayed.stdout
    assert "from step_0000000002 (copied in the bundle)" in text, text
    assert f"reproduced: rank 0 raised DataFetchError: ElasticLoader: dataset[{bad}]" in text
    assert "at step 3" in text and f"samples of step 3 on rank 0: {step_samples} (the same as the run's)" in text
    # The data fixed (the marker gone): the step goes through, and the replay says so with exit 1.
    marker.unlink()
    fixed = replay(out, "--workdir", str(tmp_path / "w2"), cwd=elsewhere)
    assert fixed.returncode == 1 and "not reproduced: every rank ran through step 3 without it" in fixed.stdout, \
        fixed.stdout + fixed.stderr


def test_an_id_prefix_names_one_incident_or_is_refused_naming_them() -> None:
    records = [{"id": "g0001-n1-rank0-exit", "kind": "exit", "step": 3, "summary": "s", "wall_time": 0.0},
               {"id": "g0001-n1-rank1-exit", "kind": "exit", "step": 3, "summary": "t", "wall_time": 1.0},
               {"id": "g0002-n1-lost", "kind": "node_lost", "step": None, "summary": "node n1 was lost",
                "wall_time": 2.0}]
    assert find(records, "g0002", Path("r"))["id"] == "g0002-n1-lost"
    assert find(records, "g0001-n1-rank1-exit", Path("r"))["summary"] == "t"
    with pytest.raises(ConfigError, match="names 2 incidents"):
        find(records, "g0001", Path("r"))
    out = lines(records, width=60)
    assert all(len(line) <= 60 for line in out) and out[3].startswith("g0002-n1-lost") and " - " in out[3]


def replay(bundle: Path, *args: str, cwd: Path, yes: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resilient", "incident", "replay", str(bundle), *args,
                           *(["--yes"] if yes else [])],
                          capture_output=True, text=True, timeout=300, env=agent_env(), cwd=cwd, check=False)



NAN_SCRIPT = '''
import sys
import torch
import resilient

BAD = int(sys.argv[1])


class Samples:
    """32 samples; sample BAD is NaN on every read (bad data: every try of its step is non-finite)."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.full((4,), float("nan") if i == BAD else float(i) / 32)


torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = resilient.ElasticLoader(Samples(), batch_size=2, seed=7)
# Synchronous: step 2's checkpoint is committed before step 3 starts (an asynchronous save commits once both ranks
# have written it, and rank 1 may die at step 3 first: the bundle would then have no checkpoint to start from).
ckpt = resilient.CheckpointConfig(dir=sys.argv[2], every_steps=2, when_busy="wait", async_save=False)
with resilient.Run(model=model, optimizer=opt, data=data, checkpoint=ckpt, ddp=True) as run:
    for step in run.steps(8):
        with run.attempt():
            for x in run.micro_batches():
                loss = run.model(x).pow(2).mean()
                loss.backward()
            opt.step()
            opt.zero_grad()
            run.report(loss=loss)
'''


def test_a_persistent_nan_on_two_ranks_is_bundled_and_replayed_on_two_ranks(tmp_path: Path) -> None:
    """The issue's other case: a poisoned sample, NaN on every read, under DDP on two ranks: the run stops with
    exit 79 at step 3.  After the all-reduce both ranks hold the NaN and both raise; the incident names rank 1,
    whose own backward made it (its sample), and calls rank 0's error a consequence.  The bundle, replayed with
    the run directory and checkpoints gone, fails the same way at the same step on the same samples."""
    order = __import__("resilient").ElasticLoader(list(range(32)), batch_size=2, seed=7)
    order.bind(0, 2)
    bad = order.indices_at(14, 1)[0]  # step 3's third sample (a global batch of 4): rank 1's first
    script = tmp_path / "train.py"
    script.write_text(NAN_SCRIPT)
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    done = run_agent(run_dir, "--nproc-per-node", "2", "--max-restarts", "0", script=script,
                     script_args=(str(bad), str(ckpt)))
    assert done.returncode == 79, done.stderr[-3000:]
    [record] = json.loads(cli("ls", str(run_dir), "--json").stdout)
    assert record["step"] == 3 and record["error"]["exc_type"].endswith("PersistentNonFiniteError"), record
    # The rank whose samples made the NaN, though the lower rank raised the same error at the same moment.
    assert record["rank"] == 1 and record["error"]["own_nonfinite"] is True, record
    assert "This rank's own backward made them not finite" in record["error"]["message"], record
    [other] = record["other_failures"]  # rank 0 raised the same (its own gradients were finite), or was stopped
    assert other.startswith("rank 0 on ") and (": consequence: PersistentNonFiniteError" in other
                                               or ": stopped by the agent" in other), other
    out = tmp_path / "nan.tar.gz"
    assert cli("bundle", str(run_dir), record["id"], "--out", str(out)).returncode == 0
    shutil.rmtree(run_dir)
    shutil.rmtree(ckpt)
    replayed = replay(out, "--workdir", str(tmp_path / "w"), cwd=tmp_path)
    text = replayed.stdout
    assert replayed.returncode == 0, text + replayed.stderr
    assert "on 2 rank(s) from step_0000000002 (copied in the bundle)" in text, text
    assert "PersistentNonFiniteError: step 3: the gradients were not finite in 3 tries" in text and "at step 3" in text
    assert f"samples of step 3 on rank {record['rank']}:" in text and "(the same as the run's)" in text, text
    # On one rank the loader splits the same global batch into micro-batches: that rank reads the poisoned sample
    # with the rest, the same error comes back at the same step, and the replay says what one rank cannot show.
    alone = replay(out, "--ranks", "1", "--workdir", str(tmp_path / "w1"), cwd=tmp_path)
    text = alone.stdout
    assert alone.returncode == 0, text + alone.stderr
    assert "on 1 rank(s) from step_0000000002" in text and "note: the run had 2 ranks; on 1" in text, text
    assert "reproduced: rank 0 raised PersistentNonFiniteError: step 3" in text, text
    found = re.search(r"samples of step 3 on rank 0: \[([\d, ]+)\] \(the run's rank 1 read \[([\d, ]+)\]\)", text)
    assert found and bad in [int(i) for i in found.group(1).split(",")], text
    assert [int(i) for i in found.group(2).split(",")] == order.indices_at(14, 2), text


def _hand_made_bundle(tmp_path: Path, name: str, body: bytes, recorded: str | None = None) -> Path:
    """A bundle written by hand: its index names ``name`` as the script, with ``recorded`` as its SHA-256."""
    top = tmp_path / "made"
    (top / "script").mkdir(parents=True)
    if "/" not in name and name not in ("", ".", ".."):
        (top / "script" / name).write_bytes(body)
    index = {"script": {"name": name, "path": "/nowhere/train.py",
                        "sha256": recorded or hashlib.sha256(body).hexdigest()}}
    (top / "bundle.json").write_text(json.dumps(index))
    (top / "incident.json").write_text(json.dumps({"id": "g0001-n0", "step": 3, "kind": "exit"}))
    (top / "launch.json").write_text(json.dumps({"entrypoint": ["python", "train.py"]}))
    out = tmp_path / f"made-{len(list(tmp_path.glob('made-*')))}.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        tar.add(top, arcname="bundle")
    shutil.rmtree(top)
    return out


@pytest.mark.parametrize("name", ["/bin/sh", "../../outside.py", "sub/train.py", ".."])
def test_a_bundle_whose_script_name_is_a_path_is_refused(tmp_path: Path, name: str) -> None:
    from resilient.agent.incident_replay import prepare

    with pytest.raises(ConfigError, match="not a bare file name"):
        prepare(_hand_made_bundle(tmp_path, name, b"print('hi')\n"), workdir=tmp_path / "w")


def test_a_bundle_whose_script_was_changed_after_it_was_written_is_refused(tmp_path: Path) -> None:
    from resilient.agent.incident_replay import prepare

    bundle = _hand_made_bundle(tmp_path, "train.py", b"import os; os.system('id')\n",
                               recorded=hashlib.sha256(b"print('the original')\n").hexdigest())
    with pytest.raises(ConfigError, match="does not match the SHA-256 the bundle recorded"):
        prepare(bundle, workdir=tmp_path / "w")
    fine = prepare(_hand_made_bundle(tmp_path, "train.py", b"print('hi')\n"), workdir=tmp_path / "w2")
    assert "the run's script /nowhere/train.py is not on this host" in "\n".join(fine.lines)


def test_a_replayed_script_sees_neither_secrets_nor_the_callers_directory(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks run in the work directory with only KEPT_ENV of the caller's environment: no etcd password, no
    cloud credentials, no run token or settings."""
    from resilient.agent.incident_replay import KEPT_ENV, _run

    for name in ("RESILIENT_ETCD_PASSWORD", "AWS_SECRET_ACCESS_KEY", "API_TOKEN"):
        monkeypatch.setenv(name, "s3cr3t")
    monkeypatch.setenv("LANG", "C.UTF-8")
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    show = "import json, os; print(json.dumps({'cwd': os.getcwd(), 'env': dict(os.environ)}))"
    assert _run([sys.executable, "-c", show], 1, work / "replay.json", work, timeout_s=60) == [0]
    seen = json.loads((work / "rank0.log").read_text())
    assert seen["cwd"] == str(work)
    assert "s3cr3t" not in json.dumps(seen["env"]) and seen["env"]["LANG"] == "C.UTF-8"
    ranks = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RESILIENT_REPLAY"}
    assert set(seen["env"]) <= set(KEPT_ENV) | ranks | {"LC_CTYPE", "PWD", "SHLVL", "_"}, sorted(seen["env"])
