"""The in-process recovery, sharded and checkpoint tests again, under the next torch release.

``scripts/setup.sh --for tests`` makes ``.venv-torch-next``: torch 2.14 (``NEXT_TORCH_SPEC``) with every other
package from ``.venv``.  A subset of the suite runs there in a pytest of its own: the compatibility probes,
the step-position rules, in-process recovery under the Run (DDP and HSDP) and a sharded resume.  The floor in
pyproject.toml is the torch ``.venv`` has (2.13); between the two, the private APIs resilient uses are the
ones ``resilient.core.compat`` probes.
"""

from __future__ import annotations

import subprocess

from .helpers import REPO

PYTHON = REPO / ".venv-torch-next" / "bin" / "python"
SUBSET = (
    "tests/test_compat.py", "tests/test_step_positions.py", "tests/test_run_recovery.py",
    "tests/test_sharded_recovery.py", "tests/test_sharded.py::test_fsdp_resume_is_bitwise_equal",
)


def test_recovery_sharded_and_checkpoint_tests_pass_under_the_next_torch() -> None:
    assert PYTHON.exists(), f"{PYTHON} is missing: run `bash scripts/setup.sh --for tests` (it makes the second venv)"
    version = subprocess.run([str(PYTHON), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True, check=True, timeout=120).stdout.strip()
    assert version.startswith("2.14."), f"{PYTHON} has torch {version}, not the next release (2.14)"
    proc = subprocess.run([str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET], cwd=REPO,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"under torch {version}:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout.splitlines()[-1] and " failed" not in proc.stdout.splitlines()[-1]
