#!/usr/bin/env bash
# The batch-invariant body on a Hopper GPU, one device call (~5 minutes), every file straight into
# $OUT (what finished comes back even if the call is cut short):
#   1. concurrently (bytes only, nothing timed): tests/gpu/test_body_attention_gpu.py (the kernel
#      vs float64; decode vs prefill vs chunks, ours 0 rows differing, XLA and cuDNN recorded;
#      launch configs; its table closes the log) and the main job on the body's kernels ("auto"
#      takes both), $OUT/main_job.tgz;
#   2. one after the other, each ratio to plain XLA measured in the same run: attention (decode
#      B=64 over 4096 slots, prefill 8 x 1024 and 1 x 4096, vs XLA and cuDNN), the GEMM at the
#      Qwen3-8B projections (M = 1, 64, 512, 4096, vs jnp.dot and cuBLAS), 4 Qwen3-8B layers
#      (decode, prefill, the trainer's fwd+bwd): $OUT/body_{attention,gemm,layer}.{json,log}.
# BODY_STAGES (comma-separated, run in the order given; default tests,attention,gemm,layer).
# The GEMM's own GPU tests: python3 -m pytest -m gpu -q -s tests/gpu/test_body_gpu.py
# (or the suite, bash tests/gpu/h200_suite.sh). Run from the repo root:  bash tests/gpu/h200_body.sh
set -u
STAGE_DIRECT=1 source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
IFS=, read -r -a CHOSEN <<< "${BODY_STAGES:-tests,attention,gemm,layer}"
for st in "${CHOSEN[@]}"; do  # in the order given
  case $st in
    tests)
      export XLA_PYTHON_CLIENT_PREALLOCATE=false  # two processes share the GPU
      (TAILN=6 stage main_job 240 python3 -m detlogp_jax.validate --out_dir /tmp/main_job
       cp "$OUT/main_job.log" /tmp/main_job/ 2>/dev/null; tar czf "$OUT/main_job.tgz" -C /tmp main_job) &
      TAILN=44 stage pytest_body_attention 240 python3 -m pytest -m gpu -q -s -rfE -p no:cacheprovider \
        tests/gpu/test_body_attention_gpu.py
      wait
      unset XLA_PYTHON_CLIENT_PREALLOCATE ;;
    attention)
      TAILN=6 stage body_attention 120 python3 -m benchmarks.body --ops attention --out "$OUT/body_attention.json" ;;
    gemm)
      TAILN=19 stage body_gemm 90 python3 -m benchmarks.body --ops gemm --m 1,64,512,4096 --out "$OUT/body_gemm.json" ;;
    layer)
      TAILN=5 stage body_layer 150 python3 -m benchmarks.body --ops layer --iters 8 --calls_per_sample 3 \
        --out "$OUT/body_layer.json" ;;
    *) echo "unknown stage $st" >&2; exit 2 ;;
  esac
done
