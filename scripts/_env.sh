# Sourced by scripts/run.sh and scripts/test.sh (and by anything else that wants the project's
# interpreter): picks the platform, sets up the interpreter for it, prints one check line and
# exports PYTHON (the interpreter), PYTHONPATH (the repo) and JAX_PLATFORMS.
#
# Environment knobs:
#   DETLOGP_PLATFORM  auto (default) | cpu | cuda12 | cuda13 | system
#       cpu / cuda12 / cuda13: a venv holding exactly requirements/<platform>.lock.
#       system: the base interpreter's own packages (no venv, nothing installed), e.g. a machine
#         with jax + jax-cuda13-plugin installed system-wide and no network.
#       auto: no working nvidia-smi -> cpu. A working one (a GPU driver): system if the base
#         interpreter already imports jax == the pinned version and jax.devices()[0] is a GPU,
#         else cuda13 if the driver is >= 580, else cuda12 if >= 525, else an error.
#   DETLOGP_SETUP     unset | plan: print the plan (platform and why, lock, Python, venv) and exit 0
#                     without creating or installing anything.
#   DETLOGP_VENV      the venv directory (default <repo>/.venv; relative to the caller's cwd).
#   DETLOGP_PYTHON    the base interpreter (default: the first Python >= 3.12 among python3.12 on
#                     PATH, ~/.pyenv/versions/3.12*/bin/python3.12, python3 on PATH).
#   JAX_PLATFORMS     respected if set; else set to cpu (cpu, and system without a GPU) or
#                     cuda,cpu (cuda12, cuda13, system with a GPU), which also keeps JAX from
#                     probing for a TPU (the "Unable to initialize backend 'tpu'" line).
#
# The venv records what it holds in <venv>/.detlogp-lock (platform, lock path, lock sha256); when
# the wanted platform or the lock's bytes differ, the venv is deleted and built again from scratch
# (so no CUDA plugin lingers in a cpu venv, nor an old pin anywhere). Progress lines and errors go
# to stderr; the plan goes to stdout. Bad input and failures: one "error: ..." line, exit != 0.
set -euo pipefail
_dl_caller_pwd="$PWD"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

DL_JAX_VERSION=0.11.2  # the jax/jaxlib pin of every lock
# Minimum NVIDIA driver (major version) for JAX's CUDA wheels, from JAX's install guide
# (https://docs.jax.dev/en/latest/installation.html#nvidia-gpu, docs/installation.md in
# jax-ml/jax): "the driver version must be >= 525 for CUDA 12 on Linux, and >= 580 for CUDA 13".
DL_MIN_DRIVER_CUDA13=580
DL_MIN_DRIVER_CUDA12=525

dl_die() { echo "error: $*" >&2; exit "${DL_EXIT:-1}"; }
dl_say() { echo "[setup] $*" >&2; }
dl_rel() { case "$1" in "$ROOT"/*) echo "${1#"$ROOT"/}" ;; *) echo "$1" ;; esac; }
dl_count() { grep -cvE '^[[:space:]]*(#|$)' "$1" || true; }

# -- the knobs -------------------------------------------------------------------------------
DL_REQ="${DETLOGP_PLATFORM:-auto}"
case "$DL_REQ" in
  auto | cpu | cuda12 | cuda13 | system) ;;
  *) DL_EXIT=2 dl_die "DETLOGP_PLATFORM='$DL_REQ' is not one of auto, cpu, cuda12, cuda13, system (unset it for auto)" ;;
esac
DL_MODE="${DETLOGP_SETUP:-run}"
case "$DL_MODE" in
  run | plan) ;;
  *) DL_EXIT=2 dl_die "DETLOGP_SETUP='$DL_MODE' is not 'plan' (print the plan, install nothing); unset it to set up and run" ;;
esac
DL_VENV="${DETLOGP_VENV:-$ROOT/.venv}"
case "$DL_VENV" in /*) ;; *) DL_VENV="$_dl_caller_pwd/$DL_VENV" ;; esac
DL_VENV="${DL_VENV%/}"

# -- the GPU driver --------------------------------------------------------------------------
DL_GPU=absent # absent (no nvidia-smi) | failed (nvidia-smi does not work) | ok (DL_DRIVER set)
DL_DRIVER=""
DL_GPU_WHY="no nvidia-smi on PATH"
if command -v nvidia-smi >/dev/null 2>&1; then
  if _dl_out="$(timeout 60 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null)"; then
    # The first line (one per GPU), cut in the shell: a pipe into `head -n 1` can SIGPIPE the
    # writer once head has its line, and pipefail would turn that into the script's exit (141).
    _dl_first="${_dl_out%%$'\n'*}" _dl_first="${_dl_first//[$' \r']/}"
    if [[ "$_dl_first" =~ ^[0-9]+(\.[0-9]+)*$ ]]; then
      DL_GPU=ok DL_DRIVER="$_dl_first"
    else
      DL_GPU=failed DL_GPU_WHY="nvidia-smi printed no driver version"
    fi
  else
    _dl_rc=$?
    DL_GPU=failed
    if [ "$_dl_rc" = 124 ]; then DL_GPU_WHY="nvidia-smi timed out"; else DL_GPU_WHY="nvidia-smi failed (exit $_dl_rc)"; fi
  fi
fi
DL_DRIVER_MAJOR="${DL_DRIVER%%.*}"

# -- the base interpreter --------------------------------------------------------------------
DL_PY="" DL_PY_VERSION=""
if [ -n "${DETLOGP_PYTHON:-}" ]; then _dl_cands=("$DETLOGP_PYTHON"); else
  _dl_cands=(python3.12 "${HOME:-/nonexistent}"/.pyenv/versions/3.12*/bin/python3.12 python3)
