#!/usr/bin/env bash
# Set everything up, then run the whole test suite (servers are started by fixtures).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
