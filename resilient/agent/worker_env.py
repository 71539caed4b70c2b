"""What every process the agent starts finds in its environment: the run, the launch, the generation, its
heartbeat socket, its files, and the signals the agent uses on it."""

from __future__ import annotations

import signal
from pathlib import Path

from .config import AgentConfig
from .rundir import RunDir, heartbeat_socket

STACK_SIGNAL = signal.SIGUSR2
"""Sent to a running worker to dump its threads' stacks (faulthandler) into its stack file."""
STOP_SIGNAL = signal.SIGUSR1
"""Sent to a worker to read its control file (a graceful stop at the step it names)."""


def worker_env(c: AgentConfig, run_dir: RunDir, launch_id: str, generation: int, attempt: int, slot: int,
               gdir: Path, name: str) -> dict[str, str]:
    """The variables every process of the agent gets (a rank or a spare): run, launch, generation, its
    heartbeat socket ``slot``, and its files in ``gdir`` named after ``name`` (``rank<N>``, a spare's id)."""
    env = {
        "TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_RUN_ID": c.run_id,
        "RESILIENT_RUN_ID": c.run_id, "RESILIENT_LAUNCH_ID": launch_id, "RESILIENT_RUN_DIR": str(c.run_dir),
        "RESILIENT_NODE_ID": c.node_id,
        "RESILIENT_GENERATION": str(generation), "RESILIENT_ATTEMPT": str(attempt),
        "RESILIENT_AGENT_SOCKET": heartbeat_socket(run_dir, slot),
        "RESILIENT_STACK_FILE": str(gdir / f"{name}.stacks.txt"),
        "RESILIENT_STACK_SIGNAL": str(int(STACK_SIGNAL)),
        "RESILIENT_ERROR_FILE": str(gdir / f"{name}.error.json"),
        "RESILIENT_CONTROL_FILE": str(gdir / "control.json"),
        "RESILIENT_STOP_SIGNAL": str(int(STOP_SIGNAL)),
    }
    if c.fault_plan is not None:
        env["RESILIENT_FAULT_PLAN"] = str(c.fault_plan)
    return env


def base_env(config: AgentConfig) -> dict[str, str]:
    """What every worker's environment starts from (the fork server runs with it too)."""
    base = dict(config.worker_env)
    if config.nproc_per_node > 1:
        base.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N processes must not each take every core
    return base
