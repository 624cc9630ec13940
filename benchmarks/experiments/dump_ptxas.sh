#!/bin/bash
# Compiles the prefill forward kernel once with Mosaic GPU's dump enabled and
# prints ptxas resource lines (registers, spills) of every kernel compiled.
# Usage (on the GPU machine): bash benchmarks/experiments/dump_ptxas.sh <out_dir> [diag,...]
# Env: EPILOGUE_WGS=1|2 (sm90_forward_ws).
set -u
out=${1:-/tmp/mosaic_dump}
mkdir -p "$out"
MOSAIC_GPU_DUMP_TO="$out" PYTHONPATH=. python3 - "${2:-}" <<'PY'
import sys, jax, jax.numpy as jnp
from benchmarks.experiments import probe_kernel as pk
from pallas_kernels import tuning
diag = tuple(x for x in sys.argv[1].split(",") if x)
import dataclasses, os
cfg = tuning.BUCKETS["prefill"]
if os.environ.get("EPILOGUE_WGS"): cfg = dataclasses.replace(cfg, epilogue_wgs=int(os.environ["EPILOGUE_WGS"]))
run, prep = pk._kernel_fn(4096, cfg, diag=diag)
h, t = pk._inputs(4096, 1)
a = prep(h, t)
jax.block_until_ready(run(a[0], pk._weight(), a[1], a[2]))
print("compiled", diag)
PY
ls "$out" | head -20
grep -h -i -E "registers|spill|stack" "$out"/*ptxas* 2>/dev/null | sort | uniq -c | head -20
