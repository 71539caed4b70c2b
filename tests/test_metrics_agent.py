"""The agent's /metrics and the goodput report, on real runs with a real crash and a real agent restart."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import urllib.request

from resilient.core.exitcodes import EXIT_PREEMPTED_AGENT
from resilient.metrics.catalogue import BADPUT_CATEGORIES, METRICS
from resilient.watchdog.stacks import process_state

from .agent_helpers import events, explain, node_status, run_agent, start_agent, wait_for

NODE = "n0"


def _worker(tmp_path, steps: int, *extra: str) -> tuple[str, ...]:
    return ("--steps", str(steps), "--every", "5", "--dir", str(tmp_path / "ckpt"), "--trace", str(tmp_path / "t"),
            *extra)


AFTER_BASELINE = {"resilient_slowdown_ratio", "resilient_baseline_step_seconds"}
"""Known only once the slowdown detector has its baseline (220 steps): scraped in tests/test_stragglers_live.py."""


def _scrape(url: str) -> dict[str, float]:
    """Sample name with sorted labels -> value."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def _value(samples: dict[str, float], name: str, **labels: str) -> float:
    found = [v for k, v in samples.items() if k.split("{")[0] == name
             and all(f'{lk}="{lv}"' in k for lk, lv in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_metrics_during_a_run_with_a_crash_and_the_goodput_report(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "seed": 0, "faults": [
        {"kind": "kill", "rank": 1, "step": 12, "attempt": 0, "section": "step"}]}))
    run_dir = tmp_path / "run"
    agent = start_agent(run_dir, "--nproc-per-node", "2", "--node-id", NODE, "--run-id", "metrics",
                        "--metrics-port", "0", "--fault-plan", str(plan), "--flops-per-step", "2e6",
                        "--peak-tflops", "0.001",
                        script_args=_worker(tmp_path, 60, "--step-sleep", "0.05"), log=tmp_path / "agent.log")
    try:
        # The run directory exists before the first event is written: wait for the file, not the directory.
        [listening] = wait_for(lambda: events(run_dir, "metrics_listening") if (run_dir / "events.jsonl").exists()
                               else None, timeout=60, what="the metrics server")
        assert listening["url"].startswith("http://127.0.0.1:")
        # Straggler scores exist from the third timing window of a generation on (two are its warm-up): wait
        # for them, not for a step count, which the restore point and the status file's 1 s lag move about.
        wait_for(lambda: (s := node_status(run_dir, NODE)) and s["generation"] == 2
                 and any(r["step"] >= 20 for r in s["ranks"].values()) and (s.get("slowness") or {}).get("scores"),
                 timeout=120, what="the restarted run, scored")
        samples = _scrape(listening["url"])
    finally:
        code = agent.wait(timeout=120)
    assert code == 0, (tmp_path / "agent.log").read_text()[-3000:]

    names = {k.split("{")[0] for k in samples}
    for metric in METRICS:
        if metric.name in AFTER_BASELINE:
            continue
        wanted = f"{metric.name}_count" if metric.type == "histogram" else metric.name
        assert wanted in names, f"{wanted} missing from the scrape"
    labels = {"run_id": "metrics", "node": NODE}
    # MFU: new steps x FLOPs per step over (their time x peak of the 2 devices), from the same account.
    new_steps = (_value(samples, "resilient_attempted_steps_total", **labels)
                 - _value(samples, "resilient_replayed_steps_total", **labels))
    busy = _value(samples, "resilient_goodput_seconds_total", **labels) + sum(
        _value(samples, "resilient_badput_seconds_total", category=c, **labels) for c in ("slowdown_excess", "degraded"))
    assert _value(samples, "resilient_peak_flops", **labels) == 2e9
    assert math.isclose(_value(samples, "resilient_mfu_ratio", scope="run", **labels),
                        2e6 * new_steps / (busy * 2e9), rel_tol=1e-9)
    # The run is shorter than the rolling hour: the window holds all of it, so its MFU is the run's.
    assert math.isclose(_value(samples, "resilient_mfu_ratio", scope="window", **labels),
                        _value(samples, "resilient_mfu_ratio", scope="run", **labels), rel_tol=1e-9)
    wall = _value(samples, "resilient_wall_seconds_total", **labels)
    parts = _value(samples, "resilient_goodput_seconds_total", **labels) + sum(
        _value(samples, "resilient_badput_seconds_total", category=c, **labels) for c in BADPUT_CATEGORIES)
    assert math.isclose(parts, wall, rel_tol=1e-9), (parts, wall)  # one scrape, one account
    assert _value(samples, "resilient_restarts_total", reason="signal", **labels) == 1
    assert _value(samples, "resilient_incidents_total", kind="signal", **labels) == 1
    assert _value(samples, "resilient_generation", **labels) == 2
    # The steps from what the restart restored (the memory tier's newest step every rank held, or the durable
    # commit of step 10 when that is newer) up to the failure were rolled back and trained again.
    [restored] = [e for e in events(run_dir, "restored") if e["generation"] == 2]
    replayed = 12 - (restored["step"] or 0)
    assert restored["step"] in range(10, 13), restored  # the tier's interval is chosen from the measured cost
    assert 0 < _value(samples, "resilient_memory_tier_bytes", **labels) <= _value(
        samples, "resilient_memory_tier_limit_bytes", **labels)
    assert _value(samples, "resilient_replayed_steps_total", **labels) == 12 - (restored["step"] or 0), restored
    assert _value(samples, "resilient_step_duration_seconds_count", rank="1", **labels) >= 20
    assert _value(samples, "resilient_committed_tokens_total", **labels) < _value(
        samples, "resilient_attempted_tokens_total", **labels)

    report = subprocess.run([sys.executable, "-m", "resilient", "report", "goodput", str(run_dir)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert report.returncode == 0, report.stderr
    out = report.stdout
    assert "incident g0001-n0 (signal) cost" in out and "to detect" in out and "replayed" in out
    assert "rank 1 on n0: killed by SIGKILL in section 'step' at step 12" in out
    data = json.loads((run_dir / "goodput.json").read_text())
    account = data["nodes"][NODE]
    assert math.isclose(sum(account["seconds"].values()), account["wall_s"], rel_tol=1e-9)
    assert account["committed_step"] == 60 and account["replayed_steps"] == replayed
    [cost] = account["incidents"]
    assert cost["detection_s"] > 0 and cost["recovery_s"] > 0 and (cost["replay_s"] > 0) == (replayed > 0)
    assert math.isclose(cost["total_s"], cost["detection_s"] + cost["recovery_s"] + cost["replay_s"], rel_tol=1e-9)
    assert (run_dir / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_account_continues_across_agent_restarts(tmp_path):
    """Preempt the agent mid-run, start it again on the same run directory: one continuous account.

    The preemption must land before the run's last step, or the second agent
    has nothing left to train.  Waiting for a step in status.json and then
    sending SIGTERM raced with the run (status is published every second and
    the whole run takes about two): the stop step (furthest step seen + 2)
    sometimes was the last one.  So the worker stops itself (SIGSTOP) at step
    10, the agent is preempted while it cannot move on, and the worker is
    resumed only once the agent has chosen the stop step.
    """
    run_dir = tmp_path / "run"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "seed": 0, "faults": [
        {"kind": "sigstop", "rank": 0, "step": 10, "attempt": 0, "section": "step"}]}))
    args = _worker(tmp_path, 30, "--step-sleep", "0.05")
    flags = ("--nproc-per-node", "1", "--node-id", NODE, "--run-id", "again", "--fault-plan", str(plan),
             "--section-timeout", "step=100000")  # the stopped worker is not a hang to recover from
    agent = start_agent(run_dir, *flags, script_args=args, log=tmp_path / "first.log")
    try:
        [started] = wait_for(lambda: events(run_dir, "workers_started") if (run_dir / "events.jsonl").exists()
                             else None, timeout=120, what="the workers")
        pid = started["pids"]["0"]
        wait_for(lambda: process_state(pid) == "stopped", timeout=120, what="the worker stopping itself at step 10")
        agent.send_signal(signal.SIGTERM)
        [request] = wait_for(lambda: events(run_dir, "stop_requested"), timeout=60, what="the stop request")
        assert request["stop_at_step"] < 30, request
        os.kill(pid, signal.SIGCONT)
        assert agent.wait(timeout=90) == EXIT_PREEMPTED_AGENT, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        agent.kill()
    first = json.loads((run_dir / "nodes" / NODE / "ledger.json").read_text())
    proc = run_agent(run_dir, *flags, script_args=args)
    assert proc.returncode == 0, explain(proc)

    from resilient.metrics.ledger import Ledger

    saved = json.loads((run_dir / "nodes" / NODE / "ledger.json").read_text())
    before = Ledger.from_dict(first["ledger"]).account(Ledger.from_dict(first["ledger"]).last_t)
    ledger = Ledger.from_dict(saved["ledger"])
    after = ledger.account(ledger.last_t)
    assert after.wall_s > before.wall_s and after.seconds["productive"] > before.seconds["productive"]
    assert after.seconds["idle"] > 0, "the gap between the two agents is idle time"
    assert after.committed_step == 30
    assert [e["generation"] for e in events(run_dir, "workers_started")] == [1, 2], "numbering continues"
    assert after.attempted_steps - after.replayed_steps == 30, "every step counted once as progress"
    assert math.isclose(sum(after.seconds.values()), after.wall_s, rel_tol=1e-9)


