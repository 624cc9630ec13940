# Shared by the device scripts of tests/gpu/: time-boxed stages, each command's output in
# $OUT/<name>.log. By default the logs land in /tmp/res and `finish` packs them into
# $OUT/results.tgz ($OUT returns at most 8 files); with STAGE_DIRECT=1 they are written straight
# into $OUT (what finished comes back even if the call is cut short) and `finish` does nothing.
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
REAL_OUT=${OUT:-/tmp/out}
if [[ ${STAGE_DIRECT:-0} == 1 ]]; then export OUT=$REAL_OUT; else export OUT=/tmp/res; fi
mkdir -p "$OUT" "$REAL_OUT"
stage() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s)"; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n "${TAILN:-8}" "$OUT/$name.log"; }
# RESULTS_NAME (default results): the archive's name, so two scripts in one call keep both.
finish() { [[ $OUT == "$REAL_OUT" ]] && return 0; ls -la "$OUT"
  tar czf "$REAL_OUT/${RESULTS_NAME:-results}.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
