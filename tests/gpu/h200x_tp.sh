#!/usr/bin/env bash
# Issue 19, tensor parallelism on several H200s, one device call on whatever GPU count is present:
#   kind nvidia-h200-x2: TP 1, 2                              expected ~5 min
#   kind nvidia-h200-x4: TP 1, 2, 4 and TP2xDP2               expected ~7 min
#   kind nvidia-h200-x8: TP 1, 2, 4, 8, TP2xDP2 and TP4xDP2   expected ~9.5 min (the stage limits cap it)
# (estimates from the one-GPU compile times, ~2.5-4 s a program, and one partials variant compiled per
# TP rank; no multi-GPU run of these scripts yet). Each stage is time-boxed; tp_multi.py skips the groups
# that do not fit its budget and lists them with the flags for a second call, e.g.
#   H200X_STAGES=tp TPM_LAYOUTS=dv bash tests/gpu/h200x_tp.sh
# Stages:
#   tp  tests/gpu/tp_multi.py --mode all: Qwen3-8B and Llama-3-8B lm_heads, [V, D] and [D, V] (dv only where
#       pallas_sm90 reads it), M = 1, 64, 4096, 16384, targets at the shard edges, strict mode:
#       logp/lse and entropy bytes of every mesh vs one GPU (the forwards return the entropy: TPM_ENTROPY=off
#       times logp/lse alone); time per call and scaling efficiency TP1 / (devices x TPk);
#       the pieces of one TP call at M=4096 (local partials, all_gather, fold) and a profiler trace;
#       gradients at M=4096 vs one GPU (rel. Frobenius < 1e-2, bf16) and run to run, fwd+bwd time.
#   mp  tests/gpu/tp_multiprocess.py --n <GPUs>: one JAX process per GPU, TP over processes vs one process,
#       Qwen3-8B [V, D] at M = 1, 4096 (MP_LAYOUTS=vd,dv adds the [D, V] kernel).
# Results: $OUT/results.tgz: tp_multi.json (with the trace summaries), tp_multiprocess.json, every stage's log, the raw
# profiler trace only if it is small.
# Run from the repo root on the device:  bash tests/gpu/h200x_tp.sh
# CPU rehearsal (8 host devices, reference backend, tiny shape, 2 CPU processes; ~2 min on 2 cores):
#   H200X_DRY=1 PYTHON=.venv/bin/python OUT=/tmp/out bash tests/gpu/h200x_tp.sh
set -u
source "$(dirname "$0")/_stage.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
PY=${PYTHON:-python3}
if [ "${H200X_DRY:-0}" = 1 ]; then  # CPU rehearsal of this script: 8 host devices, reference backend, tiny shape
  export JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 TPM_BACKEND=reference
  export TPM_SHAPES=${TPM_SHAPES:-tiny} TPM_M=${TPM_M:-1,64} TPM_GRAD_M=${TPM_GRAD_M:-64} TPM_PIECES_M=64
  NGPU=8 NMP=2 MP_ARGS="--platform cpu --backend reference --shape tiny --m 1,64 --iters 2"
else
  nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
  NGPU=$(nvidia-smi -L | grep -c '^GPU ') NMP=$NGPU MP_ARGS="--shape qwen3_8b --m 1,4096"
fi
STAGES=${H200X_STAGES:-tp,mp}
TP_BUDGET_S=${TP_BUDGET_S:-390}
BACKEND=${TPM_BACKEND:-pallas_sm90}
LAYOUTS=$($PY -c "from detlogp_jax import backends; print(','.join(x for x in ('vd', 'dv') if x in backends.get('$BACKEND').layouts))")
case ",$LAYOUTS," in
  *,dv,*) ;;
  *) echo "NOTE: $BACKEND does not read the [D, V] layout in this tree (layouts: $LAYOUTS): dv skipped" ;;
esac
export TPM_LAYOUTS=${TPM_LAYOUTS:-$LAYOUTS}
echo "GPUs: $NGPU; stages: $STAGES; layouts: $TPM_LAYOUTS; tp budget ${TP_BUDGET_S}s"
case ",$STAGES," in *,tp,*)
  TAILN=45 stage tp $((TP_BUDGET_S + 45)) $PY tests/gpu/tp_multi.py --budget_s "$TP_BUDGET_S" \
    --trace_dir /tmp/tp_trace --out "$OUT/tp_multi.json"
  # the trace comes back only if small (results.tgz must stay under 16 MiB)
  if [ -d /tmp/tp_trace ] && [ "$(du -sm /tmp/tp_trace | cut -f1)" -le 8 ]; then cp -r /tmp/tp_trace "$OUT/trace"
  elif [ -d /tmp/tp_trace ]; then echo "trace of $(du -sm /tmp/tp_trace | cut -f1) MiB left out"; fi ;;
esac
case ",$STAGES," in *,mp,*)
  if [ "$NMP" -ge 2 ]; then
    # shellcheck disable=SC2086
    TAILN=14 stage mp 125 $PY tests/gpu/tp_multiprocess.py --n "$NMP" $MP_ARGS --layouts "${MP_LAYOUTS:-vd}" \
      --timeout_s 115 --out "$OUT/tp_multiprocess.json"
  else
    echo "=== mp skipped: one GPU"
  fi ;;
esac
finish
