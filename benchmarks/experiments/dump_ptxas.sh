#!/bin/bash
# Compiles the prefill forward kernel once with Mosaic GPU's dump enabled and
# prints ptxas resource lines (registers, spills) of every kernel compiled.
# Usage (on the GPU machine): bash benchmarks/experiments/dump_ptxas.sh <out_dir>
# Env: CHAIN_IN_WGMMA=1 builds the chain-in-wgmma kernel at the prefill bucket's launch fields
# (default: the shipped sm90_forward_ws prefill kernel).
set -u
out=${1:-/tmp/mosaic_dump}
mkdir -p "$out"
MOSAIC_GPU_DUMP_TO="$out" PYTHONPATH=. python3 - <<'PY'
import os
import jax
from benchmarks.experiments import kernel_timing as kt
from pallas_kernels import tuning
cfg = tuning.BUCKETS["prefill"]
if os.environ.get("CHAIN_IN_WGMMA") == "1":
    cfg = kt.as_wgmma(cfg)
run, prep = kt.kernel_fn(4096, cfg)
h, t = kt.inputs(4096, 1)
a = prep(h, t)
jax.block_until_ready(run(a[0], kt.weight(), a[1], a[2]))
print("compiled", tuning.describe(cfg))
PY
ls "$out" | head -20
grep -h -i -E "registers|spill|stack" "$out"/*ptxas* 2>/dev/null | sort | uniq -c | head -20