def test_saves_deferred_by_a_busy_writer_reach_the_account_the_metrics_and_the_report(tmp_path):
    """A slow disk (every file write takes 0.3 s) and a save due every 2 steps of 0.05 s: saves are deferred.

    What the worker's own events say was deferred (slots and steps late) is what the agent's account, the
    exported counters and the goodput report say: the agent books each late save once, from the lead rank.
    """
    run_dir = tmp_path / "run"
    worker_events = tmp_path / "events"
    args = ("--steps", "16", "--every", "2", "--dir", str(tmp_path / "ckpt"), "--trace", str(tmp_path / "t"),
            "--step-sleep", "0.05", "--slow-storage", "0", "write_file", "0.3", "--when-busy", "defer",
            "--events", str(worker_events))
    done = run_agent(run_dir, "--nproc-per-node", "1", "--node-id", NODE, "--run-id", "deferred", script_args=args)
    assert done.returncode == 0, explain(done)

    landed = [json.loads(line) for line in (tmp_path / "events.rank0").read_text().splitlines()
              if json.loads(line)["kind"] == "checkpoint_deferred_landed"]
    assert landed, "the slow writer deferred no save: the test did not exercise what it is about"
    slots = sum(e["slots"] for e in landed)
    late = sum(e["steps_late"] for e in landed)
    report = subprocess.run([sys.executable, "-m", "resilient", "report", "goodput", str(run_dir)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert report.returncode == 0, report.stderr
    account = json.loads((run_dir / "goodput.json").read_text())["nodes"][NODE]
    assert (account["saves_deferred"], account["deferred_steps"]) == (slots, late)
    assert account["committed_step"] == 16  # the final save waited for the writer and committed
    assert f"checkpoints: {slots} scheduled saves deferred (writer busy), taken {late} steps late" in report.stdout
