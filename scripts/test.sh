#!/usr/bin/env bash
# The test command: sets up the platform's interpreter, then runs a tier of the suite
# (pyproject's testpaths = tests; GPU tests skip without a Hopper GPU):
#
#   bash scripts/test.sh              the fast tier: every test not marked `slow`, then the Tunix
#                                     integration's fast tests in their own venv; <= 10 minutes
#                                     on a 2-core CPU machine (it prints its time)
#   bash scripts/test.sh --slow       the slow tier alone (sweeps, large interpret-mode kernels,
#                                     multi-process runs); CI runs it after the fast tier
#   bash scripts/test.sh --full       both tiers (today's whole coverage)
#   bash scripts/test.sh PATH... [pytest args]   those tests, every tier
#
# A tier runs its tests in DETLOGP_TEST_WORKERS (default 2) processes (pytest-xdist, test files
# spread over them; 1 runs them in this process). TUNIX_TEST_SKIP=1 leaves the Tunix tests out (scripts/test_tunix.sh: requirements/cpu.lock +
# requirements/tunix.lock). Platform setup (DETLOGP_PLATFORM, DETLOGP_SETUP=plan, ...): see
# scripts/_env.sh. Tiers: docs/TESTING.md.
TIER=paths
case "${1:-}" in
  --full | --slow) TIER="${1#--}"; shift ;;
  "") TIER=fast ;;
esac
case "$TIER" in
  fast) MARK="not slow" ;;
  slow) MARK="slow" ;;
  *) MARK="" ;;
esac
WORKERS="${DETLOGP_TEST_WORKERS:-2}"
PAR=()  # the tiers' workers (dropped below where pytest-xdist is missing)
[ "$TIER" = paths ] || [ "$WORKERS" -le 1 ] || PAR=(-n "$WORKERS" --dist loadfile)
SEL=("$@")  # the paths tier: the caller's paths and pytest args; a tier: its mark
[ -z "$MARK" ] || SEL=(-m "$MARK")
TUNIX=0
[ "$TIER" = paths ] || [ "${TUNIX_TEST_SKIP:-0}" = 1 ] || TUNIX=1
DETLOGP_WHAT="python -m pytest -q -p no:cacheprovider$(printf ' %q' "${PAR[@]}" "${SEL[@]}")"
[ "$TUNIX" = 0 ] || DETLOGP_WHAT+=" && bash scripts/test_tunix.sh$(printf ' %q' "${SEL[@]}")"
T0=$(date +%s)
source "$(dirname "$0")/_env.sh"
if [ "$TIER" = paths ]; then
  exec "$PYTHON" -m pytest -q -p no:cacheprovider "$@"
fi
[ "${#PAR[@]}" = 0 ] || "$PYTHON" -c "import xdist" 2>/dev/null || PAR=()
if [ "$TUNIX" = 1 ]; then  # the Tunix venv builds (pip: mostly downloads) while the suite runs
  TUNIX_BUILD_LOG="$(mktemp)"
  bash "$(dirname "$0")/test_tunix.sh" --build >"$TUNIX_BUILD_LOG" 2>&1 &
  TUNIX_BUILD=$!
fi
status=0
ok() { "$@" || { local rc=$?; [ "$rc" = 5 ] || return "$rc"; }; }  # pytest's 5: no test of this tier here
ok "$PYTHON" -m pytest -q -p no:cacheprovider "${PAR[@]}" "${SEL[@]}" || status=$?
if [ "$TUNIX" = 1 ]; then
  if ! wait "$TUNIX_BUILD"; then
    cat "$TUNIX_BUILD_LOG" >&2
    echo "error: the Tunix test venv did not build (scripts/test_tunix.sh --build)" >&2
    [ "$status" != 0 ] || status=1
  elif [ "$status" = 0 ]; then
    ok bash "$(dirname "$0")/test_tunix.sh" "${SEL[@]}" || status=$?
  fi
  rm -f "$TUNIX_BUILD_LOG"
fi
echo "[test] $TIER tier: exit $status in $(($(date +%s) - T0)) s (setup included)$([ "$TIER" = fast ] && echo '; budget 600 s on a 2-core CPU machine')"
exit "$status"
