#!/usr/bin/env bash
# The first device call of the next session (nvidia-h200, ~4 min): the two open questions of
# docs/PERF_NOTES.md. (1) Does the forward pipeline's speed follow its shared-memory
# footprint? (probe group `smem`: ws with a third of the hand-off buffers; the 3-stage
# chain-in-wgmma pipeline with 96 KiB of unused shared memory.) (2) Where does a decode
# call's time go beyond the forward kernel? (per-kernel device time from a profiler trace.)
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
TAILN=20 stage probe_smem 120 python3 -m benchmarks.probe_kernel --groups smem --out "$OUT/probe_smem.jsonl" --budget_s 100
for m in 1 64 4096; do
  TAILN=16 stage "trace_m$m" 60 python3 -m benchmarks.trace_calls --shape qwen3_8b --m "$m" --backend pallas_sm90 --calls 10 --json "$OUT/trace_m$m.json"
done
TAILN=12 stage trace_xla_m1 60 python3 -m benchmarks.trace_calls --shape qwen3_8b --m 1 --backend xla --calls 10 --json "$OUT/trace_xla_m1.json"
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader
finish
