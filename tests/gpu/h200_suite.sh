#!/usr/bin/env bash
# Every GPU test file and the golden replay in one device call, as concurrent processes (one per
# group below; the GPU's 16 host cores compile in parallel, which is where most of the time goes).
# Bytes do not depend on what else runs on the GPU (that is the contract), so the golden replay
# and the row-bytes tests hold under the contention too; nothing here times anything.
#   body_attention: tests/gpu/test_body_attention_gpu.py
#   body_gemm:      tests/gpu/test_body_gpu.py
#   api_grad:       tests/gpu/test_api_gpu.py, test_grad_gpu.py, test_residuals_gpu.py
#   pallas:         tests/gpu/test_pallas_gpu.py
#   golden:         python -m detlogp_jax.golden --backend pallas_sm90 (the packaged records replay)
# SUITE_GROUPS (comma-separated, default all), SUITE_LIMIT_S (each group's limit, default 540),
# SUITE_DUMP=1: the body attention kernels' Mosaic GPU dumps (.ptx, .ptxas) as $OUT/mosaic_dump.tgz.
# Each group's log is written straight to $OUT/<group>.log (what finished comes back even if the
# call is cut short); $OUT/suite_summary.txt has each group's rc, seconds and last lines.
# Seen on an H100 (the groups side by side): body_gemm 77 s, body_attention 170 s, golden 91 s;
# test_api_gpu.py 149 s and test_grad_gpu.py 202 s each alone; test_pallas_gpu.py had run 16 of
# its 35 tests after 300 s. So the whole suite takes two calls:
#   SUITE_GROUPS=pallas,golden bash tests/gpu/h200_suite.sh
#   SUITE_GROUPS=api_grad,body_gemm,body_attention bash tests/gpu/h200_suite.sh
# Run from the repo root:  bash tests/gpu/h200_suite.sh
set -u
STAGE_DIRECT=1 source "$(dirname "$0")/_stage.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the processes share the GPU's memory
LIMIT=${SUITE_LIMIT_S:-540}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
PYTEST=(python3 -m pytest -m gpu -q -s -rfE -p no:cacheprovider)
group() {  # one group (run in the background): its stage lines appended to the summary at once
  local lines; lines=$(TAILN=3 stage "$1" "$LIMIT" "${@:2}"); echo "$lines" >> "$OUT/suite_summary.txt"; }
: > "$OUT/suite_summary.txt"
IFS=, read -r -a CHOSEN <<< "${SUITE_GROUPS:-body_attention,body_gemm,api_grad,pallas,golden}"
for g in "${CHOSEN[@]}"; do
  case $g in
    body_attention)
      if [[ ${SUITE_DUMP:-0} == 1 ]]; then
        (mkdir -p /tmp/mosaic_dump; MOSAIC_GPU_DUMP_TO=/tmp/mosaic_dump group "$g" "${PYTEST[@]}" \
          tests/gpu/test_body_attention_gpu.py; tar czf "$OUT/mosaic_dump.tgz" -C /tmp mosaic_dump) &
      else
        group "$g" "${PYTEST[@]}" tests/gpu/test_body_attention_gpu.py &
      fi ;;
    body_gemm) group "$g" "${PYTEST[@]}" tests/gpu/test_body_gpu.py & ;;
    api_grad) group "$g" "${PYTEST[@]}" tests/gpu/test_api_gpu.py tests/gpu/test_grad_gpu.py tests/gpu/test_residuals_gpu.py & ;;
    pallas) group "$g" "${PYTEST[@]}" tests/gpu/test_pallas_gpu.py & ;;
    golden) group "$g" python3 -m detlogp_jax.golden --backend pallas_sm90 & ;;
    *) echo "unknown group $g" >&2; exit 2 ;;
  esac
done
wait
cat "$OUT/suite_summary.txt"
