"""``resilient checkpoint ls|verify|inspect|gc`` on checkpoints written by a real Run."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import resilient
from resilient.checkpoint.inspect import collect, list_checkpoints, verify_checkpoint
from resilient.checkpoint.manifest import parse_manifest
from resilient.checkpoint.storage import LocalStorage
from resilient.cli.checkpoint_cmd import ENDPOINT_ENV, human_size, resolve_endpoint
from resilient.cli.main import main
from resilient.core.errors import CheckpointMismatchError, StorageError

NAMES = ["step_0000000002", "step_0000000004", "step_0000000006"]
NEWEST = NAMES[-1]


def _train(directory: Path | str, endpoint_url: str | None = None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = resilient.ElasticLoader([torch.randn(4) for _ in range(16)], batch_size=2)
    run = resilient.Run(
        model=model,
        optimizer=optimizer,
        data=data,
        # when_busy="wait": a save at each scheduled step, the NAMES the tests expect, whatever the load
        checkpoint=resilient.CheckpointConfig(dir=directory, every_steps=2, keep=5, endpoint_url=endpoint_url,
                                              when_busy="wait"),
    )
    for _ in run.steps(6):
        loss = model(next(data)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        run.report(loss=loss)
    run.close()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("pristine") / "ckpt"
    _train(directory)
    assert LocalStorage(directory).list_committed() == NAMES
    return directory


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    """A private copy each test may damage."""
    return Path(shutil.copytree(pristine, tmp_path / "ckpt"))


def _flip(path: Path, offset: int | None = None) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2 if offset is None else offset % size)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x40]))


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["checkpoint", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------ ls
def test_ls_lists_every_checkpoint(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, "ls", str(ckpt))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["NAME", "STEP", "WORLD", "SIZE", "FILES"]
    for name in NAMES:
        row = next(line for line in lines if line.startswith(name))
        assert row.split()[-1] == "ok" and "KiB" in row
    assert "quarantined: 0" in out


def test_ls_json_and_quarantine_line(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    where = LocalStorage(ckpt).quarantine(NAMES[0], "test")
    code, out, _ = _cli(capsys, "ls", str(ckpt), "--json")
    body = json.loads(out)
    assert code == 0
    assert [c["name"] for c in body["checkpoints"]] == NAMES[1:]
    assert body["checkpoints"][-1]["parent"] == NAMES[1] and body["checkpoints"][-1]["manifest_ok"]
    assert body["quarantined"] == [os.path.basename(where)]
    code, out, _ = _cli(capsys, "ls", str(ckpt))
    assert f"quarantined: 1 ({os.path.basename(where)})" in out


def test_ls_marks_bad_manifest_instead_of_failing(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (ckpt / NAMES[1] / "manifest.json").write_bytes(b"{not json")
    (ckpt / NAMES[0] / "manifest.json").unlink()
    infos = list_checkpoints(LocalStorage(ckpt))
    assert [i.manifest_ok for i in infos] == [False, False, True]
    assert infos[0].problem == "manifest is missing" and "not valid JSON" in (infos[1].problem or "")
    code, out, _ = _cli(capsys, "ls", str(ckpt))
    assert code == 0 and "BAD: not valid JSON" in out


# -------------------------------------------------------------------- verify
def test_verify_newest_ok(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, "verify", str(ckpt))
    assert code == 0
    assert f"OK {NEWEST}" in out and NAMES[0] not in out
    assert "FILE" in out and "replicated.shard" in out and "rank00000.shard" in out


def test_verify_all_and_by_step(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, "verify", str(ckpt), "--all")
    assert code == 0 and all(f"OK {n}" in out for n in NAMES) and "3 checkpoints: 3 ok, 0 failed" in out
    code, out, _ = _cli(capsys, "verify", str(ckpt), "4")
    assert code == 0 and f"OK {NAMES[1]}" in out


def test_flipped_byte_fails_digest(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _flip(ckpt / NEWEST / "rank00000.shard")
    code, out, _ = _cli(capsys, "verify", str(ckpt))
    assert code == 1
    verdict = out.splitlines()[-1]
    assert verdict.startswith(f"FAILED {NEWEST}") and "rank00000.shard" in verdict and "digest" in verdict


def test_flip_in_tensor_bytes_decodes_but_fails_digest(ckpt: Path) -> None:
    _flip(ckpt / NEWEST / "replicated.shard", offset=-1)  # last byte: tensor data, not the header
    report = verify_checkpoint(LocalStorage(ckpt), NEWEST)
    (check,) = [c for c in report.files if c.path == "replicated.shard"]
    assert not report.ok and check.digest_ok is False and check.decode_ok is True
    assert check.size_actual == check.size_expected


def test_truncated_file_is_a_size_problem(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = ckpt / NEWEST / "replicated.shard"
    os.truncate(path, path.stat().st_size - 10)
    code, out, _ = _cli(capsys, "verify", str(ckpt))
    assert code == 1
    assert "replicated.shard: size is" in out and "truncated" in out
    row = next(line for line in out.splitlines() if line.startswith("replicated.shard"))
    assert "!=" in row and "BAD" in row


def test_missing_file(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (ckpt / NEWEST / "rank00000.shard").unlink()
    code, out, _ = _cli(capsys, "verify", str(ckpt))
    assert code == 1
    assert "rank00000.shard: file is missing" in out
    assert "missing" in next(line for line in out.splitlines() if line.startswith("rank00000.shard"))


def test_manifest_with_escaping_path(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Re-encode through Manifest so the manifest is self-consistent except for the path.
    mpath = ckpt / NEWEST / "manifest.json"
    manifest = parse_manifest(mpath.read_bytes(), NEWEST)
    files = (dataclasses.replace(manifest.files[0], path="../x"), *manifest.files[1:])
    mpath.write_bytes(dataclasses.replace(manifest, files=files).to_bytes())
    assert json.loads(mpath.read_bytes())["files"][0]["path"] == "../x"
    code, out, _ = _cli(capsys, "verify", str(ckpt), "--all")
    assert code == 1
    assert "manifest.json" in out and "'../x' is not a plain relative path" in out
    assert "2 ok, 1 failed" in out


def test_verify_storage_error_propagates(ckpt: Path) -> None:
    class Broken(LocalStorage):
        def read_file(self, name: str, path: str, spec: object) -> tuple[bytearray, object]:
            raise StorageError(f"could not read {path}: Input/output error")

    with pytest.raises(StorageError):
        verify_checkpoint(Broken(ckpt), NEWEST)


# ------------------------------------------------------------------- inspect
def test_inspect_shows_counters_and_keys(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, "inspect", str(ckpt))
    assert code == 0
    assert out.splitlines()[0].split() == ["checkpoint", NEWEST]
    assert "counters  step=6 samples=12 tokens=0" in out
    assert "resilient.checkpoint/4, xxh3-128-chunked in 4.0 MiB blocks, each listed" in out
    assert "consumed=12" in out
    for key in ("model", "optimizer", "rng", "data", "counters", "fingerprint.model"):
        assert key in out


def test_inspect_json(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, "inspect", str(ckpt), NAMES[0], "--json")
    body = json.loads(out)
    assert code == 0 and body["manifest"]["name"] == NAMES[0] and body["manifest"]["counters"]["step"] == 2
    files = {f["path"]: f for f in body["files"]}
    assert files["rank00000.shard"]["counters"] == {"step": 2, "samples": 4, "tokens": 0}
    assert files["rank00000.shard"]["data"]["consumed"] == 4
    assert files["replicated.shard"]["keys"] == ["model", "optimizer", "scheduler", "scaler", "step"]
    assert files["replicated.shard"]["sections"]["model"][0] == 2  # weight and bias


def test_inspect_bad_manifest_exits_1(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (ckpt / NEWEST / "manifest.json").write_bytes(b"[]")
    code, _, err = _cli(capsys, "inspect", str(ckpt))
    assert code == 1 and "manifest.json: not a JSON object" in err


# ------------------------------------------------------------------------ gc
def test_gc_dry_run_removes_nothing(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, "gc", str(ckpt), "--keep", "1", "--dry-run")
    assert code == 0
    assert LocalStorage(ckpt).list_committed() == NAMES
    assert f"would delete {NAMES[0]}" in out and "dry run" in out


def test_gc_keeps_newest(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    crashed = ckpt / ".staging" / "step_0000000008.deadbeef"
    crashed.mkdir(parents=True)
    (crashed / "rank_00000.bin").write_bytes(b"x")
    for path in (crashed / "rank_00000.bin", crashed):
        os.utime(path, (time.time() - 7200, time.time() - 7200))  # a save that crashed two hours ago
    live = ckpt / ".staging" / "step_0000000009.cafe"
    live.mkdir()
    code, out, _ = _cli(capsys, "gc", str(ckpt), "--keep", "1")
    assert code == 0
    assert LocalStorage(ckpt).list_committed() == [NEWEST]
    assert f"deleted      {NAMES[0]}" in out and "removed 1 leftovers" in out
    assert os.listdir(ckpt / ".staging") == [live.name], "a save written to a moment ago may be under way"
    assert "skipped      .staging/step_0000000009.cafe  (written 0 s ago, within the minimum age of 3600 s" in out
    code, out, _ = _cli(capsys, "gc", str(ckpt), "--keep", "1", "--min-age", "0")
    assert code == 0 and os.listdir(ckpt / ".staging") == [] and "removed 1 leftovers" in out


def test_gc_permanent_every(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, "gc", str(ckpt), "--keep", "1", "--permanent-every", "4")
    assert code == 0 and LocalStorage(ckpt).list_committed() == [NAMES[1], NEWEST]
    assert "step multiple of 4" in out


def test_gc_protects_newest_verified_when_newest_is_corrupt(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _flip(ckpt / NEWEST / "replicated.shard")
    code, out, _ = _cli(capsys, "gc", str(ckpt), "--keep", "1")
    assert code == 0
    # keep=1 keeps the newest by name (corrupt) *and* the newest that verifies.
    assert LocalStorage(ckpt).list_committed() == [NAMES[1], NEWEST]
    assert f"newest verified: {NAMES[1]}" in out and f"failed verification: {NEWEST}" in out


def test_gc_deletes_nothing_when_nothing_verifies(ckpt: Path) -> None:
    for name in NAMES:
        (ckpt / name / "rank00000.shard").unlink()
    report = collect(LocalStorage(ckpt), keep=1, permanent_every=None, dry_run=False)
    assert report.deleted == () and report.newest_verified is None and len(report.failed) == 3
    assert "deleting nothing" in report.reason
    assert LocalStorage(ckpt).list_committed() == NAMES


def test_gc_refuses_when_a_newer_version_wrote_a_checkpoint(ckpt: Path) -> None:
    class Newer(LocalStorage):
        def read_manifest(self, name: str) -> bytes:
            if name == NAMES[0]:
                raise CheckpointMismatchError(f"checkpoint {name} uses schema 'resilient.checkpoint/2'")
            return super().read_manifest(name)

    with pytest.raises(CheckpointMismatchError, match="not collecting garbage"):
        collect(Newer(ckpt), keep=1, permanent_every=None, dry_run=False)
    assert LocalStorage(ckpt).list_committed() == NAMES
    assert "schema" in (list_checkpoints(Newer(ckpt))[0].problem or "")
    assert not verify_checkpoint(Newer(ckpt), NAMES[0]).ok


# -------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "argv, message",
    [
        (["ls", "{missing}"], "no checkpoint directory at"),
        (["ls", "ftp://host/x"], "unsupported checkpoint location"),
        (["verify", "{ckpt}", "step_0000000099"], "no committed checkpoint named step_0000000099"),
        (["verify", "{ckpt}", "2", "--all"], "not both"),
        (["gc", "{ckpt}", "--keep", "0"], "keep at least 1"),
        (["verify", "{empty}"], "no committed checkpoints in"),
    ],
)
def test_usage_and_storage_errors_exit_2(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    (tmp_path / "empty").mkdir()
    paths = {"ckpt": ckpt, "missing": tmp_path / "nope", "empty": tmp_path / "empty"}
    code, _, err = _cli(capsys, *[a.format(**paths) for a in argv])
    assert code == 2
    assert err.startswith("resilient: error: ") and message in err


def test_argparse_usage_error_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoint", "gc", "/tmp"]) == 2  # --keep is required
    assert "--keep" in capsys.readouterr().err
    assert main(["--help"]) == 0


def test_endpoint_flag_beats_environment() -> None:
    env = {ENDPOINT_ENV: "http://env:9000"}
    assert resolve_endpoint("http://flag:9000", env) == "http://flag:9000"
    assert resolve_endpoint(None, env) == "http://env:9000"
    assert resolve_endpoint(None, {}) is None


def test_human_size() -> None:
    assert [human_size(n) for n in (0, 1023, 1024, 5 << 20, 3 << 30)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "5.0 MiB",
        "3.0 GiB",
    ]


def test_python_dash_m(pristine: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != ENDPOINT_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "resilient", "checkpoint", "ls", str(pristine)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert all(name in proc.stdout for name in NAMES)


def test_ls_does_not_import_torch(pristine: Path) -> None:
    """Listing reads manifests only; importing torch would cost seconds per call."""
    code = (
        "import sys\n"
        "from resilient.cli.main import main\n"
        f"assert main(['checkpoint', 'ls', {str(pristine)!r}]) == 0\n"
        "print('TORCH', 'torch' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != ENDPOINT_ENV}
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert NEWEST in proc.stdout and "TORCH False" in proc.stdout


def test_s3_location_with_endpoint_from_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import boto3
    import moto.server as server_mod  # both are in the dev extras: the suite never skips

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket="ckpts")
        _train("s3://ckpts/run", endpoint_url=endpoint)
        monkeypatch.setenv(ENDPOINT_ENV, endpoint)  # no --endpoint-url: the environment supplies it
        code, out, _ = _cli(capsys, "ls", "s3://ckpts/run")
        assert code == 0 and all(name in out for name in NAMES)
        code, out, _ = _cli(capsys, "verify", "s3://ckpts/run", "--all")
        assert code == 0 and "3 ok, 0 failed" in out
        # An explicit flag beats the environment (which now names a dead endpoint).
        monkeypatch.setenv(ENDPOINT_ENV, "http://127.0.0.1:9")
        code, out, _ = _cli(capsys, "ls", "s3://ckpts/run", "--endpoint-url", endpoint)
        assert code == 0 and NEWEST in out
        monkeypatch.setenv(ENDPOINT_ENV, endpoint)
        # Damage one object of the newest checkpoint: verify names it, gc keeps the newest verified.
        key = next(
            o["Key"]
            for o in client.list_objects_v2(Bucket="ckpts", Prefix=f"run/{NEWEST}/")["Contents"]
            if o["Key"].endswith("replicated.shard")
        )
        body = bytearray(client.get_object(Bucket="ckpts", Key=key)["Body"].read())
        body[len(body) // 2] ^= 0x40
        client.put_object(Bucket="ckpts", Key=key, Body=bytes(body))
        code, out, _ = _cli(capsys, "verify", "s3://ckpts/run")
        assert code == 1 and "replicated.shard" in out.splitlines()[-1] and "digest" in out
        code, out, _ = _cli(capsys, "gc", "s3://ckpts/run", "--keep", "1")
        assert code == 0
        code, out, _ = _cli(capsys, "ls", "s3://ckpts/run", "--json")
        assert [c["name"] for c in json.loads(out)["checkpoints"]] == [NAMES[1], NEWEST]
    finally:
        server.stop()
