"""Input-path isolation, the worker's side of ``resilient diagnose input``.

A diagnosis job (``RESILIENT_DIAGNOSE=input:STEPS:DIR``, set by the command)
trains its first ``STEPS`` steps on the real input path, then ``STEPS``
more on the batches of the last real step, held in memory
(:attr:`~resilient.data.ElasticLoader.held`): no reading, decoding,
collating or transfer, the same compute.  The Run's own timing windows are
kept by phase; each rank writes them to ``DIR/rank<R>.json`` and the job
stops at that step boundary on every rank together (each counts the same
windows).  It never restores or writes a checkpoint: it measures, it does
not train anything that is kept.  The comparison is
:func:`resilient.watchdog.input_path.judge_input`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigError
from ..core.fsutil import write_json_atomic

if TYPE_CHECKING:
    from ..data.loader import ElasticLoader


@dataclass(frozen=True)
class DiagnoseSpec:
    """What a diagnosis job measures: ``steps`` per phase, results under ``out_dir``."""

    steps: int
    out_dir: str

    @classmethod
    def parse(cls, text: str) -> DiagnoseSpec:
        """``input:STEPS:DIR`` (what ``resilient diagnose input`` sets); ConfigError naming the problem."""
        kind, _, rest = text.partition(":")
        steps, _, out_dir = rest.partition(":")
        if kind != "input" or not steps.isdigit() or int(steps) < 10 or not out_dir:
            raise ConfigError(f"RESILIENT_DIAGNOSE={text!r}: expected input:STEPS:DIR with STEPS >= 10 "
                              "(set by `resilient diagnose input`)")
        return cls(int(steps), out_dir)


class InputDiagnosis:
    """Counts a rank's timing windows through the two phases; switches the loader; says when to stop."""

    def __init__(self, spec: DiagnoseSpec, rank: int) -> None:
        self.spec = spec
        self.rank = rank
        self.phase = "real"
        self.loader: ElasticLoader | None = None
        self._steps = {"real": 0, "resident": 0}
        self._windows: dict[str, list[dict[str, Any]]] = {"real": [], "resident": []}

    def bind(self, loader: ElasticLoader) -> None:
        """Hold the newest batch of each micro-batch slot from now on (to hand out again in the second phase)."""
        self.loader = loader
        loader.held = {}

    def window(self, report: dict[str, Any]) -> bool:
        """One of the rank's timing windows; True once both phases are measured (stop at this boundary)."""
        phase = self.phase
        self._windows[phase].append(dict(report))
        self._steps[phase] += int(report.get("n", 0))
        if phase == "real" and self._steps[phase] >= self.spec.steps:
            if self.loader is None:
                raise ConfigError("resilient diagnose input needs the script's data through Run(data=ElasticLoader(...))")
            self.phase = "resident"
            self.loader.replaying = True
            return False
        if phase == "resident" and self._steps[phase] >= self.spec.steps:
            os.makedirs(self.spec.out_dir, exist_ok=True)
            write_json_atomic(os.path.join(self.spec.out_dir, f"rank{self.rank}.json"),
                              {"rank": self.rank, "steps": self.spec.steps, "windows": self._windows})
            return True
        return False
