"""The README's and the docs site's examples run as written, so the docs cannot drift from the code."""

from __future__ import annotations

import shlex
import subprocess
import sys

from resilient.cli.main import main as cli

from .docs_text import REPO, blocks, pages, the_block


def test_readme_training_example_runs_and_resumes(tmp_path, capsys):
    script = the_block("README.md", "python", "resilient.Run(")
    assert the_block("docs/training-script.md", "python", "resilient.Run(") == script  # one example, two places
    path = tmp_path / "train.py"
    path.write_text(script)
    first = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip().endswith("step 50, restored from None")
    second = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip().endswith("step 50, restored from step_0000000050")

    # The command-line section, against the checkpoints the example just wrote.
    commands = the_block("docs/checkpoints.md", "bash", "resilient checkpoint ls")
    for line in commands.splitlines():
        argv = shlex.split(line.split("#")[0])
        assert argv[0] == "resilient"
        argv = [str(tmp_path / a) if a.startswith("runs/") else a for a in argv[1:]]
        assert cli(argv) == 0, f"`{line}` failed:\n{capsys.readouterr()}"
    out = capsys.readouterr().out
    assert "step_0000000050" in out


def test_the_fsdp_example_runs_and_resumes_on_two_ranks(tmp_path):
    """The FSDP2 example, saved as fsdp.py and run twice under torchrun with 2 ranks, as its page says."""
    script = the_block("docs/sharded.md", "python", "init_device_mesh(")
    (tmp_path / "fsdp.py").write_text(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "fsdp.py"]
    outs = []
    for _ in range(2):
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        outs.append(proc.stdout)
    for rank in (0, 1):
        assert f"rank {rank}: step 30, restored from None" in outs[0]
        assert f"rank {rank}: step 30, restored from step_0000000030" in outs[1]
    manifest = (tmp_path / "runs/fsdp/ckpt/step_0000000030/manifest.json").read_text()
    assert '"index": "sharded.index"' in manifest


def test_the_hsdp_example_replaces_a_killed_rank_without_replay(tmp_path):
    """The HSDP example under `resilient run` with a spare, rank 3 killed by its page's fault plan."""
    script = the_block("docs/sharded.md", "python", "resilient.device_mesh(")
    (tmp_path / "hsdp.py").write_text(script)
    commands = the_block("docs/sharded.md", "bash", "kill3.json hsdp.py")
    echo, command = commands.strip().splitlines()
    subprocess.run(echo, shell=True, cwd=tmp_path, check=True)
    argv = shlex.split(command)
    assert argv[:2] == ["resilient", "run"]
    cmd = [sys.executable, "-m", "resilient", "run", "--run-dir", str(tmp_path / "run"), *argv[2:]]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "injecting fault into rank 3" in proc.stdout and "decision: promote spare s4 (node " in proc.stderr
    assert "recovered in process (promote_spare)" in proc.stderr and "resume after step 50, 0 step(s) re-done" in \
        proc.stderr, proc.stderr[-3000:]
    assert "succeeded: all workers exited 0 (generation 2, restarts used 0/3)" in proc.stderr
    for rank in range(4):
        assert f"[rank {rank}] rank {rank}: step 60, restored from None" in proc.stdout


def test_readme_commands_exist():
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh --all"):
        assert command in the_block("README.md", "bash", command)
        assert (REPO / command.split()[1]).exists()
    ci = (REPO / ".ci" / "run").read_text()
    assert "exec bash scripts/test.sh --all\n" in ci  # CI runs the README's test command, every tier


def test_the_agent_commands_parse_and_the_one_machine_command_runs(tmp_path):
    from resilient.faults.plan import FaultPlan
    from resilient.cli.main import build_parser

    parser = build_parser()
    shown = [line for p in pages() for b in blocks(str(p.relative_to(REPO)), "bash")
             for line in b.replace("\\\n", " ").splitlines() if line.strip().startswith("resilient ")]
    for line in shown:
        parser.parse_args(shlex.split(line.split("#")[0])[1:])  # every command and flag shown exists
    assert any("report goodput" in line for line in shown) and any("--metrics-port" in line for line in shown)
    commands = the_block("README.md", "bash", "--store etcd")
    lines = [line for line in commands.replace("\\\n", " ").splitlines() if line.strip().startswith("resilient")]
    assert len(lines) >= 4

    # The one-machine command, shortened and with a smaller model, runs under the agent.
    argv = shlex.split(lines[0].split("#")[0])
    assert argv[:4] == ["resilient", "run", "--nproc-per-node", "2"]
    argv[argv.index("--steps") + 1] = "6"
    argv = [str(tmp_path / a) if a.startswith("runs/") else a for a in argv]
    repo = REPO
    cmd = [sys.executable, "-m", "resilient", "run", "--run-dir", str(tmp_path / "run"), "--quiet",
           *argv[2:], "--layers", "1", "--batch-size", "4"]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "succeeded: all workers exited 0" in proc.stderr
    assert (tmp_path / "runs" / "gpt" / "ckpt" / "step_0000000006" / "manifest.json").exists()

    plan = the_block("docs/observability.md", "json", '"faults"')
    assert [f.kind for f in FaultPlan.loads(plan).faults] == ["kill", "hang"]
