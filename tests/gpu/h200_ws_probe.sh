#!/usr/bin/env bash
# One device call (~6 min, nvidia-h200): the dedicated-epilogue-warpgroup forward
# (sm90_forward_ws) against the shipped prefill kernel, kernel-only, with byte checks
# (benchmarks/probe_kernel.py --groups ws), its ptxas register report, and the chain
# diagnostics of the shipped kernel (--groups epi_next).
# Run from the repo root on the device:  bash tests/gpu/h200_ws_probe.sh
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
TAILN=40 stage probe_ws 300 python3 -m benchmarks.probe_kernel --groups ws --out "$OUT/probe_ws.jsonl" --budget_s 270
TAILN=12 stage ptxas_ws 90 bash -c "EPILOGUE_WGS=1 bash benchmarks/dump_ptxas.sh /tmp/mosaic_ws1; EPILOGUE_WGS=2 bash benchmarks/dump_ptxas.sh /tmp/mosaic_ws2"
TAILN=20 stage probe_epi_next 120 python3 -m benchmarks.probe_kernel --groups epi_next --out "$OUT/probe_epi_next.jsonl" --budget_s 100
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader
finish
