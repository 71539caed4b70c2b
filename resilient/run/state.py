"""The state of one rank's :class:`~resilient.run.Run`, in one object every part of the Run works on.

:class:`RunState` holds what the Run was given (model, optimizer, loader,
``state=`` objects), where the rank is (step, counters, rank and world
size), the parts of it that one module of the Run alone changes (the
section, :class:`Sections`; the attempt and the optimizer's update,
:class:`StepAttempt`; the non-finite check, :class:`NonfiniteCheck`; the
resume check, :class:`ResumeCheck`), the parts below the Run it works
through (the worker hooks, the step timer, checkpoints), and in-process
recovery's standing (:class:`InProcessStanding`).  The Run's modules take a
``RunState`` and nothing else of the Run: the attempt (:mod:`.attempt`),
DDP's wrapper (:mod:`.ddp`), what is saved and put back (:mod:`.payloads`,
:mod:`.saving`), the non-finite check (:mod:`.nonfinite`), the replica
audit (:mod:`.audit`), the memory tier (:mod:`.memory`) and in-process
recovery (:mod:`.recovery`).  The :class:`~resilient.run.Run` a script
holds is a thin face over it: its public attributes read the state, and
none of them can be assigned.  The Run also holds those of its parts that
act on the state at its boundaries (the memory tier, in-process recovery,
a replay), so that the state names nothing that names it: what it holds is
defined below it (:mod:`.records`, :mod:`.streams`, the packages under
:mod:`resilient.run`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .records import StepPosition

if TYPE_CHECKING:
    import torch

    from ..checkpoint.manager import CheckpointManager, SaveResult
    from ..core.events import EventLog
    from ..data.loader import ElasticLoader
    from ..elastic.batch import BatchPlan
    from ..worker.hooks import WorkerHooks
    from .records import AttemptStart, OwnGradients, PendingVerdict
    from .streams import Expected, Fetched
    from .timing import StepTimer


@dataclass
class InProcessStanding:
    """In-process recovery as the rest of the Run sees it (the recovery itself is
    :class:`~resilient.run.recovery.InProcessRecovery`, which keeps it)."""

    worker_id: str
    role: str
    """``worker`` (a member) or ``spare``: the role the agent started this process in."""
    generation: int
    """The generation this worker is a member of (or, for a spare, was started in)."""
    declined: str | None = None
    """Why this run recovers by restart only (:func:`~resilient.run.integration.decline`: said once to the agent,
    which then starts no spare)."""


@dataclass
class Sections:
    """The sections' part of a rank's state: where the agent sees the rank in the loop.  :mod:`.sections` alone
    changes it."""

    current: str = "init"
    """The section this rank is in, as the agent sees it; "" between two updates."""
    reported_save: SaveResult | None = None
    """The newest finished save told to the agent in a heartbeat."""


@dataclass
class StepAttempt:
    """The attempt's part of a rank's state: the current ``run.attempt()``, where the rank is in the step's
    update, and the step's micro-batches.  :mod:`.attempt` alone changes it."""

    start: AttemptStart | None = None
    """The current ``run.attempt()``'s start (None outside one)."""
    ever_entered: bool = False
    """A step of this process ran under ``run.attempt()``."""
    position: StepPosition = StepPosition.BEFORE
    """Where this rank is in the current step's optimizer update (set by hooks; BEFORE at attempt entry)."""
    retry: bool = False
    """The attempt failed and was recovered (or its gradients were not finite): ``steps()`` yields it again."""
    micro: Generator[Any, None, None] | None = None
    """The step's micro-batches (``run.micro_batches()``), while open."""
    micro_samples: int | None = None
    """Samples of the step's micro-batches read so far (what ``report()`` counts when not told)."""
    announced_plan: BatchPlan | None = None
    """The batch plan last announced in a ``batch_planned`` event."""


@dataclass
class NonfiniteCheck:
    """The non-finite check's part of a rank's state: how it checks, and what it knows of the steps it checked.
    :mod:`.nonfinite` alone changes it."""

    mode: str = "retry"
    """``Run(nonfinite=...)``: "retry" the step on the same batch, "raise", or "off" (no check)."""
    verdict: str = "now"
    """When the check is read: "now" (in the update it guards) or "late" (a step later, no host sync)."""
    tries: dict[int, int] = field(default_factory=dict)
    """The current step's tries whose gradients were not finite (only that step's count is kept)."""
    pending: PendingVerdict | None = None
    """A step's verdict on the device, not read yet (``verdict="late"``)."""
    recheck_step: int | None = None
    """A step retried after a late verdict: its update is checked at once."""
    own: OwnGradients | None = None
    """On a retry of a step found non-finite: whether this rank's own backward made the non-finite gradients."""


