# Sourced by scripts/*.sh: finds Python 3.12, creates .venv with pinned deps once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
pick_python() {
  for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 12) else 1)' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  echo "error: Python >= 3.12 is required (pyenv: 'pyenv install 3.12')" >&2; return 1
}
STAMP=".venv/.deps-$(sha256sum requirements/cpu.lock | cut -c1-16)"
if [ ! -x .venv/bin/python ] || [ ! -f "$STAMP" ]; then
  PY="$(pick_python)"
  echo "[setup] creating .venv with $("$PY" --version) and pinned deps (requirements/cpu.lock)" >&2
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -r requirements/cpu.lock
  rm -f .venv/.deps-*; touch "$STAMP"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="$ROOT/.venv/bin/python"
