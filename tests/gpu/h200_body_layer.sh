#!/usr/bin/env bash
# The batch-invariant body as a whole on the H200, one device call (after
# tests/gpu/h200_body_attention.sh has validated the attention kernel):
#   1. benchmarks/body.py --ops layer: a stack of 4 Qwen3-8B-shaped layers, a decode step (B=64
#      over 4096 cache slots), a prefill (8 x 1024) and the trainer's fwd+bwd (8 x 1024), the body
#      on pallas_sm90 vs plain XLA on the same weights: $OUT/body_layer.json and the ratios;
#   2. the main job with the body's kernels (the GEMM and attention named explicitly), the
#      Qwen3-8B head, 64 x 128: rows (a), (b) and (c), $OUT/main_job/.
# Everything lands in $OUT/results.tgz. Run from the repo root:  bash tests/gpu/h200_body_layer.sh
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
TAILN=12 stage bench_body_layer 300 python3 -m benchmarks.body --ops layer --backend pallas_sm90 \
  --iters 10 --calls_per_sample 3 --out "$OUT/body_layer.json"
TAILN=6 stage main_job 260 python3 -m detlogp_jax.validate --body_backend pallas_sm90 --out_dir "$OUT/main_job"
finish
