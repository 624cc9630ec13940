#!/usr/bin/env bash
# Every GPU test file and the golden replay in one device call, as concurrent processes (one per
# group below; the GPU's 16 host cores compile in parallel, which is where most of the time goes).
# Bytes do not depend on what else runs on the GPU (that is the contract), so the golden replay
# and the row-bytes tests hold under the contention too; nothing here times anything.
#   body_attention: tests/gpu/test_body_attention_gpu.py (the Mosaic GPU dumps in $OUT/mosaic_dump)
#   body_gemm:      tests/gpu/test_body_gpu.py
#   api_grad:       tests/gpu/test_api_gpu.py, test_grad_gpu.py, test_residuals_gpu.py
#   pallas:         tests/gpu/test_pallas_gpu.py
#   golden:         python -m detlogp_jax.golden --backend pallas_sm90 (the packaged records replay)
# SUITE_GROUPS (comma-separated, default all), SUITE_LIMIT_S (each group's limit, default 330).
# Each group's log is $OUT/<group>.log; $OUT/suite_summary.txt has one line per group (rc, seconds).
# Run from the repo root:  bash tests/gpu/h200_suite.sh
set -u
source "$(dirname "$0")/_stage.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the processes share the GPU's memory
LIMIT=${SUITE_LIMIT_S:-330}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
PYTEST=(python3 -m pytest -m gpu -q -s -rfE -p no:cacheprovider)
group() {  # group NAME CMD...: runs CMD under the limit, its log in $OUT/NAME.log
  local name=$1 t0; shift; t0=$(date +%s)
  timeout "$LIMIT" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s" >> "$OUT/suite_summary.txt"
}
: > "$OUT/suite_summary.txt"
IFS=, read -r -a CHOSEN <<< "${SUITE_GROUPS:-body_attention,body_gemm,api_grad,pallas,golden}"
for g in "${CHOSEN[@]}"; do
  case $g in
    body_attention) mkdir -p "$OUT/mosaic_dump"
      MOSAIC_GPU_DUMP_TO="$OUT/mosaic_dump" group "$g" "${PYTEST[@]}" tests/gpu/test_body_attention_gpu.py & ;;
    body_gemm) group "$g" "${PYTEST[@]}" tests/gpu/test_body_gpu.py & ;;
    api_grad) group "$g" "${PYTEST[@]}" tests/gpu/test_api_gpu.py tests/gpu/test_grad_gpu.py tests/gpu/test_residuals_gpu.py & ;;
    pallas) group "$g" "${PYTEST[@]}" tests/gpu/test_pallas_gpu.py & ;;
    golden) group "$g" python3 -m detlogp_jax.golden --backend pallas_sm90 & ;;
    *) echo "unknown group $g" >&2; exit 2 ;;
  esac
done
wait
echo "=== suite"; cat "$OUT/suite_summary.txt"
for g in "${CHOSEN[@]}"; do echo "=== $g"; grep -E "passed|failed|error|FAIL|Error" "$OUT/$g.log" | tail -n 6; done
finish
