#!/usr/bin/env bash
# Contract re-validation after a kernel change (nvidia-h200), one call of <= ~9.7 minutes
# (third session: GPU pytest 123 s + the logits_cols/inv_t tests, ladder 243 s, golden 41 s;
# eighth session: ladder 222 s, golden ~40 s; ninth: ladder 211 s, golden 84 s):
# GPU pytest (gradients, fold layouts, kernel vs oracle), the ladder (all stages),
# the golden REPLAY (the records must not change). Benchmarks: tests/gpu/h200_bench.sh.
# Stages (VALIDATE_STAGES, comma-separated; default all, in this order): pytest (VALIDATE_PYTEST:
# the test files, default the gradient and kernel test files; VALIDATE_K: a -k expression), ladder,
# golden.
# Run from the repo root on the device:  bash tests/gpu/h200_validate.sh
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
STAGES=",${VALIDATE_STAGES:-pytest,ladder,golden},"
if [[ $STAGES == *,pytest,* ]]; then
  # shellcheck disable=SC2086  # VALIDATE_PYTEST is a list of test files
  stage pytest_gpu ${PYTEST_LIMIT_S:-240} python3 -m pytest -q -rw -p no:cacheprovider ${VALIDATE_PYTEST:-tests/gpu/test_grad_gpu.py tests/gpu/test_pallas_gpu.py} ${VALIDATE_K:+-k "$VALIDATE_K"}
fi
if [[ $STAGES == *,ladder,* ]]; then
  stage ladder 285 env LADDER_BUDGET_S=265 LADDER_STAGE_TIMEOUT_S=180 LADDER_DUMP=0 LADDER_STAGES=ACB python3 tests/gpu/run_ladder.py
fi
if [[ $STAGES == *,golden,* ]]; then
  TAILN=10 stage golden_replay 90 python3 -m detlogp_jax.golden --backend pallas_sm90
fi
finish