fi
for _dl_c in "${_dl_cands[@]}"; do
  command -v "$_dl_c" >/dev/null 2>&1 || continue
  _dl_info="$("$_dl_c" -c 'import platform, sys
if sys.version_info[:2] < (3, 12): sys.exit(1)
print(platform.python_version(), sys.executable)' 2>/dev/null)" || continue
  [ -n "${_dl_info#* }" ] || continue
  DL_PY_VERSION="${_dl_info%% *}" DL_PY="${_dl_info#* }"
  break
done
if [ -z "$DL_PY" ]; then
  if [ -n "${DETLOGP_PYTHON:-}" ]; then
    dl_die "DETLOGP_PYTHON='$DETLOGP_PYTHON' is not a runnable Python >= 3.12; point it at one, or unset it to search PATH and pyenv"
  fi
  dl_die "Python >= 3.12 not found (tried python3.12 and python3 on PATH, ~/.pyenv/versions/3.12*); install it (e.g. 'pyenv install 3.12') or set DETLOGP_PYTHON=/path/to/python3.12"
fi

# -- the platform (the only place that decides it) -------------------------------------------
# auto on a GPU machine: can the base interpreter serve as it is (jax == pin, GPU seen)?
dl_probe_system() {
  local out
  out="$(JAX_PLATFORMS="${JAX_PLATFORMS-cuda,cpu}" XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 "$DL_PY" "$ROOT/scripts/_setup_check.py" probe "$DL_JAX_VERSION" 2>/dev/null)" ||
    out="no could not be probed (exit $?)"
  DL_SYS_GPU=0
  case "$out" in gpu\ *) DL_SYS_GPU=1 ;; esac
  DL_SYS_WHY="$DL_PY ${out#* }"
}
DL_WARN=""
if [ "$DL_REQ" != auto ]; then
  DL_PLATFORM="$DL_REQ" DL_WHY="DETLOGP_PLATFORM=$DL_REQ"
  if [ "$DL_GPU" = ok ]; then DL_WHY+=", driver $DL_DRIVER"; else DL_WHY+=", $DL_GPU_WHY"; fi
  case "$DL_REQ" in
    cuda13 | cuda12)
      _dl_min=$([ "$DL_REQ" = cuda13 ] && echo $DL_MIN_DRIVER_CUDA13 || echo $DL_MIN_DRIVER_CUDA12)
      if [ "$DL_GPU" = ok ] && [ "$DL_DRIVER_MAJOR" -lt "$_dl_min" ]; then
        DL_WARN="driver $DL_DRIVER < $_dl_min, the minimum for JAX's CUDA ${DL_REQ#cuda} wheels: expect jax to see no GPU"
      fi ;;
  esac
elif [ "$DL_GPU" != ok ]; then
  DL_PLATFORM=cpu DL_WHY="auto: $DL_GPU_WHY, so no usable NVIDIA GPU"
