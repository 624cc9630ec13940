#!/usr/bin/env bash
# The main job: the RL parity validation on the best available backend
# (CPU reference by default, the Hopper kernel on an H100/H200).
# Platform setup (DETLOGP_PLATFORM, DETLOGP_SETUP=plan, ...): see scripts/_env.sh.
DETLOGP_WHAT="python -m detlogp_jax.validate"; [ $# -eq 0 ] || DETLOGP_WHAT+="$(printf ' %q' "$@")"
source "$(dirname "$0")/_env.sh"
exec "$PYTHON" -m detlogp_jax.validate "$@"
