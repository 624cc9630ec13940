#!/usr/bin/env bash
# The test command: sets up the platform's interpreter and runs the whole suite (pyproject's
# testpaths = tests), or the paths given. GPU tests skip without a Hopper GPU; extra pytest args
# pass through (`bash scripts/test.sh tests/test_setup.py -q` runs that file only).
# Platform setup (DETLOGP_PLATFORM, DETLOGP_SETUP=plan, ...): see scripts/_env.sh.
DETLOGP_WHAT="python -m pytest -q -p no:cacheprovider"; [ $# -eq 0 ] || DETLOGP_WHAT+="$(printf ' %q' "$@")"
source "$(dirname "$0")/_env.sh"
exec "$PYTHON" -m pytest -q -p no:cacheprovider "$@"
