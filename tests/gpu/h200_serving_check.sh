#!/usr/bin/env bash
# After the logits_cols change (nvidia-h200, ~4 min): GPU kernel tests (incl. logits_cols on
# every bucket and the serving API vs the oracle), ladder stages A1 (Qwen trainer == serving,
# oracle) and A2 (odd shapes, bias, per-row T), and the serving benchmark at M=4096.
set -u
source "$(dirname "$0")/_stage.sh"
stage pytest_gpu 100 python3 -m pytest -q -x tests/gpu/test_pallas_gpu.py
stage ladder_a 170 env LADDER_BUDGET_S=160 LADDER_STAGE_TIMEOUT_S=150 LADDER_DUMP=0 LADDER_STAGES=A python3 tests/gpu/run_ladder.py
stage bench_serve 60 python3 -m benchmarks.run --shape qwen3_8b --entry serving --mode fwd --m 4096 --backends pallas_sm90,xla --warmup 2 --iters 10 --calls_per_sample 3 --out "$OUT/qwen3_8b_serving_fwd_m4096_h200.json" --plot "$OUT/qwen3_8b_serving_fwd_m4096_h200.png"
finish