@dataclass
class ResumeCheck:
    """The resume check's part of a rank's state: what the first step after a restore must find, and the newest
    batch fetched ahead.  :mod:`.resume` alone changes it."""

    mode: str = "stop"
    """``Run(resume_check=...)``: what a resume that is not where the saving run was does: "stop" (exit 79) or
    "accept" (recorded)."""
    expected: Expected | None = None
    """What the first step after a restore must find; None once checked, or without a restore."""
    fetched: Fetched | None = None
    """The newest batch fetched ahead through ``run.prefetch``."""


@dataclass(eq=False)
class RunState:
    """Everything one rank's Run holds; the Run's modules read and change it, the script reads it through Run."""

    # ---------------------------------------------------------------- given by the script
    model: torch.nn.Module
    """The model to call: the DDP wrapper with ``ddp=True`` under a process group, else the module given."""
    events: EventLog
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    scaler: Any = None
    data: ElasticLoader | None = None
    user_state: dict[str, Any] = field(default_factory=dict)
    """The ``state=`` objects, by name."""
    config: dict[str, Any] | None = None
    seed: int = 0
    reseed: bool = False
    generators: dict[str, Any] = field(default_factory=dict)
    """``Run(generators=...)``: the script's own generators, saved, restored and checked per rank."""
    make_groups: Callable[[], Any] | None = None
    """``Run(groups=fn)``'s ``fn``: makes the script's own process groups, again after every re-formation."""
    ddp_options: dict[str, Any] | None = None
    """DistributedDataParallel's keyword arguments when the Run wraps the model (``ddp=True``); None: it does not."""
    audit_every: int = 0
    sharded: bool = False
    """FSDP2/DTensor parameters: saved as chunks per rank, resharded on restore."""
    fingerprint: dict[str, Any] = field(default_factory=dict)
    """Model structure, config digest and versions: in every manifest, compared on restore."""

    # ---------------------------------------------------------------- where the rank is
    step: int = 0
    """Completed optimizer updates; inside the loop body the index of the update being computed."""
    samples: int = 0
    tokens: int = 0
    last_loss: float | None = None
    last_step_s: float | None = None
    step_started: float | None = None
    step_cursor: int | None = None
    """The loader's cursor when the step began (its first stream position)."""
    rank: int = 0
    world_size: int = 1
    restored_from: str | None = None
    in_body: bool = False
    """Inside the loop body of ``state.step`` (between ``run.steps()`` yielding it and the step's completion)."""
    integration_told: bool = False
    """The agent was told what this script's integration allows (:mod:`.integration`), at the first step's end."""
    groups: Any = None
    """What ``make_groups`` returned in the current generation (None before it ran)."""
    last_saved_step: int | None = None
    prepared: bool = False
    """The checkpoint manager was told the size of a save (after the first update)."""

    # ---------------------------------------------------------------- parts, each changed by one module
    sections: Sections = field(default_factory=Sections)
    attempt: StepAttempt = field(default_factory=StepAttempt)
    nonfinite: NonfiniteCheck = field(default_factory=NonfiniteCheck)
    resume: ResumeCheck = field(default_factory=ResumeCheck)

    # ---------------------------------------------------------------- the parts it works through
    hooks: WorkerHooks | None = None
    """The agent's side in this process (heartbeats, stacks, error file, faults, stop); None without an agent."""
    timer: StepTimer | None = None
    """Step time by section, sent to the agent for its straggler and slowdown detectors (None without one)."""
    checkpoints: CheckpointManager | None = None
    inproc: InProcessStanding | None = None
    """The agent's in-process recovery, where it offers one: its generation, and whether the run declined it."""
    recovery: Callable[[BaseException], bool] | None = None
    """In-process recovery (re-form the group, sync state) for a failed attempt; True: retry the step.  None
    without it, or once declined."""

    def committed_step(self) -> int | None:
        """The step of the newest committed checkpoint this rank knows of (None: none)."""
        manifest = self.checkpoints.last_committed if self.checkpoints is not None else None
        return manifest.step if manifest is not None else None
