"""Chaos drills: drill files checked before anything runs, seeded schedules, the score, and ``resilient drill``
on real agents with a drill that must fail.  Each shipped drill runs as its own test in ``test_drill_suite.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.chaos.drill import DrillError, load_drill
from resilient.chaos.report import compare
from resilient.chaos.runner import leftovers
from resilient.chaos.score import Observed, judge

from .agent_helpers import agent_env

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "chaos").glob("*.toml"))

MINIMAL = """
[drill]
name = "d"
[[faults]]
kind = "kill"
rank = 1
step = 5
"""


def drill_file(tmp_path: Path, text: str, name: str = "d.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resilient", "drill", *args], capture_output=True, text=True,
                          timeout=timeout, env=agent_env(), check=False)


@pytest.mark.parametrize(("text", "message"), [
    ("[drill]\nname = 'd'\n[nodes]\nx = 1\n", "[nodes]: unknown table"),
    ("[drill]\nname = 'd'\n[workload]\nstep = 10\n" + MINIMAL.split("[drill]\nname = \"d\"")[1],
     "[workload] step: unknown key; [workload] has"),
    (MINIMAL + "[expect]\nrung = 'teleport'\n", "[expect] rung = 'teleport': use one of retry_in_place"),
    (MINIMAL.replace("rank = 1", "rank = 7"), "rank 7 is outside the world of 2 ranks"),
    (MINIMAL.replace("step = 5", "step = 500"), "step 500 is past the workload's 120 steps"),
    (MINIMAL + "[random]\ncount = 2\n", "give one schedule, not both"),
    ("[drill]\nseed = 1\n", "[drill] name: missing"),
    ("[drill]\nname = 'd'\n", "no faults: add a [[faults]] table"),
    ("[drill\nname = 'd'\n", "is not valid TOML"),
    (MINIMAL + "[expect]\nmin_goodput = 1.5\n", "a share between 0 and 1"),
    (MINIMAL + "[topology]\nsection_timeouts = ['step']\n", "must be \"SECTION=SECONDS\""),
    (MINIMAL.replace("kind = \"kill\"", "kind = \"melt\""), "'melt' is not a fault kind"),
    (MINIMAL + "[expect]\nalerts = ['HangDetected']\n", "set [topology] monitoring = true"),
    (MINIMAL + "[topology]\nmonitoring = true\n[expect]\nalerted_within_s = 5\n", "name the alerts it applies to"),
    ("[drill]\nname = 'd'\n[gameday]\nduration_s = 60\n", "[gameday] mtbf_s: missing"),
    ("[drill]\nname = 'd'\n[topology]\nspares = 1\n[gameday]\nduration_s = 60\nmtbf_s = 10\n",
     "leave out [topology] spares, spare_nodes"),
    (MINIMAL + "[topology]\nnodes = 2\nmin_nodes = 3\n", "min_nodes = 3: must be between 1 and nodes (2)"),
    (MINIMAL + "[topology]\nnodes = 2\nmin_ranks = 1\n", "across nodes give min_nodes"),
    ("[drill]\nname = 'd'\n[[host_faults]]\nkind = 'kill_node'\nrank = 1\nstep = 5\n",
     "needs agents meeting through etcd: give [topology] nodes = 2"),
    ("[drill]\nname = 'd'\n[gameday]\nduration_s = 60\nmtbf_s = 10\nstart_after_s = 90\n", "leaves no time"),
])
def test_a_bad_drill_file_is_refused_before_anything_runs_naming_the_key_and_the_fix(tmp_path, text, message):
    path = drill_file(tmp_path, text)
    with pytest.raises(DrillError) as err:
        load_drill(path)
    assert message in str(err.value) and str(path) in str(err.value), str(err.value)


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    text = "[drill]\nname = 'g'\nseed = {seed}\n[workload]\nsteps = 400\n[topology]\nnproc_per_node = 4\n" \
           "[random]\ncount = 5\nkinds = ['kill', 'exit', 'hang']\nfirst_step = 20\nhang_s = 30.0\n"
    def plan(tmp: Path, seed: int) -> list[dict]:
        return [f.to_dict() for f in load_drill(drill_file(tmp, text.format(seed=seed), f"s{seed}.toml")).plan().faults]
    import tempfile

    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        first, again, other = plan(Path(a), 7), plan(Path(b), 7), plan(Path(a), 8)
    assert first == again and first != other
    assert len(first) == 5 and all(20 <= f["step"] < 400 and 0 <= f["rank"] < 4 for f in first)
    assert [f["attempt"] for f in first] == [0, 1, 2, 3, 4]  # one per restart: the run meets them in turn


def test_every_shipped_drill_loads():
    assert len(SHIPPED) >= 24
    names = [load_drill(p).name for p in SHIPPED]
    assert len(set(names)) == len(names)


def _obs(**over) -> Observed:
    t0 = 1000.0
    events = [{"kind": "fault_injected", "time": t0, "rank": 1},
              {"kind": "recovery_decided", "time": t0 + 0.5, "action": "promote_spare", "generation": 1},
              {"kind": "recovered_in_process", "time": t0 + 1.5, "generation": 2}]
    trace = [{"rank": r, "step": s} for r in (0, 1) for s in range(10)] + [{"rank": 0, "step": 4}]
    base = dict(events=events, trace=trace, final={"params": "a", "optimizer": "b", "step": 10, "samples": 40},
                reference={"params": "a", "optimizer": "b", "step": 10, "samples": 40}, goodput=0.4, exit_code=0)
    return Observed(**{**base, **over})


def test_the_score_measures_from_the_events_and_gives_the_margin_of_each_expectation(tmp_path):
    drill = load_drill(drill_file(tmp_path, MINIMAL + "[expect]\ndetected_within_s = 0.2\nresumed_within_s = 5\n"
                                  "max_redone_steps = 0\nrung = 'shrink'\nequal = 'bitwise'\nmin_goodput = 0.5\n"
                                  "no_events = ['restart']\n"))
    m, verdicts = judge(drill, _obs())
    assert (m.detect_s, m.resume_s, m.rung, m.redone_steps, m.equal) == (0.5, 1.0, "promote_spare", 1, True)
    by = {v.expectation: v for v in verdicts}
    assert not by["detected within"].ok and by["detected within"].margin == "0.30 s late"
    assert by["resumed within"].ok and by["resumed within"].margin == "4.00 s to spare"
    assert not by["re-done steps"].ok and by["re-done steps"].margin == "1 too many"
    assert not by["rung"].ok and by["rung"].got == "promote_spare"
    assert by["equal to the reference"].ok and not by["goodput"].ok and by["goodput"].margin == "-0.100"
    assert by["event restart"].ok and by["teardown"].ok and by["exit code"].ok
    _, verdicts = judge(drill, _obs(final={"params": "x", "optimizer": "b", "step": 10, "samples": 40},
                                    exit_code=None, left_behind=2))
    by = {v.expectation: v for v in verdicts}
    assert by["equal to the reference"].got == "differs" and not by["equal to the reference"].ok
    assert by["exit code"].got == "killed at the timeout" and by["teardown"].got == "2 left"
    _, verdicts = judge(drill, _obs(events=[]))
    assert [v.expectation for v in verdicts if not v.ok][:2] == ["fault injected", "detected within"]


def test_alerts_are_scored_from_the_receivers_notifications_and_latent_faults_on_their_own(tmp_path):
    drill = load_drill(drill_file(tmp_path, MINIMAL + "[topology]\nmonitoring = true\n[expect]\n"
                                  "alerts = ['HangDetected', 'Straggler']\nalerted_within_s = 5\n"
                                  "no_alerts = ['RestartStorm']\n"))
    t0 = 1000.0
    notified = [{"kind": "alert_notified", "time": t0 + 3.2, "alertname": "HangDetected", "status": "firing"},
                {"kind": "alert_notified", "time": t0 + 9.0, "alertname": "HangDetected", "status": "resolved"},
                {"kind": "alert_notified", "time": t0 + 7.5, "alertname": "RestartStorm", "status": "firing"}]
    base = list(_obs().events)
    m, verdicts = judge(drill, _obs(events=base + notified))
    assert m.alerts == (("HangDetected", 3.2), ("RestartStorm", 7.5))
    by = {v.expectation: v for v in verdicts}
    assert by["alert HangDetected"].ok and by["alert HangDetected"].margin == "1.80 s to spare"
    assert not by["alert Straggler"].ok and by["alert Straggler"].got == "never notified"
    assert not by["alert RestartStorm"].ok and by["alert RestartStorm"].got == "notified 7.50 s after the fault"
    # A damaged checkpoint acts only when read: the kill that follows it is the anchor of detection.
    damaged = {"kind": "fault_injected", "time": t0 - 2.0, "source": "host", "checkpoint": "step_0000000030",
               "fault": {"kind": "corrupt_checkpoint", "step": 30}}
    m, verdicts = judge(drill, _obs(events=[damaged, *base]))
    assert m.fault_at == t0 and m.latent == ({"kind": "corrupt_checkpoint", "checkpoint": "step_0000000030",
                                              "caught_by": None, "caught_s": None},)
    [caught] = [v for v in verdicts if v.expectation == "corrupt_checkpoint of step_0000000030 caught"]
    assert not caught.ok and caught.got == "never"
    refused = {"kind": "checkpoint_quarantined", "time": t0 + 1.0, "name": "step_0000000030"}
    m, _ = judge(drill, _obs(events=[damaged, *base, refused]))
    assert m.latent[0]["caught_by"] == "checkpoint_quarantined" and m.latent[0]["caught_s"] == 3.0


def test_the_timeline_draws_each_ranks_steps_and_the_marks(tmp_path):
    from resilient.chaos.timeline import draw

    t0 = 1000.0
    trace = [{"rank": r, "step": s, "worker": "w" if s < 5 or r == 0 else "s2", "time": t0 + 0.1 * s}
             for r in (0, 1) for s in range(10)]
    events = [*_obs().events, {"kind": "alert_notified", "time": t0 + 1.0, "alertname": "HangDetected",
                               "status": "firing", "receiver": "tickets"}]
    png = draw(events, trace, tmp_path / "t.png", "kill-rank: kill")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_teardown_finds_a_process_of_the_run_by_its_run_dir_and_kills_it(tmp_path):
    from resilient.chaos.runner import tear_down

    run_dir = tmp_path / "run"
    env = {**agent_env(), "RESILIENT_RUN_DIR": str(run_dir)}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             env={**env, "RESILIENT_RUN_DIR": str(tmp_path / "another")})
    try:
        assert leftovers(run_dir) == [proc.pid]
        assert tear_down(run_dir, grace_s=0.2) == [proc.pid]
        assert proc.wait(timeout=10) == -9 and other.poll() is None  # another run's process is left alone
        assert leftovers(run_dir) == []
    finally:
        proc.kill()
        other.kill()


def test_compare_names_each_regression_between_two_releases():
    def record(name, passed, detect, goodput):
        return {"drill": name, "passed": passed, "verdicts": [{"expectation": "rung", "ok": passed}],
                "measured": {"detect_s": detect, "resume_s": 1.0, "redone_steps": 0, "goodput": goodput}}
    before = [record("a", True, 1.0, 0.5), record("b", True, 1.0, 0.5), record("gone", True, 1.0, 0.5)]
    after = [record("a", True, 1.2, 0.49), record("b", False, 3.0, 0.3), record("new", True, 1.0, 0.5)]
    text, regressions = compare(before, after)
    assert regressions == 3, text  # b: the verdict, its detection (+2 s) and its goodput (-40%); a's changes are noise
    assert "| b | verdict | PASS | FAIL | **regression** (rung) |" in text
    assert "| a | detect | 1.00 s | 1.20 s | ok |" in text and "| gone | - | PASS | - | not run |" in text
    assert "| new | - | - | PASS | new drill |" in text


@pytest.mark.timeout(600)
def test_a_drill_with_an_impossible_expectation_fails_and_says_which_and_by_how_much(tmp_path):
    text = (ROOT / "chaos" / "kill-rank.toml").read_text()
    text = text.replace('name = "kill-rank"', 'name = "impossible"').replace('equal = "bitwise"', 'equal = "none"')
    text = text.replace("detected_within_s = 3", "detected_within_s = 0.000001").replace(
        'rung = "promote_spare"', 'rung = "shrink"')
    # Only the two planted expectations can fail: the goodput and resumption bounds are timings, left out.
    text = "\n".join(line for line in text.splitlines() if not line.startswith(("min_goodput", "resumed_within_s")))
    path = drill_file(tmp_path, text, "impossible.toml")
    out = tmp_path / "results"
    done = cli("run", str(path), "--out", str(out))
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert "impossible: FAIL" in done.stdout
    assert "FAIL detected within: wanted 1e-06 s, got " in done.stdout and " s late)" in done.stdout, done.stdout
    assert "FAIL rung: wanted shrink, got promote_spare" in done.stdout
    [record] = json.loads((out / "drills.json").read_text())
    failed = {v["expectation"] for v in record["verdicts"] if not v["ok"]}
    assert failed == {"detected within", "rung"}, record["verdicts"]
    assert leftovers(out / "impossible" / "faulted" / "run") == []
    assert "| impossible |" in (out / "drills.md").read_text()
    same = cli("compare", str(out / "drills.json"), str(out / "drills.json"))
    assert same.returncode == 0 and "0 regression(s)" in same.stdout, same.stdout
    worse = [{**record, "passed": True}]
    (tmp_path / "before.json").write_text(json.dumps(worse))
    regressed = cli("compare", str(tmp_path / "before.json"), str(out / "drills.json"))
    assert regressed.returncode == 1 and "| impossible | verdict | PASS | FAIL | **regression**" in regressed.stdout, \
        regressed.stdout


def test_a_game_day_draws_the_same_kills_from_the_same_seed_at_its_mtbf():
    from resilient.chaos.gameday import GameDay

    day = GameDay(duration_s=3600.0, mtbf_s=60.0, start_after_s=5.0)
    first, again, other = day.schedule(3, 4), day.schedule(3, 4), day.schedule(4, 4)
    assert first == again and first != other
    times = [f.at_s for f in first]
    assert all(f.kind == "kill" and 0 <= f.rank < 4 for f in first) and times == sorted(times)
    assert 5.0 < times[0] and times[-1] < 3600.0
    # About 60 kills an hour: the mean gap is the MTBF (within the spread of ~60 exponential draws).
    gaps = [b - a for a, b in zip([5.0, *times], times)]
    assert 40 <= len(first) <= 85 and 45 < sum(gaps) / len(gaps) < 80


def test_the_young_daly_prediction_adds_the_restart_and_half_an_interval_per_fault():
    from types import SimpleNamespace

    from resilient.chaos.gameday import predict
    from resilient.metrics.ledger_state import IncidentCost

    def cost(detect, recover, replay):
        return IncidentCost(id="i", kind="signal", detection_s=detect, recovery_s=recover, replay_s=replay,
                            total_s=detect + recover + replay, started_t=0.0, detected_t=0.0, open=False)
    reference = SimpleNamespace(ideal_step_s=0.1, committed_step=200, wall_s=50.0, goodput_ratio=0.8,
                                seconds={"productive": 40.0, "checkpoint_stall": 2.0})
    faulted = SimpleNamespace(ideal_step_s=0.1, goodput_ratio=0.55, incidents=(cost(0.5, 4.5, 1.0), cost(0.5, 5.5, 0.8)))
    g = predict(reference=reference, faulted=faulted, checkpoint_every=20, injected=2, mtbf_s=30.0)
    # C = 2 s / 10 commits; tau = 20 x 0.1 s; R = mean(5, 6) = 5.5 s; predicted 40 / (50 + 2 x (5.5 + 1)) = 0.635
    assert (g["checkpoint_cost_s"], g["interval_s"], g["restart_cost_s"], g["replay_s"]) == (0.2, 2.0, 5.5, 0.9)
    assert g["predicted_goodput"] == pytest.approx(40 / 63, abs=1e-4)
    assert g["relative_error"] == pytest.approx(0.55 / (40 / 63) - 1, abs=1e-4)
    assert g["young_interval_s"] == pytest.approx((2 * 0.2 * 30) ** 0.5, abs=1e-3) and g["young_interval_steps"] == 35