else
  dl_probe_system
  if [ "$DL_SYS_GPU" = 1 ]; then
    DL_PLATFORM=system DL_WHY="auto: driver $DL_DRIVER, and $DL_SYS_WHY"
  elif [ "$DL_DRIVER_MAJOR" -ge "$DL_MIN_DRIVER_CUDA13" ]; then
    DL_PLATFORM=cuda13 DL_WHY="auto: driver $DL_DRIVER >= $DL_MIN_DRIVER_CUDA13 runs JAX's CUDA 13 wheels; not system: $DL_SYS_WHY"
  elif [ "$DL_DRIVER_MAJOR" -ge "$DL_MIN_DRIVER_CUDA12" ]; then
    DL_PLATFORM=cuda12 DL_WHY="auto: driver $DL_DRIVER >= $DL_MIN_DRIVER_CUDA12 (< $DL_MIN_DRIVER_CUDA13) runs JAX's CUDA 12 wheels; not system: $DL_SYS_WHY"
  else
    dl_die "NVIDIA driver $DL_DRIVER is older than $DL_MIN_DRIVER_CUDA12, the minimum for JAX's CUDA 12 wheels; upgrade the driver, or set DETLOGP_PLATFORM=cpu to run on CPU"
  fi
fi

DL_LOCK="" DL_STAMP="" DL_STAMP_WANT=""
if [ "$DL_PLATFORM" != system ]; then
  DL_LOCK="requirements/$DL_PLATFORM.lock"
  [ -f "$ROOT/$DL_LOCK" ] || dl_die "$DL_LOCK is missing from this checkout; restore it (git checkout -- $DL_LOCK)"
  DL_STAMP="$DL_VENV/.detlogp-lock"
  DL_STAMP_WANT="platform=$DL_PLATFORM lock=$DL_LOCK sha256=$(sha256sum "$ROOT/$DL_LOCK" | cut -d' ' -f1)"
fi

if [ -n "${JAX_PLATFORMS+x}" ]; then
  DL_JAXP="${JAX_PLATFORMS} (yours)"
else
  case "$DL_PLATFORM" in
    cpu) export JAX_PLATFORMS=cpu ;;
    cuda12 | cuda13) export JAX_PLATFORMS=cuda,cpu ;;
    system) if [ "$DL_GPU" = ok ]; then export JAX_PLATFORMS=cuda,cpu; else export JAX_PLATFORMS=cpu; fi ;;
  esac
  DL_JAXP="$JAX_PLATFORMS (set by the setup)"
fi

# -- the venv's state ------------------------------------------------------------------------
# DL_VENV_STATE: ok | absent | stale (DL_VENV_WHY says why) | foreign (exists, not a venv)
DL_VENV_STATE="" DL_VENV_WHY=""
if [ -n "$DL_LOCK" ]; then
  if [ ! -e "$DL_VENV" ] || { [ -d "$DL_VENV" ] && [ -z "$(ls -A "$DL_VENV")" ]; }; then
    DL_VENV_STATE=absent DL_VENV_WHY="absent"
  elif [ ! -f "$DL_VENV/pyvenv.cfg" ]; then
    DL_VENV_STATE=foreign
  elif [ ! -f "$DL_STAMP" ]; then
    DL_VENV_STATE=stale DL_VENV_WHY="records no lock (an older or unfinished setup)"
  elif [ "$(cat "$DL_STAMP")" != "$DL_STAMP_WANT" ]; then
    _dl_had="$(tr ' ' '\n' <"$DL_STAMP" | sed -n 's/^platform=//p')"
    if [ "$_dl_had" != "$DL_PLATFORM" ]; then
      DL_VENV_STATE=stale DL_VENV_WHY="holds platform ${_dl_had:-?}, not $DL_PLATFORM"
    else
      DL_VENV_STATE=stale DL_VENV_WHY="$DL_LOCK changed since it was installed"
    fi
  elif ! "$DL_VENV/bin/python" -c '' >/dev/null 2>&1; then
    DL_VENV_STATE=stale DL_VENV_WHY="its python does not run"
  else
    DL_VENV_STATE=ok DL_VENV_WHY="holds $DL_LOCK"
  fi
fi
DL_VENV_SHOW="$(dl_rel "$DL_VENV")"

# -- plan ------------------------------------------------------------------------------------
if [ "$DL_MODE" = plan ]; then
  echo "[plan] platform: $DL_PLATFORM ($DL_WHY)"
  [ -z "$DL_WARN" ] || echo "[plan] warning: $DL_WARN"
  if [ -n "$DL_LOCK" ]; then
    echo "[plan] lock: $DL_LOCK ($(dl_count "$ROOT/$DL_LOCK") packages)"
  else
    echo "[plan] lock: none (system: the interpreter's own packages, nothing installed)"
  fi
  echo "[plan] python: $DL_PY (Python $DL_PY_VERSION)"
  case "$DL_VENV_STATE" in
    "") echo "[plan] venv: none (system)" ;;
    ok) echo "[plan] venv: $DL_VENV_SHOW (up to date: $DL_VENV_WHY)" ;;
    absent) echo "[plan] venv: $DL_VENV_SHOW (absent: would create it and install $DL_LOCK)" ;;
    stale) echo "[plan] venv: $DL_VENV_SHOW ($DL_VENV_WHY: would delete it, create it again and install $DL_LOCK)" ;;
    foreign) echo "[plan] venv: $DL_VENV_SHOW (exists and is not a venv: setup would refuse to touch it)" ;;
  esac
  echo "[plan] JAX_PLATFORMS: $DL_JAXP"
  [ -z "${DETLOGP_WHAT:-}" ] || echo "[plan] then: $DETLOGP_WHAT"
  echo "[plan] nothing was installed (DETLOGP_SETUP=plan)"
  exit 0
