"""``resilient run``'s command line: flags from a TOML file (the command line over it), torchrun's rendezvous
flags meaning what they mean or refused with the fix, and flags meant for tests kept out of ``--help``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.cli.main import _subcommand, build_parser, main
from resilient.cli.run_cmd import build_config
from resilient.cli.run_config import expand
from resilient.core.errors import ConfigError

from .agent_helpers import agent_env

SCRIPT = "train.py"


def parsed(tmp_path: Path, *argv: str):
    parser = build_parser()
    (tmp_path / SCRIPT).write_text("")
    return parser.parse_args(["run", *expand(list(argv), _subcommand(parser, "run"))])


def config(tmp_path: Path, *argv: str, environ: dict[str, str] | None = None):
    args = parsed(tmp_path, *argv)
    return build_config(args, environ or {})


def test_every_flag_comes_from_the_file_and_the_command_line_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = tmp_path / "job.toml"
    job.write_text('nproc-per-node = "2:3"\nspares = 1\nquiet = true\nno_memory_tier = true\nrun-id = "exp42"\n'
                   'section-timeout = {step = 30, data = 12.5}\nhealth-path = ["/ckpt", "/data"]\n'
                   'detector = {"straggler.rule.decision" = 12}\nmax-restarts = 5\n')
    c = config(tmp_path, "--config", str(job), SCRIPT, "--steps", "10")
    assert (c.nproc_per_node, c.min_nproc_per_node, c.spares, c.echo_output, c.memory_tier) == (3, 2, 1, False, False)
    assert c.run_id == "exp42" and c.restart.max_restarts == 5
    assert c.sections.explicit == {"step": 30.0, "data": 12.5} and c.health_paths == ("/ckpt", "/data")
    assert c.straggler.rule.decision == 12
    assert c.entrypoint[-3:] == (SCRIPT, "--steps", "10"), "the script and its arguments stay on the command line"
    over = config(tmp_path, "--spares", "2", f"--config={job}", "--health-path", "/other", "--max-restarts", "1",
                  SCRIPT, "--spares", "9")
    assert over.spares == 2 and over.restart.max_restarts == 1, "a flag typed wins over the file's"
    assert over.health_paths == ("/other",), "a repeatable flag typed replaces the file's list"
    assert over.entrypoint[-2:] == ("--spares", "9"), "the script's own arguments are its own"


@pytest.mark.parametrize(("text", "message"), [
    ("nproc-per-nod = 2\n", "'nproc-per-nod' is not a flag of resilient run (did you mean 'nproc-per-node'?)"),
    ("quiet = 1\n", "--quiet takes no value: write true"),
    ("spares = [1, 2]\n", "give a number or a string"),
    ("spares = \n", "not TOML"),
    ("spares = \"many\"\n", "invalid int value: 'many'"),
])
def test_a_bad_config_file_is_refused_naming_the_key_and_the_fix(tmp_path, capsys, text, message):
    job = tmp_path / "job.toml"
    job.write_text(text)
    (tmp_path / SCRIPT).write_text("")
    assert main(["run", "--config", str(job), str(tmp_path / SCRIPT)]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no such file"):
        expand(["--config", str(tmp_path / "missing.toml"), SCRIPT], _subcommand(build_parser(), "run"))


def test_a_run_started_from_a_config_file_runs_as_its_flags_say(tmp_path):
    job = tmp_path / "job.toml"
    run_dir = tmp_path / "run"
    job.write_text(f'nproc-per-node = 2\nquiet = true\nmetrics-port = 0\nrun-dir = "{run_dir}"\n'
                   'run-id = "from-file"\nnode-id = "n0"\n')
    script = tmp_path / "w.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n")
    proc = subprocess.run([sys.executable, "-m", "resilient", "run", "--config", str(job), str(script)],
                          capture_output=True, text=True, timeout=120, env=agent_env(), cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "run from-file node n0: 2 worker(s)" in proc.stderr and "rank" not in proc.stdout, "quiet, 2 ranks"
    logs = sorted(p.read_text() for p in run_dir.glob("nodes/n0/g*/rank*.log"))
    assert logs == ["rank 0 of 2\n", "rank 1 of 2\n"], logs
    kinds = {json.loads(line)["kind"] for line in (run_dir / "events.jsonl").read_text().splitlines()}
    assert "metrics_listening" in kinds, "metrics-port = 0: /metrics served on a free port"


def test_torchrun_s_rendezvous_flags_mean_what_they_mean_or_are_refused_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    etcd = config(tmp_path, "--rdzv-backend", "etcd", "--rdzv-endpoint", "10.0.0.1:2379", "--run-id", "r",
                  "--local-addr", "10.0.0.2", SCRIPT)
    assert etcd.store_url == "etcd://10.0.0.1:2379"
    one = config(tmp_path, "--rdzv-backend", "c10d", SCRIPT)  # torchrun --standalone's, on one machine: nothing to meet
    assert one.store_url is None and config(tmp_path, "--standalone", SCRIPT).store_url is None
    for argv, message in [
        (("--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29400"),
         "torchrun's c10d rendezvous meets at a TCPStore on that host, which resilient run does not use"),
        (("--rdzv-endpoint", "10.0.0.1:29400"), "--rdzv-backend static (torchrun's default)"),
        (("--rdzv-backend", "c10d", "--nnodes", "2"), "resilient run's nodes meet through etcd"),
        (("--rdzv-backend", "static", "--store", "etcd://e:2379", "--run-id", "r"), "meet through etcd"),
        (("--rdzv-backend", "etcd"), "needs --rdzv-endpoint HOST:PORT"),
        (("--rdzv-backend", "etcd", "--rdzv-endpoint", "a:1", "--store", "etcd://b:2", "--run-id", "r"),
         "name two stores"),
        (("--standalone", "--nnodes", "2"), "--standalone is one machine"),
    ]:
        with pytest.raises(ConfigError) as err:
            config(tmp_path, *argv, SCRIPT)
        assert message in str(err.value), (argv, str(err.value))
        if "TCPStore" in message:
            assert "give --store etcd://HOST:PORT" in str(err.value)


def test_flags_meant_for_tests_work_but_stay_out_of_help(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    c = config(tmp_path, "--signalled-together", "7", "--burn-in-arg=--disk-mib=8", SCRIPT)
    assert c.signalled_together_s == 7.0 and c.burn_in_argv == ("--disk-mib=8",)
    assert main(["run", "--help"]) == 0
    shown = capsys.readouterr().out
    assert "--config FILE.toml" in shown and "--standalone" in shown
    assert "--signalled-together" not in shown and "--burn-in-arg" not in shown


def test_run_help_is_in_groups_of_at_most_15_flags_and_every_flag_is_in_one():
    """``resilient run --help`` reads by topic: each group holds at most 15 flags, and only ``-h`` is outside
    them (a flag added without a group would land in the catch-all ``options``)."""
    import argparse

    run = _subcommand(build_parser(), "run")
    shown = {group.title: [a for a in group._group_actions if a.option_strings and a.help != argparse.SUPPRESS]
             for group in run._action_groups}
    catch_all = run._optionals.title
    assert [a.option_strings for a in shown.pop(catch_all)] == [["-h", "--help"]]
    assert [t for t in shown if t != "positional arguments"] == [
        "launch", "recovery", "checkpoints in memory", "coordination", "watchdogs", "stragglers", "metrics"]
    for title, flags in shown.items():
        assert len(flags) <= 15, (title, [a.option_strings[0] for a in flags])
    text = run.format_help()
    for title in shown:
        assert f"\n{title}:\n" in text


def test_the_node_silence_is_set_from_the_command_line_and_refused_below_a_few_probe_intervals(tmp_path, monkeypatch):
    from resilient.coord.liveness import SILENCE_S

    monkeypatch.chdir(tmp_path)
    assert config(tmp_path, SCRIPT).node_silence_s == SILENCE_S == 2.5
    assert config(tmp_path, "--node-silence-timeout", "4", SCRIPT).node_silence_s == 4.0
    with pytest.raises(ConfigError, match=r"--node-silence-timeout must be at least 0.5 s .* got 0.2"):
        config(tmp_path, "--node-silence-timeout", "0.2", SCRIPT)


def test_a_loopback_address_is_refused_when_the_store_is_on_another_machine(tmp_path, monkeypatch):
    """Peers on other machines would probe their own loopback for this node: refused, saying what to pass.  With
    the store on this machine too (every node here), loopback is right, and a store whose name does not resolve
    here is not judged."""
    monkeypatch.chdir(tmp_path)
    remote_store = ("--store", "etcd://10.0.0.1:2379", "--run-id", "r")
    with pytest.raises(ConfigError, match="--local-addr is 127.0.0.1, on loopback, but the store etcd://10.0.0.1:2379 "
                                          "is on another machine"):
        config(tmp_path, *remote_store, "--local-addr", "127.0.0.1", SCRIPT)
    monkeypatch.setattr("socket.getfqdn", lambda *_: "localhost")  # a host whose name maps to loopback
    with pytest.raises(ConfigError, match=r"this host's name \(localhost, the default address\).*Pass --local-addr"):
        config(tmp_path, *remote_store, SCRIPT)
    assert config(tmp_path, *remote_store, "--local-addr", "10.0.0.2", SCRIPT).local_addr == "10.0.0.2"
    here = config(tmp_path, "--store", "etcd://127.0.0.1:2379", "--run-id", "r", "--local-addr", "127.0.0.1", SCRIPT)
    assert here.local_addr == "127.0.0.1"
    assert config(tmp_path, "--store", "etcd://etcd-0.invalid:2379", "--run-id", "r", SCRIPT).store_url
