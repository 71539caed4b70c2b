#!/usr/bin/env bash
# Set up what the main job needs (Python packages in .venv; nothing system-wide beyond python3-venv when Python
# lacks it), then run it: a two-rank training run that loses a rank mid-run, resumes from its newest committed
# checkpoint, and proves the resumed run equals an uninterrupted one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --for demo
exec .venv/bin/python examples/resume_demo.py "$@"
