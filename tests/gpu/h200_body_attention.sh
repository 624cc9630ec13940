#!/usr/bin/env bash
# The batch-invariant body attention (detlogp_jax.body.attention, pallas_sm90) on the H200, one device call:
#   1. tests/gpu/test_body_attention_gpu.py: float64 correctness at the Qwen3-8B heads, row bytes of
#      decode (B=64 over 4096 slots, left-padded, NaN/inf past the keys) vs prefill (8 x 1024,
#      1 x 4096) vs chunked prefill (ours 0 rows differing, asserted; plain XLA and cuDNN recorded),
#      bit-neutral launch configs; its table closes the log.
#   2. benchmarks/body.py --ops attention: ours vs XLA vs cuDNN for decode and the two prefills:
#      $OUT/body_attention.json and the ratio table.
# The Mosaic GPU dumps (.ptx, .ptxas: registers, spills) of the kernels land in $OUT/mosaic_dump.
# Everything lands in $OUT/results.tgz. Run from the repo root:  bash tests/gpu/h200_body_attention.sh
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
mkdir -p "$OUT/mosaic_dump"
MOSAIC_GPU_DUMP_TO="$OUT/mosaic_dump" TAILN=60 stage pytest_body_attention 420 \
  python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_body_attention_gpu.py
TAILN=20 stage bench_body_attention 300 python3 -m benchmarks.body --ops attention --out "$OUT/body_attention.json"
finish
