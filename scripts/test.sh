#!/usr/bin/env bash
# Set up what the tests need (see scripts/setup.sh --for tests: the servers are unpacked into .servers/, never
# installed as system services), then run the test suite; fixtures start each server on a loopback port.
#   bash scripts/test.sh            every test but the drill tier (a few representative drills run)
#   bash scripts/test.sh --all      every test and every shipped drill, as CI runs it
# Tests run two at a time (a test file per process), then those marked `serial` (timing detection, drills) one
# after another, alone.  With pytest arguments (`bash scripts/test.sh -x -k corruption`) one pytest runs them
# in order instead.
set -euo pipefail
cd "$(dirname "$0")/.."
tier="not drills"
if [ "${1:-}" = "--all" ]; then
    shift
    tier=""
fi
bash scripts/setup.sh --for tests
pytest=(.venv/bin/python -m pytest -q)
if [ "$#" -gt 0 ]; then
    exec "${pytest[@]}" -m "$tier" "$@"
fi
both="not serial${tier:+ and $tier}"
alone="serial${tier:+ and $tier}"
status=0
"${pytest[@]}" -m "$both" -n 2 --dist loadfile || status=$?
"${pytest[@]}" -m "$alone" || { s=$?; [ "$status" -ne 0 ] || status=$s; }
exit "$status"
