#!/usr/bin/env bash
# Set up what the main job needs (Python packages in .venv; nothing system-wide beyond python3-venv when Python
# lacks it), then run it: one two-rank GPT training script that loses a rank mid-run, recovered by torchrun, by
# `resilient run` and by `resilient run --spares 1`, each compared with the run that never stopped, with their
# recovery, re-done steps and goodput side by side; then a NaN incident bundled and replayed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --for demo
exec .venv/bin/python examples/recovery_demo.py "$@"
