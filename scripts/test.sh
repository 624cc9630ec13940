#!/usr/bin/env bash
# The test command: sets up the platform's interpreter and runs the whole suite (pyproject's
# testpaths = tests), or the paths given. GPU tests skip without a Hopper GPU; extra pytest args
# pass through (`bash scripts/test.sh tests/test_setup.py -q` runs that file only).
# The whole suite (no arguments) also runs the Tunix integration's tests in their own venv
# (scripts/test_tunix.sh: requirements/cpu.lock + requirements/tunix.lock); TUNIX_TEST_SKIP=1 skips them.
# Platform setup (DETLOGP_PLATFORM, DETLOGP_SETUP=plan, ...): see scripts/_env.sh.
DETLOGP_WHAT="python -m pytest -q -p no:cacheprovider"; [ $# -eq 0 ] || DETLOGP_WHAT+="$(printf ' %q' "$@")"
[ $# -gt 0 ] || [ "${TUNIX_TEST_SKIP:-0}" = 1 ] || DETLOGP_WHAT+=" && bash scripts/test_tunix.sh"
source "$(dirname "$0")/_env.sh"
if [ $# -gt 0 ] || [ "${TUNIX_TEST_SKIP:-0}" = 1 ]; then
  exec "$PYTHON" -m pytest -q -p no:cacheprovider "$@"
fi
"$PYTHON" -m pytest -q -p no:cacheprovider && exec bash "$(dirname "$0")/test_tunix.sh"
