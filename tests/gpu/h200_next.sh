#!/usr/bin/env bash
# The fourth session's first device call (nvidia-h200, ~3 min): (1) TMA multicast of the
# weight over 2-CTA clusters (probe group `cluster`: time and bytes vs the shipped prefill
# config); (2) does the forward pipeline's speed follow its shared-memory footprint?
# (group `smem`); (3) where a decode call's time goes beyond the forward kernel
# (per-kernel device time from a profiler trace).
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
TAILN=20 stage probe_cluster 200 python3 -m benchmarks.probe_kernel --groups cluster --out "$OUT/probe_cluster.jsonl" --budget_s 180
TAILN=10 stage probe_smem 110 python3 -m benchmarks.probe_kernel --groups smem --out "$OUT/probe_smem.jsonl" --budget_s 90
for m in 1 64; do
  TAILN=16 stage "trace_m$m" 50 python3 -m benchmarks.trace_calls --shape qwen3_8b --m "$m" --backend pallas_sm90 --calls 10 --json "$OUT/trace_m$m.json"
done
TAILN=12 stage trace_xla_m1 45 python3 -m benchmarks.trace_calls --shape qwen3_8b --m 1 --backend xla --calls 10 --json "$OUT/trace_xla_m1.json"
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader
finish
