#!/usr/bin/env bash
# The issue-4/6 benchmarks after the prefill bucket moved to sm90_forward_ws (nvidia-h200,
# ~6 min): trainer forward sweep, serving and fwd+bwd at M=4096, and pipeline probes.
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
stage bench_fwd 200 python3 -m benchmarks.run --shape qwen3_8b --entry trainer --mode fwd --backends pallas_sm90,xla,gemm --m 1,2,8,32,64,128,256,512,1024,2048,4096,8192,16384 --warmup 2 --iters 8 --calls_per_sample 5 --max_seconds_per_case 5 --out "$OUT/qwen3_8b_trainer_fwd_h200.json" --plot "$OUT/qwen3_8b_trainer_fwd_h200.png"
stage bench_serve_bwd 100 bash -c "python3 -m benchmarks.run --shape qwen3_8b --entry serving --mode fwd --m 4096 --backends pallas_sm90,xla --warmup 2 --iters 10 --calls_per_sample 3 --out $OUT/qwen3_8b_serving_fwd_m4096_h200.json && python3 -m benchmarks.run --shape qwen3_8b --entry trainer --mode fwd_bwd --m 4096 --backends pallas_sm90,xla --warmup 2 --iters 6 --calls_per_sample 2 --out $OUT/qwen3_8b_trainer_fwd_bwd_m4096_h200.json"
TAILN=12 stage probe_ws_pipe 60 python3 -m benchmarks.probe_kernel --groups ws_pipe --out "$OUT/probe_ws_pipe.jsonl" --budget_s 50
finish
