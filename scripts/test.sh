#!/usr/bin/env bash
# The test command: sets up .venv (pinned) and runs the whole CPU suite.
# GPU tests skip without a Hopper GPU; extra pytest args pass through.
source "$(dirname "$0")/_env.sh"
exec "$PYTHON" -m pytest -q -p no:cacheprovider tests "$@"
