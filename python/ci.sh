#!/usr/bin/env bash
# Tests of the Python helper against real torch and megatron-core (CPU).
#
# Keeps a virtualenv at .venv-ci in the repository root (ignored by git) and rebuilds it only
# when python/requirements-ci.txt or the Python version changes. Builds the plugin library
# (cargo build --release --lib), installs this package with it, runs pytest.
#   NCCL_LOSSY_CI_VENV   another place for the virtualenv
#   PYTHON               the interpreter to build it with (default: python3)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${NCCL_LOSSY_CI_VENV:-$ROOT/.venv-ci}"
PY="${PYTHON:-python3}"
REQ="$ROOT/python/requirements-ci.txt"

want="$(sha256sum "$REQ" | cut -d' ' -f1) $("$PY" -c 'import sys; print(sys.version)' | head -1)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.ci-stamp" 2>/dev/null)" != "$want" ]; then
  echo "python/ci.sh: creating $VENV (torch and megatron-core: a few GB, a few minutes)"
  start=$SECONDS
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -r "$REQ"
  echo "$want" > "$VENV/.ci-stamp"
  echo "python/ci.sh: virtualenv ready in $((SECONDS - start)) s"
fi

# Always (incremental, seconds when nothing changed): a stale library would test old code.
(cd "$ROOT" && cargo build --release --lib)
# Reinstall every run: the package carries the library just built.
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$ROOT/python"
rm -rf "$ROOT/python/build"

cd "$ROOT/python"
"$VENV/bin/python" -m pytest -q tests "$@"
