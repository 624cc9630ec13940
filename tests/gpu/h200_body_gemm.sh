#!/usr/bin/env bash
# The batch-invariant body GEMM (detlogp_jax.body.gemm, pallas_sm90) on the H200, one device call:
#   1. tests/gpu/test_body_gpu.py: float64 correctness, row bytes across M / positions / NaN rows
#      (ours 0 rows differing, asserted; plain XLA recorded), buckets and CTA counts, the measured
#      kn-vs-nk and instruction-N lines; its table closes the log.
#   2. benchmarks/body.py: ours vs jnp.dot vs cuBLAS (torch) at the Qwen3-8B projections,
#      M = 1, 8, 64, 512, 4096, 8192: $OUT/body_gemm.json and the ratio table.
# Everything lands in $OUT/results.tgz. Run from the repo root:  bash tests/gpu/h200_body_gemm.sh
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
TAILN=75 stage pytest_body 320 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_body_gpu.py
TAILN=30 stage bench_body 230 python3 -m benchmarks.body --ops gemm --out "$OUT/body_gemm.json"
finish
