#!/usr/bin/env bash
# The main job: the RL parity validation on the best available backend
# (CPU reference by default, the Hopper kernel on an H100/H200).
source "$(dirname "$0")/_env.sh"
exec "$PYTHON" -m detlogp_jax.validate "$@"
