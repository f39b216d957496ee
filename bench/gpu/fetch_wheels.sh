#!/usr/bin/env bash
# Prepares bench/gpu/carry/ (git-ignored) for a GPU machine without internet, on a machine with
# internet:
#   carry/wheels/  megatron-core 0.16.1 and its non-torch dependencies (numpy, packaging) for
#                  CPython 3.10, 3.11 and 3.12 on Linux x86_64 (pure-Python wheels where they
#                  exist; megatron-core and numpy are platform wheels, one per Python version)
#   carry/lib/     the plugin library, stripped of debug symbols (from target/release)
#
#   bench/gpu/fetch_wheels.sh            # PYVERS="3.11" to fetch for fewer Python versions
#   NUMPY=0 bench/gpu/fetch_wheels.sh    # skip numpy (about 16 MiB per Python version; torch does
#                                        # not require it, so a GPU machine may lack it)
#   NCCL_LOSSY_LIBRARY=path              # the library to carry (default target/release's)
#
# On the GPU machine: pip install --no-index --find-links bench/gpu/carry/wheels megatron-core==0.16.1
# (pip picks the wheel for its Python). torch is not fetched: the GPU machine has its own.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
carry="$here/carry"
PY=${PYTHON:-python3}
pyvers=${PYVERS:-"3.10 3.11 3.12"}
mkdir -p "$carry/wheels" "$carry/lib"

fetch() {  # fetch PYVER SPEC...: binary wheels for that CPython on manylinux x86_64, no deps
  local v=$1; shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --dest "$carry/wheels" \
    --python-version "$v" --implementation cp --abi "cp${v/./}" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"
}

for v in $pyvers; do
  fetch "$v" megatron-core==0.16.1
  if [ "${NUMPY:-1}" = 1 ]; then fetch "$v" "numpy<2.3"; fi  # numpy 2.3+ has no 3.10 wheels
done
# Pure-Python dependency, one wheel for every version.
"$PY" -m pip download -q --no-deps --only-binary=:all: --dest "$carry/wheels" "packaging>=24.2"

lib=${NCCL_LOSSY_LIBRARY:-$repo/target/release/libnccl_net_lossy.so}
if [ -f "$lib" ]; then
  if command -v strip >/dev/null; then
    strip --strip-debug -o "$carry/lib/libnccl_net_lossy.so" "$lib"
  else
    cp "$lib" "$carry/lib/libnccl_net_lossy.so"
  fi
else
  echo "fetch_wheels.sh: $lib not built (cargo build --release --lib); carry/lib left empty" >&2
fi

echo "carry directory $carry:" >&2
(cd "$carry" && find . -type f -printf '%10s  %p\n' | sort -k2) >&2
total=$(du -sb "$carry" | cut -f1)
echo "total: $total bytes ($((total / 1048576)) MiB; the limit for carried paths is 64 MiB)" >&2
if [ "$total" -gt $((60 * 1048576)) ]; then
  echo "fetch_wheels.sh: over 60 MiB: use PYVERS with the GPU machine's Python only, or NUMPY=0" >&2
  exit 1
fi
