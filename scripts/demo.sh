#!/usr/bin/env bash
# Set everything up, then run the main job: a two-rank training run that loses a
# rank mid-run, resumes from its newest committed checkpoint, and proves the
# resumed run equals an uninterrupted one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/resume_demo.py "$@"
