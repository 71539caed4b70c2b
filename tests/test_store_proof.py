"""Token proofs on the keys that change a run, and how agents agree on a launch; real etcd, real agents."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from resilient.coord.etcd import EtcdClient, EtcdConfig, EtcdControlStore
from resilient.coord.launch import LaunchRecord, begin_launch, decide_launch, end_launch
from resilient.coord.proof import SignedStore, sign, token_fingerprint, verify
from resilient.coord.store import MemoryControlStore
from resilient.core.exitcodes import EXIT_CONFIG, EXIT_PREEMPTED_AGENT

from .agent_helpers import agent_env, events, explain, node_status, run_agent, start_agent, wait_for

TOKEN = "a" * 64


def test_a_proof_binds_key_value_and_token() -> None:
    raw = sign(TOKEN, "launch/x/verdict", {"verdict": "crash_loop", "exit_code": 80})
    assert verify(TOKEN, "launch/x/verdict", raw).value == {"verdict": "crash_loop", "exit_code": 80}
    assert "wrong proof" in (verify("b" * 64, "launch/x/verdict", raw).problem or "")
    assert "wrong proof" in (verify(TOKEN, "launch/y/verdict", raw).problem or ""), "no replay under another key"
    altered = json.loads(raw)
    altered["body"]["exit_code"] = 0
    assert "wrong proof" in (verify(TOKEN, "launch/x/verdict", json.dumps(altered).encode()).problem or "")
    assert "no signed body" in (verify(TOKEN, "k", b'{"verdict": "x"}').problem or "")
    assert "no proof" in (verify(TOKEN, "k", b'{"body": {}}').problem or "")
    assert "not JSON" in (verify(TOKEN, "k", b"\xff").problem or "")
    # Whatever a writer without the token puts, reading it answers "forged" and raises nothing.
    for hostile in ('{"body": {}, "proof": "\u00e9"}'.encode(), b'{"body": {}, "proof": 7}',
                    b'{"body": ' + b'[' * 100000 + b']' * 100000 + b', "proof": "00"}',
                    b'{"body": {"a": ' + b'[' * 100000 + b']' * 100000 + b'}, "proof": "00"}', b'[]', b'"x"'):
        checked = verify(TOKEN, "k", hostile)
        assert checked.value is None and checked.problem, hostile[:40]
    assert token_fingerprint(TOKEN) == token_fingerprint(TOKEN) != token_fingerprint("b" * 64)
    assert TOKEN not in token_fingerprint(TOKEN)


def test_a_forged_entry_is_reported_once_and_cannot_block_the_real_one() -> None:
    rejected: list[tuple[str, str]] = []
    store = MemoryControlStore()
    signed = SignedStore(store, TOKEN, on_rejected=lambda key, problem: rejected.append((key, problem)))
    store.put("launch/x/stop", json.dumps({"stop_at_step": 0}).encode())
    assert signed.get("launch/x/stop") is None and signed.get("launch/x/stop") is None
    assert [k for k, _ in rejected] == ["launch/x/stop"]
    created, value = signed.put_if_absent("launch/x/stop", {"stop_at_step": 7})
    assert created and signed.get("launch/x/stop") == {"stop_at_step": 7}
    created, value = signed.put_if_absent("launch/x/stop", {"stop_at_step": 9})
    assert not created and value == {"stop_at_step": 7}, "a valid earlier entry wins"


def test_decide_launch_joins_a_running_launch_and_replaces_an_ended_one() -> None:
    running, ended = LaunchRecord("L1", "running"), LaunchRecord("L1", "ended", "preempted (node n0)")
    assert decide_launch(None, False, None, "L2").action == "create"
    assert decide_launch(running, False, None, "L2") == decide_launch(running, False, None, "L3")
    assert decide_launch(running, False, None, "L2").launch_id == "L1"
    d = decide_launch(ended, False, None, "L2")
    assert (d.action, d.launch_id) == ("replace", "L2") and "preempted (node n0)" in d.reason
    assert decide_launch(running, True, None, "L2").reason.endswith("it has a verdict)")
    assert decide_launch(running, False, "L1", "L2").action == "join"
    assert (decide_launch(running, False, "S9", "L2").action, decide_launch(running, False, "S9", "L2").launch_id) \
        == ("replace", "S9")


def test_agents_agree_on_one_launch_and_a_resubmission_starts_the_next(etcd_server, etcd_run_id) -> None:
    signed = SignedStore(EtcdControlStore.for_run(EtcdClient(EtcdConfig.from_url(etcd_server.url)), etcd_run_id),
                         TOKEN)
    first = begin_launch(signed)
    assert first.action == "create"
    assert begin_launch(signed) == type(first)("join", first.launch_id, f"launch {first.launch_id} is running")
    assert end_launch(signed, first.launch_id, "succeeded") and not end_launch(signed, first.launch_id, "again")
    second = begin_launch(signed)
    assert second.action == "replace" and second.launch_id != first.launch_id
    assert begin_launch(signed).launch_id == second.launch_id
    assert not end_launch(signed, first.launch_id, "a late agent of the old launch"), "cannot end the new launch"


def _flags(url: str, run_id: str) -> tuple[str, ...]:
    return ("--nnodes", "1", "--nproc-per-node", "1", "--store", url, "--run-id", run_id, "--node-id", "n0",
            "--local-addr", "127.0.0.1", "--rdzv-last-call", "0.5")


def _worker(tmp_path, steps: int, sleep: float) -> tuple[str, ...]:
    return ("--steps", str(steps), "--every", "5", "--dir", str(tmp_path / "ckpt"), "--trace", str(tmp_path / "trace"),
            "--step-sleep", str(sleep))


def _launch_id(store: EtcdControlStore) -> str:
    entry = store.get("launch")
    assert entry is not None
    return json.loads(entry.value)["body"]["id"]


def test_stop_and_verdict_written_without_the_token_are_ignored(tmp_path, etcd_server, etcd_run_id) -> None:
    run_dir = tmp_path / "run"
    agent = start_agent(run_dir, *_flags(etcd_server.url, etcd_run_id), script_args=_worker(tmp_path, 30, 0.1),
                        log=tmp_path / "agent.log")
    try:
        wait_for(lambda: (s := node_status(run_dir, "n0")) and any(r["step"] >= 3 for r in s["ranks"].values()),
                 timeout=120, what="the worker to pass step 3")
        store = EtcdControlStore.for_run(EtcdClient(EtcdConfig.from_url(etcd_server.url)), etcd_run_id)
        prefix = f"launch/{_launch_id(store)}/"
        # Anyone with write access to etcd, without the run token:
        store.put(prefix + "stop", json.dumps({"stop_at_step": 4, "reason": "forged", "node": "x"}).encode())
        store.put(prefix + "verdict", json.dumps(
            {"body": {"verdict": "crash_loop", "reason": "forged", "exit_code": 80, "node": "x"},
             "proof": "0" * 64}).encode())
        code = agent.wait(timeout=180)
    finally:
        agent.kill()
    assert code == 0, (tmp_path / "agent.log").read_text()[-3000:]
    rejected = {e["key"]: e["problem"] for e in events(run_dir, "forged_key")}
    assert set(rejected) == {prefix + "stop", prefix + "verdict"}, rejected
    assert "no signed body" in rejected[prefix + "stop"] and "wrong proof" in rejected[prefix + "verdict"]
    assert not events(run_dir, "stop_requested")
    [finished] = events(run_dir, "agent_finished")
    assert finished["verdict"] == "succeeded"


def test_resilient_stop_through_the_store_needs_the_token(tmp_path, etcd_server, etcd_run_id) -> None:
    run_dir = tmp_path / "run"
    agent = start_agent(run_dir, *_flags(etcd_server.url, etcd_run_id), script_args=_worker(tmp_path, 60, 0.1),
                        log=tmp_path / "agent.log")
    stop = [sys.executable, "-m", "resilient", "stop", "--store", etcd_server.url, "--run-id", etcd_run_id]
    try:
        wait_for(lambda: (s := node_status(run_dir, "n0")) and any(r["step"] >= 3 for r in s["ranks"].values()),
                 timeout=120, what="the worker to pass step 3")
        wrong = tmp_path / "wrong-token"
        wrong.write_text("b" * 64)
        wrong.chmod(0o600)
        for extra in ((), ("--token-file", str(wrong))):
            denied = subprocess.run([*stop, *extra], capture_output=True, text=True, timeout=60, env=agent_env(),
                                    check=False)
            assert denied.returncode == 2, denied
        assert "--token-file" in denied.stderr or "token" in denied.stderr
        # A refused stop writes nothing the agents could act on: no request under the launch, no stop.
        store = EtcdControlStore.for_run(EtcdClient(EtcdConfig.from_url(etcd_server.url)), etcd_run_id)
        prefix = f"launch/{_launch_id(store)}/"
        assert [k for k in ("stop_request", "stop") if store.get(prefix + k) is not None] == []
        assert agent.poll() is None and not events(run_dir, "stop_requested")
        ok = subprocess.run([*stop, "--token-file", str(run_dir / "token")], capture_output=True, text=True,
                            timeout=60, env=agent_env(), check=False)
        assert ok.returncode == 0, ok.stderr
        code = agent.wait(timeout=120)
    finally:
        agent.kill()
    assert code == EXIT_PREEMPTED_AGENT, (tmp_path / "agent.log").read_text()[-3000:]
    [request] = events(run_dir, "stop_requested")
    assert request["reason"] == "resilient stop"


def test_an_agent_with_another_token_fails_at_start_and_says_how_to_fix_it(tmp_path, etcd_server,
                                                                           etcd_run_id) -> None:
    store = EtcdControlStore.for_run(EtcdClient(EtcdConfig.from_url(etcd_server.url)), etcd_run_id)
    store.put("token_fingerprint", token_fingerprint(TOKEN).encode())  # the run's first agent held TOKEN
    proc = run_agent(tmp_path / "run", *_flags(etcd_server.url, etcd_run_id), script_args=_worker(tmp_path, 5, 0),
                     timeout=120)
    assert proc.returncode == EXIT_CONFIG, explain(proc)
    assert "different run token" in proc.stderr and "Copy <run_dir>/token" in proc.stderr, explain(proc)
    assert not events(tmp_path / "run", "workers_started")


@pytest.mark.parametrize("flag", ["--launch-id", "--token-file"])
def test_bad_launch_flags_are_named(tmp_path, flag) -> None:
    value = "a/b" if flag == "--launch-id" else str(tmp_path / "missing")
    proc = run_agent(tmp_path / "run", flag, value, script_args=("--steps", "1", "--trace", str(tmp_path / "t")),
                     timeout=60)
    assert proc.returncode == 2 and ("launch id 'a/b'" in proc.stderr or "token file" in proc.stderr), explain(proc)
