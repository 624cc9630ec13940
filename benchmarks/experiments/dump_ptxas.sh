#!/bin/bash
# Compiles the prefill forward kernel once with Mosaic GPU's dump enabled and
# prints ptxas resource lines (registers, spills) of every kernel compiled.
# Usage (on the GPU machine): bash benchmarks/experiments/dump_ptxas.sh <out_dir>
# Env: EPILOGUE_WGS=0 (the chain-in-wgmma kernel) or 1|2 (sm90_forward_ws epilogue warpgroups).
set -u
out=${1:-/tmp/mosaic_dump}
mkdir -p "$out"
MOSAIC_GPU_DUMP_TO="$out" PYTHONPATH=. python3 - <<'PY'
import dataclasses, os
import jax
from benchmarks.experiments import kernel_timing as kt
from pallas_kernels import tuning
cfg = tuning.BUCKETS["prefill"]
e = os.environ.get("EPILOGUE_WGS")
if e == "0":
    cfg = kt.as_wgmma(cfg)
elif e:
    cfg = dataclasses.replace(cfg, epilogue_wgs=int(e))
run, prep = kt.kernel_fn(4096, cfg)
h, t = kt.inputs(4096, 1)
a = prep(h, t)
jax.block_until_ready(run(a[0], kt.weight(), a[1], a[2]))
print("compiled", tuning.describe(cfg))
PY
ls "$out" | head -20
grep -h -i -E "registers|spill|stack" "$out"/*ptxas* 2>/dev/null | sort | uniq -c | head -20
