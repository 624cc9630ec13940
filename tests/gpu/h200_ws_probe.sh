#!/usr/bin/env bash
# One device call (~5 min, nvidia-h200): the dedicated-epilogue-warpgroup forward
# (sm90_forward_ws) against the shipped prefill kernel, kernel-only, with byte checks
# (benchmarks/probe_kernel.py --groups ws), and its ptxas report and SASS.
# Run from the repo root on the device:  bash tests/gpu/h200_ws_probe.sh
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
TAILN=30 stage probe_ws 240 python3 -m benchmarks.probe_kernel --groups ws --out "$OUT/probe_ws.jsonl" --budget_s 210

nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader
finish
