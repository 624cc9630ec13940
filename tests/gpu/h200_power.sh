#!/usr/bin/env bash
# Fourth session, last device call (nvidia-h200, ~2 min): SM clock and board power under the
# fused prefill kernel and cuBLAS's GEMM alone (M = 16384; the pipeline-without-the-chain variant is gone with
# the kernels' diagnostics).
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,power.draw,temperature.gpu --format=csv,noheader
TAILN=6 stage power_m16384 150 python3 -m benchmarks.experiments.power_probe --m 16384 --seconds 5 --out "$OUT/power_m16384.jsonl"
finish
