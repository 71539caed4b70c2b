#!/usr/bin/env bash
# Set up what the tests need (see scripts/setup.sh --for tests: the servers are unpacked into .servers/, never
# installed as system services), then run the whole test suite; fixtures start each server on a loopback port.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --for tests
exec .venv/bin/python -m pytest -q "$@"
