#!/usr/bin/env bash
# The GEMM-alone ceiling at the Qwen3-8B lm_head shape (nvidia-h200, ~3 min): cuBLAS and JAX's
# Pallas Hopper GEMM (hopper_matmul_mgpu, a small TuningConfig sweep) at M = 4096 and 16384.
set -u
source "$(dirname "$0")/_stage.sh"
TAILN=20 stage gemm_ceiling_m4096 150 python3 -m benchmarks.experiments.gemm_ceiling --gemm_m 4096 --out "$OUT/gemm_ceiling_m4096.jsonl"
TAILN=6 stage power_gemm 40 nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader
finish
