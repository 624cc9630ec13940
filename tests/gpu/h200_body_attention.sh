#!/usr/bin/env bash
# The batch-invariant body attention (detlogp_jax.body.attention, pallas_sm90) on the H200, one device call:
#   1. tests/gpu/test_body_attention_gpu.py: float64 correctness at the Qwen3-8B heads, row bytes of
#      decode (B=64 over 4096 slots, left-padded, NaN/inf past the keys) vs prefill (8 x 1024,
#      1 x 4096) vs chunked prefill (ours 0 rows differing, asserted; plain XLA and cuDNN recorded),
#      bit-neutral launch configs; its table closes the log.
#   2. benchmarks/body.py --ops attention: ours vs XLA vs cuDNN for decode and the two prefills:
#      $OUT/body_attention.json and the ratio table; then ours with the one-warpgroup configs
#      (bit-neutral alternatives of the two-warpgroup defaults): $OUT/body_attention_1wg_*.json.
# The Mosaic GPU dumps (.ptx, .ptxas: registers, spills) of the kernels land in $OUT/mosaic_dump.
# Stage limits add up to 560 s (one 10-minute device call). Everything lands in $OUT/results.tgz.
# Run from the repo root:  bash tests/gpu/h200_body_attention.sh
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
mkdir -p "$OUT/mosaic_dump"
MOSAIC_GPU_DUMP_TO="$OUT/mosaic_dump" TAILN=60 stage pytest_body_attention 280 \
  python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_body_attention_gpu.py
TAILN=20 stage bench_body_attention 170 python3 -m benchmarks.body --ops attention --backend pallas_sm90 --out "$OUT/body_attention.json"
TAILN=8 stage bench_attention_decode_1wg 50 python3 -m benchmarks.body --ops attention --backend pallas_sm90 --attn_cases decode \
  --attn_lanes ours,xla --iters 10 --attn_config decode_1wg --out "$OUT/body_attention_1wg_decode.json"
TAILN=8 stage bench_attention_prefill_1wg 60 python3 -m benchmarks.body --ops attention --backend pallas_sm90 \
  --attn_cases prefill,prefill_long --attn_lanes ours,xla --iters 10 --attn_config prefill_1wg \
  --out "$OUT/body_attention_1wg_prefill.json"
finish
