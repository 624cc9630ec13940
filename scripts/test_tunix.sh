#!/usr/bin/env bash
# Runs tests/test_tunix.py (detlogp_jax.integrations.tunix) on CPU in its own venv holding exactly
# requirements/cpu.lock + requirements/tunix.lock (google-tunix and the 73 packages it adds: kept
# out of the main venv, see the header of requirements/tunix.lock). The venv is rebuilt when either
# lock's bytes change. Extra arguments go to pytest.
#
#   bash scripts/test_tunix.sh               # build/reuse the venv, run the tests
#   bash scripts/test_tunix.sh --check-lock  # only check that the two locks are a closed set
#   bash scripts/test_tunix.sh --build       # only build (or reuse) the venv
#
# Knobs (not DETLOGP_*: the op refuses unknown DETLOGP_ variables): TUNIX_TEST_VENV (default
# <repo>/.venv-tunix), TUNIX_TEST_PYTHON (the base interpreter, default the first Python >= 3.12
# among python3.12 on PATH, pyenv's 3.12, python3 on PATH).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${TUNIX_TEST_VENV:-$ROOT/.venv-tunix}"
LOCKS=(requirements/cpu.lock requirements/tunix.lock)

PY=""
if [ -n "${TUNIX_TEST_PYTHON:-}" ]; then CANDS=("$TUNIX_TEST_PYTHON"); else
  CANDS=(python3.12 "${HOME:-/nonexistent}"/.pyenv/versions/3.12*/bin/python3.12 python3)  # as scripts/_env.sh
fi
for c in "${CANDS[@]}"; do
  if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' 2>/dev/null; then
    PY="$c"
    break
  fi
done
[ -n "$PY" ] || { echo "error: Python >= 3.12 not found (set TUNIX_TEST_PYTHON)" >&2; exit 1; }

if [ "${1:-}" = "--check-lock" ]; then
  exec "$PY" - "${LOCKS[@]}" <<'EOF'
import json, os, subprocess, sys, tempfile
norm = lambda n: n.lower().replace("_", "-").replace(".", "-")
want = {}
for path in sys.argv[1:]:
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            want[norm(name)] = version
with tempfile.TemporaryDirectory() as tmp:
    report = os.path.join(tmp, "report.json")
    args = [a for p in sys.argv[1:] for a in ("-r", p)]
    subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                    "--report", report, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    got = {norm(i["metadata"]["name"]): i["metadata"]["version"] for i in json.load(open(report))["install"]}
diff = sorted(set(got.items()) ^ set(want.items()))
if diff:
    print("the locks are not a closed set; pip resolves them differently:", diff, file=sys.stderr)
    sys.exit(1)
print(f"closed: {len(got)} pins")
EOF
fi

WANT="$(cat "${LOCKS[@]}" | sha256sum | cut -d' ' -f1)"
STAMP="$VENV/.detlogp-tunix-lock"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "[test_tunix] building $VENV from ${LOCKS[*]}" >&2
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # (pip's notes about index locations that do not exist on this machine are dropped)
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements/cpu.lock -r requirements/tunix.lock \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  echo "$WANT" >"$STAMP"
fi
[ "${1:-}" != "--build" ] || exit 0
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_tunix.py "$@"
