#!/usr/bin/env bash
# (Kept as the script of the 2026-11-30 second-session run; its stage limits cut the
# forward sweep at M=8192 and the pytest/golden stages at their teardown. Use
# h200_validate.sh and h200_bench.sh instead.) Re-validation and benchmarks after
# kernel changes (nvidia-h200), one call of
# ~8 minutes: GPU pytest (gradients, fold layouts, entries), the contract
# ladder (stages A, C, B with the M sweep cut by the budget), the golden
# REPLAY (the records must not change), the trainer forward sweep, serving and
# fwd+bwd at M=4096, and the fold layouts' timings.
# Run from the repo root on the device:  bash tests/gpu/h200_final.sh
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
stage pytest_gpu 100 python3 -m pytest -q -x tests/gpu/test_grad_gpu.py tests/gpu/test_pallas_gpu.py -k "grad or fused or fold or oracle_and_entries"
stage ladder 160 env LADDER_BUDGET_S=150 LADDER_STAGE_TIMEOUT_S=120 LADDER_DUMP=0 LADDER_STAGES=ACB python3 tests/gpu/run_ladder.py
stage golden_replay 45 python3 -m detlogp_jax.golden --backend pallas_sm90
stage bench_fwd 110 python3 -m benchmarks.run --shape qwen3_8b --entry trainer --mode fwd --backends pallas_sm90,xla,gemm --m 1,2,8,32,64,128,256,512,1024,2048,4096,8192,16384 --warmup 2 --iters 8 --calls_per_sample 5 --max_seconds_per_case 5 --out "$OUT/qwen3_8b_trainer_fwd_h200.json" --plot "$OUT/qwen3_8b_trainer_fwd_h200.png"
stage bench_serve_bwd 80 bash -c "python3 -m benchmarks.run --shape qwen3_8b --entry serving --mode fwd --m 4096 --backends pallas_sm90,xla --warmup 2 --iters 10 --calls_per_sample 3 --out $OUT/qwen3_8b_serving_fwd_m4096_h200.json && python3 -m benchmarks.run --shape qwen3_8b --entry trainer --mode fwd_bwd --m 4096 --backends pallas_sm90,xla --warmup 2 --iters 6 --calls_per_sample 2 --out $OUT/qwen3_8b_trainer_fwd_bwd_m4096_h200.json"
stage probe_fold 40 python3 -m benchmarks.probe_kernel --groups fold --out "$OUT/probe_fold.jsonl"
finish