fi

# -- setup -----------------------------------------------------------------------------------
[ -z "$DL_WARN" ] || dl_say "warning: $DL_WARN"
if [ "$DL_VENV_STATE" = foreign ]; then
  dl_die "$DL_VENV_SHOW exists and is not a venv, so the setup will not replace it; move it away, or set DETLOGP_VENV to another directory"
fi
if [ "$DL_VENV_STATE" = absent ] || [ "$DL_VENV_STATE" = stale ]; then
  _dl_log="$(mktemp "${TMPDIR:-/tmp}/detlogp-setup.XXXXXX")"
  dl_say "venv $DL_VENV_SHOW: $DL_VENV_WHY; creating it for $DL_PLATFORM with Python $DL_PY_VERSION ($DL_PY)"
  [ "$DL_VENV_STATE" = absent ] || rm -rf "$DL_VENV"
  if ! "$DL_PY" -m venv "$DL_VENV" >"$_dl_log" 2>&1; then
    tail -n 8 "$_dl_log" | sed 's/^/  venv| /' >&2
    dl_die "could not create the venv $DL_VENV_SHOW with $DL_PY (log: $_dl_log); on Debian/Ubuntu install python3.12-venv, or set DETLOGP_PYTHON to another Python >= 3.12"
  fi
  _dl_n="$(dl_count "$ROOT/$DL_LOCK")"
  printf '[setup] installing %s (%s packages) into %s ... ' "$DL_LOCK" "$_dl_n" "$DL_VENV_SHOW" >&2
  _dl_t0=$SECONDS
  if ! "$DL_VENV/bin/python" -m pip install --disable-pip-version-check --no-input -r "$ROOT/$DL_LOCK" >"$_dl_log" 2>&1; then
    echo "failed" >&2
    tail -n 15 "$_dl_log" | sed 's/^/  pip| /' >&2
    dl_die "pip could not install $DL_LOCK into $DL_VENV_SHOW (full log: $_dl_log); check access to PyPI (network, proxy, PIP_INDEX_URL) and rerun, or set DETLOGP_PLATFORM=system to use an interpreter that already has jax"
  fi
  echo "done in $((SECONDS - _dl_t0)) s" >&2
  echo "$DL_STAMP_WANT" >"$DL_STAMP"
  rm -f "$_dl_log"
fi

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DL_PLATFORM" = system ]; then
  PYTHON="$DL_PY" _dl_where="$DL_PY"
else
  PYTHON="$DL_VENV/bin/python" _dl_where="venv $DL_VENV_SHOW"
fi

# -- check: one line, or one error line ------------------------------------------------------
_dl_want_gpu=0
case "$DL_PLATFORM" in
  cuda12 | cuda13) _dl_want_gpu=1 ;;
  system) [ "$DL_GPU" != ok ] || _dl_want_gpu=1 ;;
esac
_dl_rc=0
# (XLA_PYTHON_CLIENT_PREALLOCATE=false: the check need not grab 75% of the GPU's memory.)
_dl_out="$(XLA_PYTHON_CLIENT_PREALLOCATE=false DETLOGP_CHECK_PLATFORM="$DL_PLATFORM" DETLOGP_CHECK_WHERE="$_dl_where" \
  DETLOGP_CHECK_WANT_GPU="$_dl_want_gpu" DETLOGP_CHECK_DRIVER="$DL_DRIVER" DETLOGP_CHECK_JAX="$DL_JAX_VERSION" \
  "$PYTHON" "$ROOT/scripts/_setup_check.py" check 2>/dev/null)" || _dl_rc=$?
case "$_dl_rc:$_dl_out" in
  0:check:*) dl_say "$_dl_out" ;;
  *:error:*) echo "$_dl_out" >&2; exit 1 ;;
  *) dl_die "the setup check crashed in $_dl_where (exit $_dl_rc): run '$PYTHON $ROOT/scripts/_setup_check.py check' to see why" ;;
esac
unset _dl_out _dl_rc _dl_first _dl_info _dl_c _dl_cands _dl_want_gpu _dl_where
