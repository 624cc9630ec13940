#!/usr/bin/env bash
# The H200 benchmarks of issues 4 and 6 (nvidia-h200), one call of ~6 minutes:
# the trainer forward sweep M = 1 ... 16384, serving and fwd+bwd at M = 4096,
# one kernel probe group (PROBE_GROUP, default fold). Validation: tests/gpu/h200_validate.sh.
# Run from the repo root on the device:  bash tests/gpu/h200_bench.sh
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
stage bench_fwd 200 python3 -m benchmarks.run --shape qwen3_8b --entry trainer --mode fwd --backends pallas_sm90,xla,gemm --m 1,2,8,32,64,128,256,512,1024,2048,4096,8192,16384 --warmup 2 --iters 8 --calls_per_sample 5 --max_seconds_per_case 5 --out "$OUT/qwen3_8b_trainer_fwd_h200.json" --plot "$OUT/qwen3_8b_trainer_fwd_h200.png"
stage bench_serve_bwd 100 bash -c "python3 -m benchmarks.run --shape qwen3_8b --entry serving --mode fwd --m 4096 --backends pallas_sm90,xla --warmup 2 --iters 10 --calls_per_sample 3 --out $OUT/qwen3_8b_serving_fwd_m4096_h200.json && python3 -m benchmarks.run --shape qwen3_8b --entry trainer --mode fwd_bwd --m 4096 --backends pallas_sm90,xla --warmup 2 --iters 6 --calls_per_sample 2 --out $OUT/qwen3_8b_trainer_fwd_bwd_m4096_h200.json"
# The decode call's per-kernel device time, then the closing kernel probe: PROBE_GROUP (default fold;
# the third session ran ws_pipe, since removed).
g=${PROBE_GROUP:-fold}
TAILN=12 stage trace_m1 40 python3 -m benchmarks.experiments.trace_calls --shape qwen3_8b --m 1 --backend pallas_sm90 --calls 10 --json "$OUT/trace_m1.json"
TAILN=12 stage "probe_$g" 60 python3 -m benchmarks.experiments.probe_kernel --groups "$g" --out "$OUT/probe_$g.jsonl" --budget_s 50
finish
