#!/usr/bin/env bash
# Small-M trainer sweep with 20 back-to-back calls per synchronized sample (nvidia-h200, ~3 min):
# at M <= 512 a call takes ~0.3-1 ms of device time, so the host's dispatch of the first call
# and the final synchronization (~0.1 ms, not overlapped) would otherwise be a large share of
# every sample; all three backends are timed the same way in the same run.
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
stage bench_fwd_small_m 200 python3 -m benchmarks.run --shape qwen3_8b --entry trainer --mode fwd --backends pallas_sm90,xla,gemm --m 1,2,8,32,64,128,256,512 --warmup 3 --iters 15 --calls_per_sample 20 --max_seconds_per_case 6 --out "$OUT/qwen3_8b_trainer_fwd_small_m_h200.json" --plot "$OUT/qwen3_8b_trainer_fwd_small_m_h200.png"
TAILN=12 stage trace_xla_m1 40 python3 -m benchmarks.experiments.trace_calls --shape qwen3_8b --m 1 --backend xla --calls 10 --json "$OUT/trace_xla_m1.json"
finish
