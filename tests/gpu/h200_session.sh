#!/usr/bin/env bash
# One H200 session (nvidia-h200): ladder, golden record, validation, benchmarks.
# Run from the repo root on the device:  bash tests/gpu/h200_session.sh
# Every stage is time-boxed; logs and results land in $OUT.
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
stage ladder 200 env LADDER_BUDGET_S=185 LADDER_STAGE_TIMEOUT_S=120 LADDER_DUMP=0 python3 tests/gpu/run_ladder.py
stage golden 70 python3 -m detlogp_jax.golden --backend pallas_sm90 --record
cp tests/golden/fingerprints.json "$OUT/fingerprints.json"
stage validate 130 python3 -m detlogp_jax.validate --preset qwen3_8b --batch 64 --steps 128 --strict --out_dir "$OUT" --name validate_h200_qwen3_8b_64x128
stage bench_fwd 90 python3 -m benchmarks.run --shape qwen3_8b --entry trainer --mode fwd --backends pallas_sm90,xla,xla_chunked,gemm --m 1,2,8,32,64,128,256,512,1024,2048,4096,8192,16384 --warmup 2 --iters 8 --calls_per_sample 5 --max_seconds_per_case 6 --out "$OUT/qwen3_8b_trainer_fwd_h200.json" --plot "$OUT/qwen3_8b_trainer_fwd_h200.png"
stage bench_serve_bwd 70 bash -c "python3 -m benchmarks.run --shape qwen3_8b --entry serving --mode fwd --m 4096 --backends pallas_sm90,xla --warmup 2 --iters 10 --out $OUT/qwen3_8b_serving_fwd_m4096_h200.json && python3 -m benchmarks.run --shape qwen3_8b --entry trainer --mode fwd_bwd --m 4096 --backends pallas_sm90,xla,xla_chunked --warmup 2 --iters 6 --out $OUT/qwen3_8b_trainer_fwd_bwd_m4096_h200.json"
finish
