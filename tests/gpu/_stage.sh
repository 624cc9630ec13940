# Shared by tests/gpu/h200_validate.sh, h200_bench.sh, h200_bench_small_m.sh and h200x_tp.sh: time-boxed
# stages whose logs land in /tmp/res, packed into $OUT/results.tgz at the end ($OUT returns
# at most 8 files).
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
REAL_OUT=${OUT:-/tmp/out}; export OUT=/tmp/res; mkdir -p "$OUT" "$REAL_OUT"
stage() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s)"; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n "${TAILN:-8}" "$OUT/$name.log"; }
# RESULTS_NAME (default results): the archive's name, so two scripts in one call keep both.
finish() { ls -la "$OUT"; tar czf "$REAL_OUT/${RESULTS_NAME:-results}.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
