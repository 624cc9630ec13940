#!/usr/bin/env bash
# The training step on the H200 (nvidia-h200; issue 18): gradient tests, then forward + backward
# timings next to the XLA lane and the GEMM alone, in the same run. Stages (TRAIN_STAGES,
# comma-separated, run in this order; default bench,trace). One device call holds at most
# ~560 s of stage limits: e.g. `grad,resid` (480 s), `bench,trace` (480 s), `fwd,walk` (440 s).
#   grad      tests/gpu/test_grad_gpu.py (float64 comparison, both layouts, run-to-run identical
#             bytes; ~160 s)
#   resid     tests/gpu/test_residuals_gpu.py (both residual modes, both layouts; ~210 s)
#   bench     benchmarks.run --mode fwd_bwd at M = 4096, 16384 (the issue's timing: 3 warmup calls,
#             7 samples of 10 back-to-back calls): pallas_sm90 (recompute), xla, gemm, gemm_remat
#             (the GEMM alone with its logits recomputed: the recompute mode's four passes); then
#             pallas_sm90 with --residuals logits (temp_MB per case in the JSON; peak_MB is the
#             process's high-water mark), and the [D, V] kernel (--weight_layout dv, recompute) at
#             M = 4096
#   fwd       the trainer forward next to xla and the GEMM alone at M = 1, 64, 512, 4096, 16384
#   trace     benchmarks.experiments.trace_calls --mode fwd_bwd --m 4096: where the time goes
#   walk      benchmarks.experiments.probe_kernel --groups walk10: the backward alone with the
#             shipped in-place chunk walk vs the slice walk and variants (the gradient GEMMs
#             without clusters, the last chunk clamped;
#             M = 4096, 16384; rows whose dh / dW bytes differ; [D, V] at 4096; TP=4 / 8 shards
#             with the last chunk rounded up vs clamped)
#   shards    benchmarks.experiments.probe_kernel --groups shards13: walk10's TP = 4 / 8 shards only
#             (their last chunk's dW block written before the full chunks; rounded vs clamped),
#             and a TP=8 shard of the padded Llama-3 head (16064 rows): in place vs slices
#   mid       benchmarks.experiments.probe_kernel --groups mid12: the prefill kernel's work order
#             (split_group 0 / 2 / 4 / 8) at M = 384 .. 4096 next to the GEMM alone (a fourth bucket?)
#   overhead  benchmarks.experiments.call_overhead --m 1,64: the decode call's enqueue time, latency and
#             10 vs 100 back-to-back calls per sync for the trainer forward, the GEMM alone, the
#             forward on pre-padded rows and the kernel alone (where the runner's 1.086x at M=1 goes);
#             then the training step at M=4096 next to gemm_remat (the runner's time vs the trace's;
#             that part alone: overhead_bwd)
#   dsf       the recompute lane again with XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true
#             (does XLA fuse the chunk walk's slices into the GEMMs?)
# Everything lands in $OUT/results.tgz. Run from the repo root on the device.
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
STAGES=",${TRAIN_STAGES:-bench,trace},"
MS=${TRAIN_MS:-4096,16384}
RUN="python3 -m benchmarks.run --shape qwen3_8b --entry trainer --mode fwd_bwd --warmup 3 --iters 7 --calls_per_sample 10"
if [[ $STAGES == *,grad,* ]]; then
  TAILN=10 stage grad_tests 220 python3 -m pytest -q -x -rw tests/gpu/test_grad_gpu.py
fi
if [[ $STAGES == *,resid,* ]]; then
  TAILN=10 stage residual_tests 260 python3 -m pytest -q -x -rw tests/gpu/test_residuals_gpu.py
fi
if [[ $STAGES == *,bench,* ]]; then
  TAILN=10 stage bench_recompute 230 $RUN --m "$MS" --backends pallas_sm90,xla,gemm,gemm_remat --plot none --out "$OUT/fwd_bwd_recompute.json"
  TAILN=6 stage bench_logits 100 $RUN --m "$MS" --backends pallas_sm90 --residuals logits --plot none --out "$OUT/fwd_bwd_logits.json"
  TAILN=6 stage bench_dv 90 $RUN --m 4096 --backends pallas_sm90 --weight_layout dv --plot none --out "$OUT/fwd_bwd_dv.json"
fi
if [[ $STAGES == *,fwd,* ]]; then
  TAILN=14 stage bench_fwd 120 python3 -m benchmarks.run --shape qwen3_8b --entry trainer --mode fwd --backends pallas_sm90,xla,gemm --m 1,64,512,4096,16384 --warmup 3 --iters 10 --calls_per_sample 10 --max_seconds_per_case 8 --plot none --out "$OUT/fwd.json"
fi
if [[ $STAGES == *,trace,* ]]; then
  TAILN=30 stage trace_fwd_bwd 60 python3 -m benchmarks.experiments.trace_calls --shape qwen3_8b --m 4096 --mode fwd_bwd --backend pallas_sm90 --calls 5 --json "$OUT/trace_fwd_bwd_m4096.json"
fi
if [[ $STAGES == *,walk,* ]]; then
  TAILN=30 stage walk10 320 python3 -m benchmarks.experiments.probe_kernel --groups walk10 --budget_s 280 --out "$OUT/probe_walk10.jsonl"
fi
if [[ $STAGES == *,shards,* ]]; then
  TAILN=12 stage shards13 150 python3 -m benchmarks.experiments.probe_kernel --groups shards13 --budget_s 120 --out "$OUT/probe_shards13.jsonl"
fi
if [[ $STAGES == *,mid,* ]]; then
  TAILN=30 stage mid12 240 python3 -m benchmarks.experiments.probe_kernel --groups mid12 --budget_s 220 --out "$OUT/probe_mid12.jsonl"
fi
if [[ $STAGES == *,overhead,* ]]; then
  TAILN=14 stage call_overhead 120 python3 -m benchmarks.experiments.call_overhead --m 1,64 --out "$OUT/call_overhead.jsonl"
fi
if [[ $STAGES == *,overhead,* || $STAGES == *,overhead_bwd,* ]]; then
  TAILN=4 stage call_overhead_bwd 120 python3 -m benchmarks.experiments.call_overhead --mode fwd_bwd --m 4096 --lanes trainer,gemm_remat --samples 5 --out "$OUT/call_overhead.jsonl"
fi
if [[ $STAGES == *,dsf,* ]]; then
  TAILN=6 stage bench_dsf 80 env XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true $RUN --m 4096 --backends pallas_sm90 --plot none --out "$OUT/fwd_bwd_dsf.json"
fi
finish
