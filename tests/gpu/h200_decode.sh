#!/usr/bin/env bash
# Decode-size forward on the H200 (nvidia-h200; issue 16's M=1 bar, issue 18 item 3) and the main job.
# Stages (DECODE_STAGES, comma-separated; default all, in this order), one device call of <= ~8 min:
#   main      bash scripts/run.sh --out_dir $OUT/main_job (the RL parity job; entropy bytes compared on
#             pallas_sm90 since the backend declares the entropy)
#   fold      tests/gpu/test_pallas_gpu.py -k fold_entropy (the fold with A, every layout, n_split 1..600)
#   entropy   benchmarks.run --entropy at M = 1, 8, 64: forward with vs without the entropy, sequential
#             medians and the interleaved-pairs ratio (entropy_paired_ratio); the bar is <= 1.02x
#   fwd       the trainer forward next to xla and the GEMM alone at M = 1, 8, 64, 512 (bar <= 1.03x of
#             the GEMM alone at M <= 64)
#   overhead  (not in the default set) benchmarks.experiments.call_overhead --m 1,64: the trainer, the
#             GEMM alone, the forward on pre-padded rows and the kernel alone, 10 and 100 calls per sync
#   trace     benchmarks.experiments.trace_calls at M = 1: pallas_sm90 (with and without the entropy;
#             TRACE_ENTROPY=0 leaves that one out) and the GEMM alone, per-kernel device time
#   golden    (not in the default set) the packaged golden records replay (python -m detlogp_jax.golden)
#   unpadded  (not in the default set) tests/gpu/test_pallas_gpu.py -k unpadded_rows: pk.forward with N
#             rows passed unpadded == the padded launch, M = 1, 3, 13, 40 (decode: scalar row loads, an
#             N-row hidden box, the fold's scalar rows); UNPADDED_LIMIT_S
#   probe     (not in the default set) benchmarks.experiments.probe_kernel --groups $PROBE_GROUPS
#             (default decode7: decode kernel variants, pipeline depth, two CTAs per SM, next to the
#             GEMM alone; small7: M = 128..1024 configs; residual7: the residual backward's pieces at
#             M = 4096; chunk7: the recompute backward's time and temp bytes per vocab chunk;
#             ceiling18: the shipped bucket's kernel alone, cuBLAS and JAX's Pallas Hopper GEMM (no
#             epilogue) at M = 512 .. 16384, PROBE_LIMIT_S=330; chain18: the kernel with its chain replaced by pass 1 only /
#             one slice read / both passes without the exp (timing only), M = 1 .. 16384, PROBE_LIMIT_S=420;
#             shape19: JAX's Pallas GEMM at the kernel's CTA tile (2 x 64 x 192, 3 / 4 stages),
#             M = 512 .. 4096, PROBE_LIMIT_S=420; depth19: one 64-row wgmma warpgroup per CTA
#             (5 stages) at M = 512, 1024)
#   fused     (not in the default set; last, so that it gets what is left of a call) tests/gpu/
#             test_pallas_gpu.py -k fused_forward: pk.forward == partials + fold bytes at the Qwen3-8B
#             head, M = 1, 65, 4096, every bucket, and linear_logp (~2 min per M; FUSED_K=M4096 selects one)
# Everything lands in $OUT/results.tgz (RESULTS_NAME). Run from the repo root on the device.
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
STAGES=",${DECODE_STAGES:-main,fold,entropy,fwd,trace},"
if [[ $STAGES == *,golden,* ]]; then
  TAILN=10 stage golden_packaged 150 python3 -m detlogp_jax.golden --backend pallas_sm90
fi
if [[ $STAGES == *,unpadded,* ]]; then
  TAILN=8 stage pytest_unpadded ${UNPADDED_LIMIT_S:-330} python3 -m pytest -v -x -rw tests/gpu/test_pallas_gpu.py -k unpadded_rows
fi
if [[ $STAGES == *,main,* ]]; then
  TAILN=25 stage main_job 180 bash scripts/run.sh --out_dir "$OUT/main_job"
fi
if [[ $STAGES == *,fold,* ]]; then
  TAILN=6 stage pytest_fold_entropy 240 python3 -m pytest -q -x -rw tests/gpu/test_pallas_gpu.py -k fold_entropy
fi
if [[ $STAGES == *,entropy,* ]]; then
  TAILN=12 stage bench_entropy_small 150 python3 -m benchmarks.run --shape qwen3_8b --entry trainer --mode fwd --backends pallas_sm90 --entropy --ms 1,8,64 --warmup 3 --iters 15 --calls_per_sample 10 --max_seconds_per_case 8 --plot none --out "$OUT/bench_entropy_small.json"
fi
if [[ $STAGES == *,fwd,* ]]; then
  TAILN=16 stage bench_fwd_small 150 python3 -m benchmarks.run --shape qwen3_8b --entry trainer --mode fwd --backends pallas_sm90,xla,gemm --ms 1,8,64,512 --warmup 3 --iters 15 --calls_per_sample 10 --max_seconds_per_case 6 --plot none --out "$OUT/fwd_small.json"
fi
if [[ $STAGES == *,overhead,* ]]; then
  TAILN=14 stage call_overhead 120 python3 -m benchmarks.experiments.call_overhead --m 1,64 --out "$OUT/call_overhead.jsonl"
fi
if [[ $STAGES == *,trace,* ]]; then
  TRACE="python3 -m benchmarks.experiments.trace_calls --shape qwen3_8b --m 1 --calls 20"
  TAILN=16 stage trace_m1_pallas 60 $TRACE --backend pallas_sm90 --json "$OUT/trace_m1_pallas.json"
  if [[ ${TRACE_ENTROPY:-1} == 1 ]]; then
    TAILN=16 stage trace_m1_pallas_entropy 60 $TRACE --backend pallas_sm90 --entropy --json "$OUT/trace_m1_pallas_entropy.json"
  fi
  TAILN=8 stage trace_m1_gemm 60 $TRACE --backend gemm --json "$OUT/trace_m1_gemm.json"
fi
if [[ $STAGES == *,probe,* ]]; then
  TAILN=40 stage "probe_$(echo "${PROBE_GROUPS:-decode7}" | tr , _)" ${PROBE_LIMIT_S:-200} python3 -m benchmarks.experiments.probe_kernel --groups ${PROBE_GROUPS:-decode7} --samples 7 --budget_s $(( ${PROBE_LIMIT_S:-200} - 30 )) --out "$OUT/probe_$(echo "${PROBE_GROUPS:-decode7}" | tr , _).jsonl"
fi
if [[ $STAGES == *,fused,* ]]; then
  TAILN=8 stage pytest_fused_forward ${FUSED_LIMIT_S:-400} python3 -m pytest -q -x -rw tests/gpu/test_pallas_gpu.py -k "fused_forward${FUSED_K:+ and ($FUSED_K)}"
fi
finish
