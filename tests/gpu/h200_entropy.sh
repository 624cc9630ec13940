#!/usr/bin/env bash
# The entropy statistic (linear-logp-entropy-v1) in the pallas_sm90 kernels on the H200 (nvidia-h200;
# issue 16, item 3): the validation the registry entry's entropy declaration (pallas_kernels/backend.py)
# rests on; a kernel change that touches the statistic runs it again before it ships. Stages (ENTROPY_STAGES, comma-separated; default all, in this order), each device call
# <= ~9 minutes; the suggested calls (timings not measured yet: the entropy variants compile on
# first use, ~15 new Qwen3-8B-shape kernels per M):
#   ENTROPY_STAGES=pytest_small bash tests/gpu/h200_entropy.sh        # M=1, M=65, the fold
#   ENTROPY_STAGES=pytest_4096 bash tests/gpu/h200_entropy.sh         # M=4096
#   ENTROPY_STAGES=ladder bash tests/gpu/h200_entropy.sh              # ladder stage F
#     (ENTROPY_LADDER_BUDGET_S, default 500: the ladder's wall budget; the stage gets 20 s more)
#   ENTROPY_STAGES=bench,golden bash tests/gpu/h200_entropy.sh        # timings, golden records
# 1. pytest_small / pytest_4096: tests/gpu/test_pallas_gpu.py -k entropy at the Qwen3-8B shape
#    (D=4096, V_rows=152064, vocab 151936, bf16), every bucket forced, bias on/off, per-row T: the
#    kernels' (m, S, A) and entropy == the oracle's of their own logits, rows alone == in the batch,
#    return_entropy on/off changes no logp/lse/logits byte, trainer == serving; the fold with A
#    (every layout, edge rows, 4096 random rows) == oracle.fold_entropy.
# 2. ladder: tests/gpu/run_ladder.py stage F (F1 oracle + on/off + trainer==serving at M=1/300/4096
#    and M=65 with bias + per-row T; F2 batch invariance of A and the entropy over M = 1..16384):
#    $OUT/pallas_ladder.json.
# 3. bench: trainer forward with vs without the entropy in the same run (benchmarks.run --entropy), M = 1,
#    64, 4096, 16384: the bars are <= 1.02x at M=4096/16384 and at decode (M=1, 64): $OUT/bench_entropy.json;
#    then fwd+bwd at M=4096 of sum(logp) + 0.01 * sum(entropy) vs sum(logp) (bar <= 1.03x; the entropy
#    cotangent runs in the fused dz kernel): $OUT/bench_entropy_fwd_bwd.json.
# 4. golden: records the GPU golden entropy records (key .../linear-logp-entropy-v1/jax<v>/pallas_sm90,
#    field entropy_sha256; the contract records of the key are re-recorded with the same bytes) into
#    $OUT/fingerprints.json, then replays against that file (must pass); merge it into
#    detlogp_jax/apps/data/fingerprints.json when the statistic's bytes changed.
# 5. packaged (not in the default set): the packaged golden records replay with the shipped entry;
#    the fold-with-A pytest. 6. trace (not in the default set): the M=1 call traced
#    with and without the entropy (benchmarks.experiments.trace_calls --entropy).
# Everything lands in $OUT/results.tgz (logs, JSON). Run from the repo root on the device.
set -u
source "$(dirname "$0")/_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
STAGES=",${ENTROPY_STAGES:-pytest_small,pytest_4096,ladder,bench,golden},"
PYTEST="python3 -m pytest -q -x -rw tests/gpu/test_pallas_gpu.py"
if [[ $STAGES == *,pytest_small,* ]]; then
  TAILN=14 stage pytest_entropy_small 520 $PYTEST -k "(entropy_at_the_qwen_shape and (M1 or M65)) or fold_entropy"
fi
if [[ $STAGES == *,pytest_4096,* ]]; then
  TAILN=14 stage pytest_entropy_4096 520 $PYTEST -k "entropy_at_the_qwen_shape and M4096"
fi
if [[ $STAGES == *,ladder,* ]]; then
  LB=${ENTROPY_LADDER_BUDGET_S:-500}
  TAILN=14 stage ladder_entropy $((LB + 20)) env LADDER_BUDGET_S=$LB LADDER_STAGE_TIMEOUT_S=$((LB - 20)) LADDER_DUMP=0 LADDER_STAGES=F python3 tests/gpu/run_ladder.py
fi
if [[ $STAGES == *,bench,* ]]; then
  BENCH="python3 -m benchmarks.run --shape qwen3_8b --entry trainer --mode fwd"
  BENCH="$BENCH --backends pallas_sm90 --entropy --ms 1,64,4096,16384 --warmup 3 --iters 15 --calls_per_sample 10"
  TAILN=16 stage bench_entropy 300 $BENCH --max_seconds_per_case 10 --plot none --out "$OUT/bench_entropy.json"
  BENCH="python3 -m benchmarks.run --shape qwen3_8b --entry trainer --mode fwd_bwd"
  BENCH="$BENCH --backends pallas_sm90 --entropy --ms 4096 --warmup 2 --iters 7 --calls_per_sample 2"
  TAILN=8 stage bench_entropy_fwd_bwd 120 $BENCH --plot none --out "$OUT/bench_entropy_fwd_bwd.json"
fi
if [[ $STAGES == *,golden,* ]]; then
  GOLDEN="python3 -m detlogp_jax.golden --backend pallas_sm90"
  TAILN=12 stage golden_record 200 $GOLDEN --record --out "$OUT/fingerprints.json"
  TAILN=12 stage golden_replay 120 $GOLDEN --fingerprints "$OUT/fingerprints.json"
fi
# The packaged records replay in a fresh process with the shipped entry, and the fold with A on the GPU.
if [[ $STAGES == *,packaged,* ]]; then
  TAILN=12 stage golden_packaged 150 python3 -m detlogp_jax.golden --backend pallas_sm90
  TAILN=6 stage pytest_fold_entropy 150 $PYTEST -k fold_entropy
fi
# Where the decode call's time goes with and without the statistic (per-kernel device time).
if [[ $STAGES == *,trace,* ]]; then
  for e in noentropy entropy; do
    TAILN=14 stage "trace_m1_$e" 60 python3 -m benchmarks.experiments.trace_calls --shape qwen3_8b --m 1 --backend pallas_sm90 --calls 20 --$e --json "$OUT/trace_m1_$e.json"
  done
fi
finish
