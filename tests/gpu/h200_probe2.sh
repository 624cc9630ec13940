#!/usr/bin/env bash
# Fourth session, second device call (nvidia-h200, ~3 min): the epilogue-warpgroup kernel for
# the decode and small buckets (probe group decode_ws), plus the live-accumulator check of
# the 3-stage pipeline.
set -u
source "$(dirname "$0")/_stage.sh"
TAILN=24 stage probe_decode_ws 170 python3 -m benchmarks.probe_kernel --groups decode_ws --out "$OUT/probe_decode_ws.jsonl" --budget_s 150
finish
