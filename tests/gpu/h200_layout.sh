#!/usr/bin/env bash
# weight_layout="dv" on the H200 (nvidia-h200): pallas_sm90 reading the Flax/Tunix [D, V] kernel in
# place must give the bytes of the [V, D] lm_head path (issue 14, item 1). Two device calls: the GPU
# pytest takes ~400 s at the Qwen3-8B shape (2026-12-01: M=1 ~200 s, M=65 + 4096 197 s), the rest ~170 s:
#   LAYOUT_STAGES=pytest bash tests/gpu/h200_layout.sh
#   LAYOUT_STAGES=bench,ladder bash tests/gpu/h200_layout.sh
#   1. GPU pytest: Qwen3-8B shape, M = 1/65/4096, every bucket forced, bias on/off, per-row T:
#      linear_logp(h, K, t, weight_layout="dv") == linear_logp(h, W, t) in logp/lse/logits bytes.
#   2. Trainer forward timings, M = 1, 64, 4096, vd then dv back to back (the dv kernel K = W.T is
#      made once before timing): $OUT/bench_{vd,dv}.json, and a side-by-side table.
#   3. Ladder stage E (the dv kernel's own logits vs the oracle, trainer == serving, dv == vd, batch
#      invariance probes with dv): $OUT/pallas_ladder.json.
# Everything lands in $OUT/results.tgz (logs, JSON). Validation of the vd path: h200_validate.sh.
# Run from the repo root on the device:  bash tests/gpu/h200_layout.sh
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
STAGES=",${LAYOUT_STAGES:-pytest,bench,ladder},"
if [[ $STAGES == *,pytest,* ]]; then
  TAILN=12 stage pytest_dv 450 python3 -m pytest -q -x tests/gpu/test_pallas_gpu.py -k dv_layout
fi
BENCH="python3 -m benchmarks.run --shape qwen3_8b --entry trainer --mode fwd --backends pallas_sm90 --ms 1,64,4096"
BENCH="$BENCH --warmup 3 --iters 15 --calls_per_sample 10 --max_seconds_per_case 10 --plot none"
if [[ $STAGES == *,bench,* ]]; then
  stage bench_vd 75 $BENCH --weight_layout vd --out "$OUT/bench_vd.json"
  stage bench_dv 75 $BENCH --weight_layout dv --out "$OUT/bench_dv.json"
  TAILN=12 stage bench_compare 10 python3 tests/gpu/compare_bench.py "$OUT/bench_vd.json" "$OUT/bench_dv.json"
fi
if [[ $STAGES == *,ladder,* ]]; then
  TAILN=14 stage ladder_dv 190 env LADDER_BUDGET_S=170 LADDER_STAGE_TIMEOUT_S=150 LADDER_DUMP=0 LADDER_STAGES=E python3 tests/gpu/run_ladder.py
fi
finish
