#!/usr/bin/env bash
# Runs the GPU collective benchmark over every configuration and writes the report.
#
#   bench/gpu/run_all.sh [OUT_DIR] [extra nccl_bench.py run arguments...]
#
# OUT_DIR (default bench-out/gpu) gets results.md, results.json, raw/ (per-rank JSON and logs)
# and stats/<config>/ (the plugin's statistics files). Configurations already finished in
# OUT_DIR are skipped (delete raw/<config>.rank*.json to redo one), so a run cut short by a time
# limit continues where it stopped when started again.
#   PYTHON        interpreter (default: python3)
#   CONFIGS       subset, e.g. "socket lossless" (default: all five)
#   NCCL_LOSSY_LIBRARY   the plugin library (default: the package's, or target/release's)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${1:-bench-out/gpu}
shift || true
PY=${PYTHON:-python3}
configs=${CONFIGS:-"socket lossless uniform-1pct bursty-ge-1pct retransmit-1pct"}
export PYTHONPATH="$repo/python/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
for c in $configs; do
  if [ -f "$out/raw/$c.rank0.json" ] && [ -f "$out/raw/$c.rank1.json" ]; then
    echo "== $c: already done in $out, skipped" >&2
    continue
  fi
  echo "== $c" >&2
  "$PY" "$here/nccl_bench.py" run --out "$out" --configs "$c" "$@" > /dev/null
done
"$PY" "$here/nccl_bench.py" report --out "$out"
