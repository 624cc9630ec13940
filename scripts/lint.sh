#!/usr/bin/env bash
# The style check: ruff's formatter (--check: nothing is rewritten) and linter over the whole
# repository, configured in pyproject.toml ([tool.ruff]); ruff is pinned in the locks.
# `bash scripts/lint.sh --fix` rewrites instead (format, then the linter's safe fixes).
DETLOGP_WHAT="python -m ruff format --check . && python -m ruff check ."
source "$(dirname "$0")/_env.sh"
if [ "${1:-}" = "--fix" ]; then
  "$PYTHON" -m ruff format . && exec "$PYTHON" -m ruff check --fix .
fi
"$PYTHON" -m ruff format --check . && exec "$PYTHON" -m ruff check .
